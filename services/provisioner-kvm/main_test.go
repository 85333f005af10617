package main

import (
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
)

// block is a valid kvm block whose host and key files are not there.
const block = `kvm:
  domainType: qemu
  images: {tiny: {url: "http://127.0.0.1:1/tiny.qcow2"}}
  machineTypes: {small: {vcpus: 1, memoryMiB: 256}}
  hosts:
    - {name: h1, address: "127.0.0.1:1", user: virt, keyFile: /nonexistent/key, knownHostsFile: /nonexistent/known_hosts, bridge: br0}
`

func kvmHome(block string) provisionertest.Provider {
	return provisionertest.Provider{Name: "kvm-home", Type: "kvm", Block: block}
}

func TestMain(m *testing.M) { provisionertest.VerifyNoLeaks(m) }

// It starts and serves whether NATS is up or down, and while its host and
// key files are not there: a WARNING, not a failure, and no key material
// in the log.
func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	binary.AssertLifecycle(t, kvmHome(block))
	p := binary.Start(t, kvmHome(block), provisionertest.StartOptions{})
	p.WaitLog(t, time.Minute, proctest.Msg("WARNING: the SSH key material of a kvm host is not usable; its operations fail until it is"))
	if strings.Contains(p.Output(), "BEGIN OPENSSH") {
		t.Error("key material in the log")
	}
}

// A misconfigured process exits 1 at once, saying why.
func TestBinaryRefusesBadConfig(t *testing.T) {
	t.Parallel()
	binary.AssertRefuses(t, []provisionertest.Refusal{
		{Name: "unknown key", Providers: []provisionertest.Provider{kvmHome(block + "  diskSizeGB: 3\n")}, Provider: "kvm-home", Want: "providers[0].kvm.diskSizeGB"},
		{Name: "host name with a slash", Providers: []provisionertest.Provider{kvmHome(strings.Replace(block, "name: h1", "name: dc1/rack2", 1))},
			Provider: "kvm-home", Want: `hosts[0].name \"dc1/rack2\": letters, digits`},
	})
}
