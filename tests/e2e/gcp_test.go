//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// The orchestrator and provisioner-gcp agree on the contract, against the
// fake Compute Engine API run as its own process: a proxy becomes Running
// with the instance's external address; a zone out of quota shows as the
// proxy's QuotaExceeded reason with the slower backoff; delete leaves no
// instance behind.
func TestGCPBackend(t *testing.T) {
	s := newSuite(t)
	const okZone, quotaZone = "europe-west1-b", "us-central1-a"
	fake := proctest.Start(t, proctest.Build(t, "../../services/provisioner-gcp/internal/gcpfake/cmd/gcpfake"),
		[]string{"--listen=127.0.0.1:0", "--project=egress-e2e", "--zones=" + okZone + "," + quotaZone, "--quota-zones=" + quotaZone})
	var apiURL string
	waittest.For(t, 30*time.Second, "the fake Compute API", func() bool {
		for _, line := range strings.Split(fake.Output(), "\n") {
			if u, ok := strings.CutPrefix(strings.TrimSpace(line), "url: "); ok {
				apiURL = u
				return true
			}
		}
		return false
	})
	s.providers = s.write("providers.yaml", `providers:
  - name: gce-fake
    type: gcp
    gcp:
      project: egress-e2e
      zones: [`+okZone+`, `+quotaZone+`]
      machineTypes: [e2-small]
      images: {debian-13: projects/debian-cloud/global/images/family/debian-13}
      operationWaitSeconds: 5
      endpoint: `+apiURL+`
      withoutAuthentication: true
`)
	servicetest.Start(t, "../../services/provisioner-gcp", append([]string{"--nats-url=" + s.nats.URL(),
		"--providers-config=" + s.providers, "--provider=gce-fake", "--replica-id=gce-1", "--log-level=debug"}, s.serving()...))
	s.startOrchestrator()
	c := s.proxies()
	for _, p := range []struct{ name, zone string }{{"gce-00", okZone}, {"quota-00", quotaZone}} {
		_, err := c.CreateProxy(ctx(t, 30*time.Second), &proxyv1.CreateProxyRequest{Name: p.name, Spec: &proxyv1.ProxySpec{
			Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "gce-fake", CloudInit: "#cloud-config\n",
			Placement: &proxyv1.Placement{Zone: p.zone, MachineType: "e2-small", Image: "debian-13"},
		}})
		if err != nil {
			t.Fatal(err)
		}
	}

	p := s.waitAll("gce", 1, "Running", 2*time.Minute, running)[0]
	wantPID := "zones/" + okZone + "/instances/proxy-" + p.GetUid()
	if p.GetStatus().GetProviderId() != wantPID || !strings.HasPrefix(p.GetStatus().GetIp(), "203.0.") {
		t.Errorf("status %v, want providerID %s and the fake's natIP", p.GetStatus(), wantPID)
	}
	if got := fakeInstances(t, apiURL); len(got) != 1 || got[0] != "proxy-"+p.GetUid() {
		t.Errorf("the fake holds %v, want the proxy's instance", got)
	}

	q := s.waitAll("quota", 1, "QuotaExceeded", time.Minute, func(p *proxyv1.Proxy) bool {
		return p.GetStatus().GetReason() == "QuotaExceeded"
	})[0]
	if msg := q.GetStatus().GetMessage(); !strings.Contains(msg, "QUOTA_EXCEEDED") || !strings.Contains(msg, "Quota 'CPUS' exceeded") {
		t.Errorf("quota proxy message %q", msg)
	}
	// The slower backoff: the next attempt is 30 s ±20 % away, not the
	// transient 1 s.
	conn, err := pgx.Connect(context.Background(), s.dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var wait float64
	var attempts int
	if err := conn.QueryRow(context.Background(),
		"SELECT EXTRACT(EPOCH FROM next_attempt_time - now())::float8, attempts FROM orchestrator.proxies WHERE name = 'quota-00'").Scan(&wait, &attempts); err != nil {
		t.Fatal(err)
	}
	if wait < 15 || wait > 36 || attempts != 1 {
		t.Errorf("next attempt in %.1fs after %d attempts, want the quota backoff (24-36 s) after 1", wait, attempts)
	}
	if n := strings.Count(fake.Output(), "request: POST /compute/v1/projects/egress-e2e/zones/"+quotaZone+"/instances\n"); n != 1 {
		t.Errorf("%d inserts into the quota zone, want 1 before the backoff ends", n)
	}

	for _, name := range []string{"gce-00", "quota-00"} {
		if _, err := c.DeleteProxy(ctx(t, 10*time.Second), &proxyv1.DeleteProxyRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"gce-00", "quota-00"} {
		waittest.For(t, time.Minute, name+" gone", func() bool {
			_, err := c.GetProxy(ctx(t, 10*time.Second), &proxyv1.GetProxyRequest{Name: name})
			return status.Code(err) == codes.NotFound
		})
	}
	if got := fakeInstances(t, apiURL); len(got) != 0 {
		t.Errorf("instances left on the fake after delete: %v", got)
	}
	if !strings.Contains(fake.Output(), "request: DELETE /compute/v1/projects/egress-e2e/zones/"+okZone+"/instances/proxy-"+p.GetUid()) {
		t.Errorf("no DELETE of the instance reached the fake")
	}
}

// fakeInstances lists every instance on the fake through the Compute API
// itself (an unfiltered aggregated list).
func fakeInstances(t *testing.T, apiURL string) []string {
	t.Helper()
	resp, err := http.Get(apiURL + "/compute/v1/projects/egress-e2e/aggregated/instances")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Items map[string]struct {
			Instances []struct{ Name string }
		}
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, scope := range list.Items {
		for _, in := range scope.Instances {
			out = append(out, in.Name)
		}
	}
	return out
}
