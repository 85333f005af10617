package postgres_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Every singleton's watcher must stop with its Run.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"))
}
