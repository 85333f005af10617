//go:build cluster

package cluster

import (
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/kubetest"
)

// controlPlane is the shared real API server harness (pkg/kubetest).
type controlPlane = kubetest.ControlPlane

func startControlPlane(t *testing.T) *controlPlane { return kubetest.Start(t) }

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
