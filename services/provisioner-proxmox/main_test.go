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
	nats := natstest.New(t)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "providers.yaml")
	if err := os.WriteFile(cfg, []byte(`providers:
  - name: pve
    type: proxmox
    proxmox:
      url: https://127.0.0.1:1
      tokenFile: `+filepath.Join(dir, "token")+`
      nodes: [pv1-1]
      isoStorage: proxy-seeds
      templates: {debian-13: {vmid: 9001}}
      machineTypes: {small: {cores: 1, memoryMiB: 1024}}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	servicetest.AssertLifecycle(t, ".", "provisioner-proxmox",
		[]string{"--providers-config=" + cfg, "--provider=pve", "--nats-url=" + nats.URL(), "--nats-prefix=lc"})
}
