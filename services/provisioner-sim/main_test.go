package main

import (
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
)

func TestMain(m *testing.M) { provisionertest.VerifyNoLeaks(m) }

func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	binary.AssertLifecycle(t, provisionertest.Provider{Name: "sim", Type: "sim",
		Block: "sim: {farm: \"http://127.0.0.1:1\"}\n"})
}
