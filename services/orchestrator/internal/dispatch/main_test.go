package dispatch_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Every loop the tests start must stop with its replica.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// The embedded nats-server's and pgx's process-wide helpers.
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*Server).startGoRoutine.func1"),
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
	)
}
