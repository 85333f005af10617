// Package storetest gives tests a migrated health database of their own.
package storetest

import (
	"context"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store"
)

// Template is the migrated health schema.
var Template = pgtest.Template{
	Name:        "health",
	Fingerprint: pgtest.Fingerprint(store.Migrations()),
	Migrate: func(ctx context.Context, dsn string) error {
		return store.Migrate(ctx, dsn, nil)
	},
}

// New returns the URL of a fresh migrated database and a store on it; both
// go when the test ends.
func New(t testing.TB) (string, *store.Store) {
	t.Helper()
	dsn := pgtest.NewDatabase(t, Template)
	ctx := context.Background()
	pool, err := postgres.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return dsn, store.New(pool)
}
