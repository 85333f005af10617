package main

import (
	"context"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store/storetest"
)

// The binary starts and serves whether NATS is up or down.
func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	for name, natsURL := range map[string]string{"NATS up": natstest.New(t).URL(), "NATS down": natstest.DownURL(t)} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dsn, _ := storetest.New(t)
			servicetest.AssertLifecycle(t, ".", "health", []string{
				"--database-url=" + dsn,
				"--nats-url=" + natsURL,
				"--probe-target=https://127.0.0.1:9/",
				"--auth-disabled",
			})
		})
	}
}

// TestMigrateSubcommand applies the schema with `health migrate` to an
// empty database and exits.
func TestMigrateSubcommand(t *testing.T) {
	t.Parallel()
	dsn := pgtest.NewDatabase(t, pgtest.Template{Name: "emptydb", Fingerprint: "empty",
		Migrate: func(context.Context, string) error { return nil }})
	bin := proctest.Build(t, ".")
	for range 2 { // idempotent
		p := proctest.Start(t, bin, []string{"migrate", "--database-url=" + dsn})
		if code := p.Wait(t, 60*time.Second); code != 0 {
			t.Fatalf("health migrate exited %d:\n%s", code, p.Output())
		}
	}
	ctx := context.Background()
	pool, err := postgres.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = 'health'
		AND table_name IN ('transitions', 'retention', 'proxy_health', 'provider_health')`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 4 {
		t.Errorf("%d of the 4 health tables exist after migrate", n)
	}
}
