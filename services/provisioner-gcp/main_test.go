package main

import (
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
)

const block = `gcp:
  project: egress-test
  zones: [europe-west1-b]
  machineTypes: [e2-small]
  images: {debian-13: projects/debian-cloud/global/images/family/debian-13}
`

func gce(block string) provisionertest.Provider {
	return provisionertest.Provider{Name: "gce", Type: "gcp", Block: block}
}

func TestMain(m *testing.M) { provisionertest.VerifyNoLeaks(m) }

// The process starts and serves while its credentials file is missing
// (it says so with a WARNING), whether NATS is up or down.
func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	p := gce(block + "  credentialsFile: " + t.TempDir() + "/missing.json\n")
	binary.AssertLifecycle(t, p)
	line := binary.Start(t, p, provisionertest.StartOptions{}).WaitLog(t, 30*time.Second, func(m map[string]any) bool {
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
	binary.AssertRefuses(t, []provisionertest.Refusal{
		{Name: "another type", Providers: []provisionertest.Provider{gce(block), {Name: "box", Type: "local"}}, Provider: "box",
			Want: "is a local provider; this binary serves gcp"},
		{Name: "unknown key", Providers: []provisionertest.Provider{gce(block + "  serviceAccount: {email: a@b.c, scopez: [x]}\n")}, Provider: "gce",
			Want: "providers[0].gcp.serviceAccount.scopez: unknown field"},
		{Name: "invalid block", Providers: []provisionertest.Provider{gce("gcp:\n  project: egress-test\n  zones: [europe-west1]\n")}, Provider: "gce",
			Want: `zones[0] \"europe-west1\" is not a zone`},
	})
}
