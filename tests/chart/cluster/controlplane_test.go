//go:build cluster

package cluster

import (
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/kubetest"
)

// controlPlane is the shared real API server harness (pkg/kubetest).
type controlPlane = kubetest.ControlPlane

func startControlPlane(t *testing.T) *controlPlane { return kubetest.Start(t) }

func waitFor(t *testing.T, what string, timeout time.Duration, cond func() error) {
	t.Helper()
	kubetest.WaitFor(t, what, timeout, cond)
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
