package main

import (
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
)

// The binary starts (the services it shows need not be up: it dials them
// lazily, per page), serves /healthz, /readyz, /metrics and gRPC health,
// and stops on SIGTERM.
func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	servicetest.AssertLifecycle(t, ".", "console", []string{
		"--orchestrator-addr=127.0.0.1:9", "--lease-addr=127.0.0.1:9", "--health-addr=127.0.0.1:9",
	})
}
