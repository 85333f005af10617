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

const block = `    gcp:
      project: egress-test
      zones: [europe-west1-b]
      machineTypes: [e2-small]
      images: {debian-13: projects/debian-cloud/global/images/family/debian-13}
`

func write(t *testing.T, dir, name, body string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// The process starts and serves while its credentials file is missing
// (it says so with a WARNING), whether NATS is up or down.
func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	nats := natstest.New(t)
	dir := t.TempDir()
	cfg := write(t, dir, "providers.yaml", "providers:\n  - name: gce\n    type: gcp\n"+block+
		"      credentialsFile: "+filepath.Join(dir, "missing.json")+"\n")
	for name, natsURL := range map[string]string{"NATS up": nats.URL(), "NATS down": natstest.DownURL(t)} {
		t.Run(name, func(t *testing.T) {
			servicetest.AssertLifecycle(t, ".", "provisioner-gcp",
				[]string{"--providers-config=" + cfg, "--provider=gce", "--nats-url=" + natsURL, "--nats-prefix=lc", "--auth-disabled"})
		})
	}
	p, _ := servicetest.Start(t, ".", []string{"--providers-config=" + cfg, "--provider=gce", "--nats-url=" + nats.URL(), "--nats-prefix=lc2", "--auth-disabled"})
	line := p.WaitLog(t, 30*time.Second, func(m map[string]any) bool {
		msg, _ := m["msg"].(string)
		return strings.HasPrefix(msg, "WARNING: credentials file is not readable")
	})
	if line["reason"] != "no such file or directory" {
		t.Errorf("warning %v", line)
	}
}

// A misconfigured process exits 1 at once, saying why.
func TestBinaryRefusesBadConfig(t *testing.T) {
	t.Parallel()
	nats := natstest.New(t)
	dir := t.TempDir()
	good := write(t, dir, "good.yaml", "providers:\n  - name: gce\n    type: gcp\n"+block+"  - name: box\n    type: local\n")
	typo := write(t, dir, "typo.yaml", "providers:\n  - name: gce\n    type: gcp\n"+block+"      serviceAccount: {email: a@b.c, scopez: [x]}\n")
	invalid := write(t, dir, "invalid.yaml", "providers:\n  - name: gce\n    type: gcp\n    gcp:\n      project: egress-test\n      zones: [europe-west1]\n")
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"another type", []string{"--providers-config=" + good, "--provider=box"}, "is a local provider; this binary serves gcp"},
		{"unknown key", []string{"--providers-config=" + typo, "--provider=gce"}, "providers[0].gcp.serviceAccount.scopez: unknown field"},
		{"invalid block", []string{"--providers-config=" + invalid, "--provider=gce"}, `zones[0] \"europe-west1\" is not a zone`},
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
