package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
)

func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	providers := filepath.Join(dir, "providers.yaml")
	conf := "providers:\n  - name: local\n    type: local\n    local: {stateDir: " + filepath.Join(dir, "state") + ", proxy: builtin}\n"
	if err := os.WriteFile(providers, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	tokens := filepath.Join(dir, "api-tokens")
	if err := os.WriteFile(tokens, []byte("health svc-token service\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// It starts and serves whether NATS is up or down.
	for name, natsURL := range map[string]string{"NATS up": natstest.New(t).URL(), "NATS down": natstest.DownURL(t)} {
		t.Run(name, func(t *testing.T) {
			servicetest.AssertLifecycle(t, ".", "provisioner-local", []string{
				"--providers-config=" + providers, "--provider=local", "--nats-url=" + natsURL, "--auth-token-file=" + tokens,
			})
		})
	}
}
