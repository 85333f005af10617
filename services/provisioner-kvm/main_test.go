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

const kvmBlock = `    kvm:
      domainType: qemu
      images: {tiny: {url: "http://127.0.0.1:1/tiny.qcow2"}}
      machineTypes: {small: {vcpus: 1, memoryMiB: 256}}
      hosts:
        - {name: h1, address: "127.0.0.1:1", user: virt, keyFile: /nonexistent/key, knownHostsFile: /nonexistent/known_hosts, bridge: br0}
`

func writeFile(t *testing.T, dir, name, body string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// It starts and serves whether NATS is up or down, and while its host and
// key files are not there (a WARNING, not a failure).
func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	nats := natstest.New(t)
	cfg := writeFile(t, t.TempDir(), "providers.yaml", "providers:\n  - name: kvm-home\n    type: kvm\n"+kvmBlock)
	for name, natsURL := range map[string]string{"NATS up": nats.URL(), "NATS down": natstest.DownURL(t)} {
		t.Run(name, func(t *testing.T) {
			servicetest.AssertLifecycle(t, ".", "provisioner-kvm",
				[]string{"--providers-config=" + cfg, "--provider=kvm-home", "--nats-url=" + natsURL, "--nats-prefix=lc", "--auth-disabled"})
		})
	}
}

// A misconfigured process exits 1 at once, saying why; a missing key file
// is only a WARNING.
func TestBinaryStartupChecks(t *testing.T) {
	t.Parallel()
	nats := natstest.New(t)
	dir := t.TempDir()
	good := writeFile(t, dir, "good.yaml", "providers:\n  - name: kvm-home\n    type: kvm\n"+kvmBlock)
	typo := writeFile(t, dir, "typo.yaml", "providers:\n  - name: kvm-home\n    type: kvm\n"+kvmBlock+"      diskSizeGB: 3\n")
	slash := writeFile(t, dir, "slash.yaml", "providers:\n  - name: kvm-home\n    type: kvm\n"+strings.Replace(kvmBlock, "name: h1", "name: dc1/rack2", 1))
	bin := proctest.Build(t, ".")
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"unknown key", []string{"--providers-config=" + typo, "--provider=kvm-home"}, "providers[0].kvm.diskSizeGB"},
		{"host name with a slash", []string{"--providers-config=" + slash, "--provider=kvm-home"}, `hosts[0].name \"dc1/rack2\": letters, digits`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := proctest.Start(t, bin, append([]string{"--grpc-listen=127.0.0.1:0", "--http-listen=127.0.0.1:0", "--nats-url=" + nats.URL(), "--auth-disabled"}, tc.args...))
			if code := p.Wait(t, 60*time.Second); code != 1 {
				t.Errorf("exit code %d, want 1", code)
			}
			if !strings.Contains(p.Output(), tc.want) {
				t.Errorf("output lacks %q:\n%s", tc.want, p.Output())
			}
		})
	}
	t.Run("missing key file warns", func(t *testing.T) {
		t.Parallel()
		p := proctest.Start(t, bin, []string{"--grpc-listen=127.0.0.1:0", "--http-listen=127.0.0.1:0", "--nats-url=" + nats.URL(),
			"--providers-config=" + good, "--provider=kvm-home", "--auth-disabled"})
		p.WaitLog(t, 60*time.Second, proctest.Msg("WARNING: the SSH key material of a kvm host is not usable; its operations fail until it is"))
		if strings.Contains(p.Output(), "BEGIN OPENSSH") {
			t.Error("key material in the log")
		}
	})
}
