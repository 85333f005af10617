package main

import (
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
)

// The binary starts (the lease service need not be up: it is dialled
// lazily), serves /healthz, /readyz, /metrics and gRPC health, and stops
// on SIGTERM.
func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	servicetest.AssertLifecycle(t, ".", "gateway", []string{
		"--auth-disabled", "--lease-addr=127.0.0.1:9", "--proxy-listen=127.0.0.1:0", "--socks-listen=127.0.0.1:0",
	})
}
