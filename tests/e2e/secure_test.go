//go:build e2e

package e2e

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// The whole suite with TLS and authentication on everywhere: every
// service serves gRPC and REST over TLS with a certificate from the test's
// CA, every service-to-service call (lease → orchestrator, health →
// provisioner) carries the service token over TLS, and a proxy goes Ready
// and is leased. Around it: plaintext is refused, roles hold, cloud-init
// stays with admins, and the provisioner answers only the service role.
func TestSecureSuite(t *testing.T) {
	s := newSuite(t)
	s.tls = true
	s.startProvisioner("prov-1")
	orch := s.startOrchestrator()
	lease := s.startLease()
	_, health := s.startHealth("health-1")

	const cloudInit = "#cloud-config\n# e2e-cl0ud-s3cret\n"
	admin := s.proxies()
	if _, err := admin.CreateProxy(ctx(t, 30*time.Second), &proxyv1.CreateProxyRequest{
		Name: "tls-00", Labels: map[string]string{"id": "tls-00"},
		Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "local", CloudInit: cloudInit},
	}); err != nil {
		t.Fatal(err)
	}
	s.waitAll("tls", 1, "Ready and healthy", 2*time.Minute, ready)

	// Leased over gRPC (TLS), and used.
	leases := s.leases()
	var l *leasev1.Lease
	waittest.For(t, 30*time.Second, "a lease on the Ready proxy", func() bool {
		resp, err := leases.AcquireLease(ctx(t, 10*time.Second), &leasev1.AcquireLeaseRequest{
			TargetHost: "shop.example", Ttl: durationpb.New(time.Minute),
			Selector: &leasev1.ProxySelector{Labels: map[string]string{"id": "tls-00"}},
		})
		l = resp.GetLease()
		return err == nil
	})
	if body, err := s.fetchThrough(l.GetAddress().GetHost(), l.GetAddress().GetPort(), "/via-tls-lease"); err != nil || !strings.Contains(body, "/via-tls-lease") {
		t.Fatalf("fetch through the leased proxy: %q %v", body, err)
	}

	if _, err := leases.ReleaseLease(ctx(t, 10*time.Second), &leasev1.ReleaseLeaseRequest{LeaseId: l.GetLeaseId()}); err != nil {
		t.Fatal(err)
	}

	// Leased over REST (HTTPS) too, once released (one lease a proxy).
	req, _ := http.NewRequest(http.MethodPost, s.base(s.lease.HTTP)+"/v1/leases",
		strings.NewReader(`{"targetHost":"news.example","ttl":"60s","selector":{"labels":{"id":"tls-00"}}}`))
	req.Header.Set("Authorization", "Bearer "+crawlerToken)
	resp, err := s.httpClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"leaseId"`) {
		t.Errorf("acquire over HTTPS = %d %s", resp.StatusCode, body)
	}

	// Health reached the provisioner over TLS with the service token.
	waittest.For(t, 45*time.Second, "the local provider checked ready", func() bool {
		r, err := s.health(health.GRPC).GetProviderHealth(ctx(t, 10*time.Second), &healthv1.GetProviderHealthRequest{Provider: "local"})
		return err == nil && r.GetHealth().GetReadiness() == healthv1.ProviderReadiness_PROVIDER_READINESS_READY
	})

	// Plaintext to TLS ports fails; so does a client without the CA.
	plain := service.Client{Addr: s.orchestrator.GRPC, Token: opsToken}
	conn, err := plain.Dial()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := proxyv1.NewProxyServiceClient(conn).ListProviders(ctx(t, 10*time.Second), &proxyv1.ListProvidersRequest{}); status.Code(err) != codes.Unavailable {
		t.Errorf("plaintext gRPC to a TLS port = %v, want UNAVAILABLE", err)
	}
	if resp, err := http.Get("http://" + s.orchestrator.HTTP + "/healthz"); err == nil {
		resp.Body.Close()
		if resp.StatusCode == 200 {
			t.Error("plain HTTP served on a TLS port")
		}
	}

	// Roles: a crawler cannot write proxies, over gRPC or HTTPS.
	crawlerProxies := proxyv1.NewProxyServiceClient(s.conn(s.orchestrator.GRPC, crawlerToken))
	if _, err := crawlerProxies.DeleteProxy(ctx(t, 10*time.Second), &proxyv1.DeleteProxyRequest{Name: "tls-00"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("DeleteProxy as a crawler = %v, want PERMISSION_DENIED", err)
	}
	req, _ = http.NewRequest(http.MethodDelete, s.base(s.orchestrator.HTTP)+"/v1/proxies/tls-00", nil)
	req.Header.Set("Authorization", "Bearer "+crawlerToken)
	if resp, err := s.httpClient().Do(req); err != nil || resp.StatusCode != http.StatusForbidden {
		t.Errorf("DELETE as a crawler over HTTPS = %v %v, want 403", resp.StatusCode, err)
	} else {
		resp.Body.Close()
	}

	// Cloud-init: only the FULL view, only for admins.
	got, err := admin.GetProxy(ctx(t, 10*time.Second), &proxyv1.GetProxyRequest{Name: "tls-00", View: proxyv1.ProxyView_PROXY_VIEW_FULL})
	if err != nil || got.GetProxy().GetSpec().GetCloudInit() != cloudInit {
		t.Errorf("FULL view as admin: %v %v", got.GetProxy().GetSpec(), err)
	}
	viewer := proxyv1.NewProxyServiceClient(s.conn(s.orchestrator.GRPC, viewerToken))
	if _, err := viewer.GetProxy(ctx(t, 10*time.Second), &proxyv1.GetProxyRequest{Name: "tls-00", View: proxyv1.ProxyView_PROXY_VIEW_FULL}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("FULL view as a viewer = %v, want PERMISSION_DENIED", err)
	}
	basic, err := viewer.GetProxy(ctx(t, 10*time.Second), &proxyv1.GetProxyRequest{Name: "tls-00"})
	if err != nil || basic.GetProxy().GetSpec().GetCloudInit() != "" {
		t.Errorf("default view as a viewer: %v %v", basic.GetProxy().GetSpec(), err)
	}

	// The provisioner answers the service role only.
	for token, want := range map[string]codes.Code{opsToken: codes.PermissionDenied, crawlerToken: codes.PermissionDenied, "": codes.Unauthenticated} {
		c := provisionerv1.NewProvisionerServiceClient(s.conn(s.provisioner.GRPC, token))
		_, err := c.ListInstances(ctx(t, 10*time.Second), &provisionerv1.ListInstancesRequest{Provider: "local", Installation: s.installation})
		if status.Code(err) != want {
			t.Errorf("ListInstances with %q = %v, want %v", token, err, want)
		}
	}
	svc := provisionerv1.NewProvisionerServiceClient(s.conn(s.provisioner.GRPC, serviceToken))
	if list, err := svc.ListInstances(ctx(t, 10*time.Second), &provisionerv1.ListInstancesRequest{Provider: "local", Installation: s.installation}); err != nil || len(list.GetInstances()) != 1 {
		t.Errorf("ListInstances as the service = %v %v", list, err)
	}

	// The lease service's resync over TLS worked, and no process logged
	// the cloud-init or a token.
	for name, p := range map[string]interface{ Output() string }{"orchestrator": orch, "lease": lease} {
		out := p.Output()
		for _, secret := range []string{"e2e-cl0ud-s3cret", opsToken, crawlerToken, serviceToken, viewerToken} {
			if strings.Contains(out, secret) {
				t.Errorf("the %s log contains %q", name, secret)
			}
		}
	}
	for _, addr := range []string{s.orchestrator.HTTP, s.lease.HTTP, health.HTTP, s.provisioner.HTTP} {
		resp, err := s.httpClient().Get(s.base(addr) + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		metrics, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || len(metrics) == 0 {
			t.Errorf("/metrics of %s over HTTPS = %d", addr, resp.StatusCode)
		}
		for _, secret := range []string{"e2e-cl0ud-s3cret", opsToken, crawlerToken, serviceToken, viewerToken} {
			if strings.Contains(string(metrics), secret) {
				t.Errorf("the metrics of %s contain %q", addr, secret)
			}
		}
	}
	if strings.Contains(lease.Output(), "the initial resync from the orchestrator failed") {
		t.Errorf("the lease service could not resync over TLS:\n%s", lease.Output())
	}
}
