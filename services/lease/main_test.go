package main

import (
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/leasetest"
)

// The binary starts and serves whether NATS is up or down.
func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	for name, natsURL := range map[string]string{"NATS up": natstest.New(t).URL(), "NATS down": natstest.DownURL(t)} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			servicetest.AssertLifecycle(t, ".", "lease", []string{
				"--database-url=" + leasetest.Database(t), "--nats-url=" + natsURL, "--auth-disabled",
			})
		})
	}
}
