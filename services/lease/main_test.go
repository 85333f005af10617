package main

import (
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/leasetest"
)

func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	db := leasetest.Database(t)
	nsrv := natstest.New(t)
	servicetest.AssertLifecycle(t, ".", "lease", []string{
		"--database-url=" + db, "--nats-url=" + nsrv.URL(), "--auth-disabled",
	})
}
