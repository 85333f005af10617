// Package orchtest is the orchestrator's test harness, for the tests of
// every package that needs the real thing: a migrated PostgreSQL database
// of the test's own (Database), and a Harness — that database, an
// in-process NATS JetStream server, the API served over gRPC, and any
// number of orchestrator replicas — with scripted provisioners
// (StartProvisioner, Cloud) and waits on the store's state (WaitFor).
// Main is the TestMain of every package whose tests start the harness.
package orchtest

import (
	"context"
	"testing"

	"go.uber.org/goleak"

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

// Main runs a package's tests and fails when a goroutine they started is
// still running after them: every loop a replica starts must stop with it.
func Main(m *testing.M) {
	goleak.VerifyTestMain(m,
		// The embedded nats-server's and pgx's process-wide helpers.
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*Server).startGoRoutine.func1"),
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
	)
}
