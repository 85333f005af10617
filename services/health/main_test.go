package main

import (
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store/storetest"
)

func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	dsn, _ := storetest.New(t)
	ns := natstest.New(t)
	servicetest.AssertLifecycle(t, ".", "health", []string{
		"--database-url=" + dsn,
		"--nats-url=" + ns.URL(),
		"--probe-target=https://127.0.0.1:9/",
		"--auth-disabled",
	})
}
