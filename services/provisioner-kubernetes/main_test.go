package main

import (
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
)

var binary = provisionertest.Binary{Package: ".", Service: "provisioner-kubernetes"}

func kube(block string) provisionertest.Provider {
	return provisionertest.Provider{Name: "kube", Type: "kubernetes", Block: block}
}

func TestMain(m *testing.M) { provisionertest.VerifyNoLeaks(m) }

// The process starts and serves while its kubeconfig is missing (it says
// so with a WARNING), whether NATS is up or down.
func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	p := kube("kubernetes: {namespace: proxies, kubeconfig: " + t.TempDir() + "/missing}\n")
	binary.AssertLifecycle(t, p)
	line := binary.Start(t, p, provisionertest.StartOptions{}).WaitLog(t, 30*time.Second, func(m map[string]any) bool {
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
	binary.AssertRefuses(t, []provisionertest.Refusal{
		{Name: "another type", Providers: []provisionertest.Provider{kube("kubernetes: {namespace: proxies}\n"), {Name: "box", Type: "local"}}, Provider: "box",
			Want: "is a local provider; this binary serves kubernetes"},
		{Name: "unknown key", Providers: []provisionertest.Provider{kube("kubernetes:\n  namespace: proxies\n  zones: {fra: {nodeSelectr: {a: b}}}\n")}, Provider: "kube",
			Want: "providers[0].kubernetes.zones.fra.nodeSelectr: unknown field"},
		{Name: "invalid block", Providers: []provisionertest.Provider{kube("kubernetes: {image: squid}\n")}, Provider: "kube", Want: "namespace is required"},
	})
}
