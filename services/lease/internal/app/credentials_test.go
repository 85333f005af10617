package app_test

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	lt "github.com/egress-proxies/egress-proxies/services/lease/internal/leasetest"
)

// The acquire's answer carries the proxy's credentials, fetched from the
// orchestrator once per proxy snapshot, over gRPC and REST; a
// service-only proxy's stay with the service role; renewals carry none.
func TestAcquireCarriesCredentials(t *testing.T) {
	t.Parallel()
	creds := &proxyv1.ProxyCredentials{Username: "egress-0123456789ab", Password: "pw-secret-8810"}
	fake := &fakeOrchestrator{token: "orchestrator-secret-token", revision: 10, pageSize: 10,
		proxies:     []*proxyv1.Proxy{lt.Proxy(uidA, "proxy-a")},
		credentials: map[string]*proxyv1.GetProxyCredentialsResponse{uidA: {Credentials: creds}}}
	env := lt.Start(t, lt.Options{Config: serveOrchestrator(t, fake)})
	for _, transport := range lt.Transports {
		c := env.Client(transport, "crawler-a")
		resp, r := c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{})
		if r.Code() != codes.OK {
			t.Fatalf("%s acquire: %v", transport, r.Status)
		}
		if resp.GetCredentials().GetPassword() != creds.GetPassword() || resp.GetCredentials().GetUsername() != creds.GetUsername() {
			t.Errorf("%s: the answer does not carry the proxy's credentials", transport)
		}
		if u := resp.GetProxyUrl(); !strings.HasPrefix(u, "http://egress-0123456789ab:pw-secret-8810@") {
			t.Errorf("%s: proxy_url lacks the credentials", transport)
		}
		renewed, r := c.Renew(lt.Ctx(t), &leasev1.RenewLeaseRequest{LeaseId: resp.GetLease().GetLeaseId()})
		if r.Code() != codes.OK || strings.Contains(renewed.String(), creds.GetPassword()) {
			t.Errorf("%s renew: %v, or it carries the credentials", transport, r.Status)
		}
		if _, r := c.Release(lt.Ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: resp.GetLease().GetLeaseId()}); r.Code() != codes.OK {
			t.Fatal(r.Status)
		}
	}

	// The orchestrator was asked once: the answer is kept until the
	// proxy changes.
	fake.mu.Lock()
	asked := fake.credCalls
	fake.mu.Unlock()
	if asked != 1 {
		t.Errorf("the orchestrator was asked for the credentials %d times over %d acquires, want once", asked, len(lt.Transports))
	}

	// Service-only, with the proxy's change published as the orchestrator
	// does: a crawler learns nothing from then on.
	fake.mu.Lock()
	fake.credentials[uidA] = &proxyv1.GetProxyCredentialsResponse{Credentials: creds, ServiceOnly: true}
	fake.mu.Unlock()
	env.PublishProxy(t, proxyv1.ChangeType_CHANGE_TYPE_UPDATED, lt.Proxy(uidA, "proxy-a"), 11)
	c := env.Client("grpc", "crawler-a")
	waittest.For(t, 10*time.Second, "acquires after the change", func() bool {
		resp, r := c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{})
		if r.Code() != codes.OK {
			t.Fatal(r.Status)
		}
		if _, r := c.Release(lt.Ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: resp.GetLease().GetLeaseId()}); r.Code() != codes.OK {
			t.Fatal(r.Status)
		}
		return resp.GetCredentials() == nil && !strings.Contains(resp.GetProxyUrl(), creds.GetPassword())
	})
}
