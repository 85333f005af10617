package main

import (
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
)

func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	servicetest.AssertLifecycle(t, ".", "provisioner-gcp", nil)
}
