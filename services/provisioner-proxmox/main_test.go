package main

import (
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
)

func TestMain(m *testing.M) { provisionertest.VerifyNoLeaks(m) }

// block is a valid proxmox block whose API is not there.
const block = `proxmox:
  url: https://127.0.0.1:1
  tokenFile: /nonexistent
  nodes: [pv1-1]
  isoStorage: proxy-seeds
  templates: {debian-13: {vmid: 9001}}
  machineTypes: {small: {cores: 1, memoryMiB: 1024}}
`

func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	binary.AssertLifecycle(t, provisionertest.Provider{Name: "pve", Type: "proxmox", Block: block})
}

// A misconfigured process exits 1 at once, saying why.
func TestBinaryRefusesBadConfig(t *testing.T) {
	t.Parallel()
	pve := func(block string) provisionertest.Provider {
		return provisionertest.Provider{Name: "pve", Type: "proxmox", Block: block}
	}
	good := []provisionertest.Provider{pve(block), {Name: "box", Type: "local"}}
	binary.AssertRefuses(t, []provisionertest.Refusal{
		{Name: "no provider", Providers: good, Want: "--providers-config and --provider are required"},
		{Name: "unknown provider", Providers: good, Provider: "nope", Want: `--provider \"nope\" is not in`},
		{Name: "another type", Providers: good, Provider: "box", Want: "is a local provider; this binary serves proxmox"},
		{Name: "unknown key", Providers: []provisionertest.Provider{pve(block + "  tokenFlie: /x\n")}, Provider: "pve", Want: "providers[0].proxmox.tokenFlie"},
		{Name: "invalid block", Providers: []provisionertest.Provider{pve("proxmox:\n  url: http://pve\n")}, Provider: "pve", Want: "want https://"},
	})
}
