package main

import (
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
)

func TestMain(m *testing.M) { provisionertest.VerifyNoLeaks(m) }

func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	binary.AssertLifecycle(t, provisionertest.Provider{Name: "local", Type: "local",
		Block: "local: {stateDir: " + t.TempDir() + ", proxy: builtin}\n"})
}
