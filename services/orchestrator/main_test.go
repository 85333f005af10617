package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	providers := filepath.Join(t.TempDir(), "providers.yaml")
	if err := os.WriteFile(providers, []byte("providers:\n  - {name: local, type: local}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	servicetest.AssertLifecycle(t, ".", "orchestrator", []string{
		"--auth-disabled",
		"--providers-config=" + providers,
		"--database-url=" + orchtest.Database(t),
		"--nats-url=" + natstest.New(t).URL(),
	})
}
