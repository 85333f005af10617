// Package orchtest gives orchestrator tests a migrated database of their
// own.
package orchtest

import (
	"context"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// Template is the orchestrator schema's test template.
var Template = pgtest.Template{
	Name:        "orchestrator",
	Fingerprint: pgtest.Fingerprint(store.Migrations()),
	Migrate: func(ctx context.Context, dsn string) error {
		return store.Migrate(ctx, dsn, nil)
	},
}

// Database returns the URL of a fresh migrated database for t.
func Database(t testing.TB) string {
	t.Helper()
	return pgtest.NewDatabase(t, Template)
}
