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

func write(t *testing.T, dir, name, body string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// The process starts and serves while its kubeconfig is missing (it says
// so with a WARNING), whether NATS is up or down.
func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	nats := natstest.New(t)
	dir := t.TempDir()
	cfg := write(t, dir, "providers.yaml", "providers:\n  - name: kube\n    type: kubernetes\n    kubernetes:\n      namespace: proxies\n"+
		"      kubeconfig: "+filepath.Join(dir, "missing")+"\n")
	for name, natsURL := range map[string]string{"NATS up": nats.URL(), "NATS down": natstest.DownURL(t)} {
		t.Run(name, func(t *testing.T) {
			servicetest.AssertLifecycle(t, ".", "provisioner-kubernetes",
				[]string{"--providers-config=" + cfg, "--provider=kube", "--nats-url=" + natsURL, "--nats-prefix=lc", "--auth-disabled"})
		})
	}
	p, _ := servicetest.Start(t, ".", []string{"--providers-config=" + cfg, "--provider=kube", "--nats-url=" + nats.URL(), "--nats-prefix=lc2", "--auth-disabled"})
	line := p.WaitLog(t, 30*time.Second, func(m map[string]any) bool {
		msg, _ := m["msg"].(string)
		return strings.HasPrefix(msg, "WARNING: kubeconfig is not readable")
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
	good := write(t, dir, "good.yaml", "providers:\n  - name: kube\n    type: kubernetes\n    kubernetes: {namespace: proxies}\n  - name: box\n    type: local\n")
	typo := write(t, dir, "typo.yaml", "providers:\n  - name: kube\n    type: kubernetes\n    kubernetes:\n      namespace: proxies\n      zones: {fra: {nodeSelectr: {a: b}}}\n")
	invalid := write(t, dir, "invalid.yaml", "providers:\n  - name: kube\n    type: kubernetes\n    kubernetes: {image: squid}\n")
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"another type", []string{"--providers-config=" + good, "--provider=box"}, "is a local provider; this binary serves kubernetes"},
		{"unknown key", []string{"--providers-config=" + typo, "--provider=kube"}, "providers[0].kubernetes.zones.fra.nodeSelectr: unknown field"},
		{"invalid block", []string{"--providers-config=" + invalid, "--provider=kube"}, "namespace is required"},
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
