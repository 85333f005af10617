package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
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
	tokens := filepath.Join(dir, "api-tokens")
	if err := os.WriteFile(tokens, []byte("health svc-token service\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// It starts and serves whether NATS is up or down.
	for name, natsURL := range map[string]string{"NATS up": nats.URL(), "NATS down": natstest.DownURL(t)} {
		t.Run(name, func(t *testing.T) {
			servicetest.AssertLifecycle(t, ".", "provisioner-proxmox",
				[]string{"--providers-config=" + cfg, "--provider=pve", "--nats-url=" + natsURL, "--nats-prefix=lc", "--auth-token-file=" + tokens})
		})
	}
}

// A misconfigured process exits 1 at once, saying why.
func TestBinaryRefusesBadConfig(t *testing.T) {
	t.Parallel()
	nats := natstest.New(t)
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	block := `    proxmox:
      url: https://127.0.0.1:1
      tokenFile: /nonexistent
      nodes: [pv1-1]
      isoStorage: proxy-seeds
      templates: {debian-13: {vmid: 9001}}
      machineTypes: {small: {cores: 1, memoryMiB: 1024}}
`
	good := write("good.yaml", "providers:\n  - name: pve\n    type: proxmox\n"+block+"  - name: box\n    type: local\n")
	typo := write("typo.yaml", "providers:\n  - name: pve\n    type: proxmox\n"+block+"      tokenFlie: /x\n")
	invalid := write("invalid.yaml", "providers:\n  - name: pve\n    type: proxmox\n    proxmox:\n      url: http://pve\n")
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"no provider", []string{"--providers-config=" + good}, "--providers-config and --provider are required"},
		{"unknown provider", []string{"--providers-config=" + good, "--provider=nope"}, `--provider \"nope\" is not in`},
		{"another type", []string{"--providers-config=" + good, "--provider=box"}, "is a local provider; this binary serves proxmox"},
		{"unknown key", []string{"--providers-config=" + typo, "--provider=pve"}, "providers[0].proxmox.tokenFlie"},
		{"invalid block", []string{"--providers-config=" + invalid, "--provider=pve"}, "want https://"},
	}
	bin := proctest.Build(t, ".")
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			args := append([]string{"--grpc-listen=127.0.0.1:0", "--http-listen=127.0.0.1:0", "--nats-url=" + nats.URL(), "--auth-disabled"}, tc.args...)
			p := proctest.Start(t, bin, args)
			if code := p.Wait(t, 60*time.Second); code != 1 {
				t.Errorf("exit code %d, want 1", code)
			}
			if !strings.Contains(p.Output(), tc.want) {
				t.Errorf("output lacks %q:\n%s", tc.want, p.Output())
			}
		})
	}
}
