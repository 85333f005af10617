//go:build e2e

package e2e

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/squid"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// proxyStatus fetches the site through the proxy at host:port with user
// (nil: none) and returns the proxy's answer to CONNECT (200 when the page
// came through).
func (s *suite) proxyStatus(t *testing.T, host string, port uint32, user *url.Userinfo) int {
	t.Helper()
	code, err := s.tryProxyStatus(host, port, user)
	if err != nil {
		t.Fatal(err)
	}
	return code
}

// tryProxyStatus is proxyStatus, with an error when the proxy gave no
// answer (unreachable, or the connection failed before its answer).
func (s *suite) tryProxyStatus(host string, port uint32, user *url.Userinfo) (int, error) {
	pool := s.site.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs
	connect := 0
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		Proxy:           http.ProxyURL(&url.URL{Scheme: "http", Host: fmt.Sprintf("%s:%d", host, port), User: user}),
		TLSClientConfig: &tls.Config{RootCAs: pool},
		OnProxyConnectResponse: func(_ context.Context, _ *url.URL, _ *http.Request, resp *http.Response) error {
			connect = resp.StatusCode
			return nil
		},
	}}
	resp, err := client.Get(s.site.URL + "/probe")
	if err != nil {
		if connect != 0 {
			return connect, nil
		}
		return 0, fmt.Errorf("fetch through %s:%d: %w", host, port, err)
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// TestProxyCredentials: real squids on the local backend demand the
// credentials the lease hands out; health probes the proxy Ready through
// them; no other view carries them, and no service logs them.
func TestProxyCredentials(t *testing.T) {
	t.Parallel()
	s := newSuite(t)
	orch := s.startOrchestrator()
	prov := s.startProvisioner("prov-1", append(s.peer("orchestrator"), "--orchestrator-addr="+s.orchestrator.GRPC)...)
	lease := s.startLease()
	health, _ := startHealthWithCredentials(s, "health-1")
	procs := map[string]*proctest.Process{"orchestrator": orch, "provisioner": prov, "lease": lease, "health": health}

	s.createProxies("cred", 1)
	p := s.waitAll("cred", 1, "ready", 90*time.Second, ready)[0]
	host, port := p.GetStatus().GetIp(), p.GetStatus().GetPort()

	crawler := leasev1.NewLeaseServiceClient(s.conn(s.lease.GRPC, crawlerToken))
	// acquire leases the proxy, waiting for the lease service to see it
	// leasable (its mirror follows the orchestrator's and health's events).
	acquire := func() *leasev1.AcquireLeaseResponse {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for {
			resp, err := crawler.AcquireLease(ctx(t, 30*time.Second), &leasev1.AcquireLeaseRequest{
				Selector: &leasev1.ProxySelector{Labels: map[string]string{"id": "cred-00"}}})
			if err == nil {
				return resp
			}
			if status.Code(err) != codes.ResourceExhausted || time.Now().After(deadline) {
				t.Fatal(err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	first := acquire()
	c := first.GetCredentials()
	if c.GetUsername() == "" || c.GetPassword() == "" {
		t.Fatal("the crawler's lease answer carries no credentials")
	}
	wantURL := fmt.Sprintf("http://%s@%s:%d", url.UserPassword(c.GetUsername(), c.GetPassword()).String(), host, port)
	if first.GetProxyUrl() != wantURL {
		t.Errorf("proxy_url does not carry the credentials and address")
	}
	secrets := []string{c.GetPassword()}

	if got := s.proxyStatus(t, host, port, nil); got != http.StatusProxyAuthRequired {
		t.Errorf("straight to the proxy without credentials: %d, want 407", got)
	}
	if got := s.proxyStatus(t, host, port, url.UserPassword(c.GetUsername(), c.GetPassword())); got != http.StatusOK {
		t.Errorf("with the lease's credentials: %d, want 200", got)
	}

	// Another client's view of the lease carries none.
	ops := leasev1.NewLeaseServiceClient(s.conn(s.lease.GRPC, opsToken))
	list, err := ops.ListLeases(ctx(t, 10*time.Second), &leasev1.ListLeasesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.GetLeases()) == 0 || strings.Contains(protojson.Format(list), c.GetPassword()) {
		t.Errorf("ListLeases (%d leases) carries the credentials, or misses the lease", len(list.GetLeases()))
	}
	if _, err := crawler.ReleaseLease(ctx(t, 10*time.Second), &leasev1.ReleaseLeaseRequest{LeaseId: first.GetLease().GetLeaseId()}); err != nil {
		t.Fatal(err)
	}

	// Rotation, in place on this backend: the same instance comes back
	// Ready (health probing with the new credentials), the old ones get
	// 407, the new ones work, and a lease acquired after it carries them.
	before := p.GetStatus().GetCredentialsTime().AsTime()
	instance := p.GetStatus().GetProviderId()
	if _, err := s.proxies().RotateCredentials(ctx(t, 10*time.Second), &proxyv1.RotateCredentialsRequest{Name: p.GetName()}); err != nil {
		t.Fatal(err)
	}
	p = s.waitAll("cred", 1, "Ready with new credentials", 120*time.Second, func(p *proxyv1.Proxy) bool {
		return ready(p) && p.GetStatus().GetCredentialsTime().AsTime().After(before)
	})[0]
	if got := p.GetStatus().GetProviderId(); got != instance || p.GetStatus().GetIp() != host {
		t.Errorf("after rotation the proxy is instance %s at %s, want %s at %s: changed in place, not replaced", got, p.GetStatus().GetIp(), instance, host)
	}
	var second *leasev1.AcquireLeaseResponse
	waittest.For(t, 60*time.Second, "a lease with the new credentials", func() bool {
		second = acquire()
		if second.GetCredentials().GetPassword() != c.GetPassword() {
			return true
		}
		_, _ = crawler.ReleaseLease(ctx(t, 10*time.Second), &leasev1.ReleaseLeaseRequest{LeaseId: second.GetLease().GetLeaseId()})
		return false
	})
	c2 := second.GetCredentials()
	if c2.GetUsername() == "" || c2.GetPassword() == "" {
		t.Fatal("the lease after rotation carries no credentials")
	}
	secrets = append(secrets, c2.GetPassword())
	if got := s.proxyStatus(t, host, port, url.UserPassword(c.GetUsername(), c.GetPassword())); got != http.StatusProxyAuthRequired {
		t.Errorf("the old credentials after rotation: %d, want 407", got)
	}
	if got := s.proxyStatus(t, host, port, url.UserPassword(c2.GetUsername(), c2.GetPassword())); got != http.StatusOK {
		t.Errorf("the new credentials: %d, want 200", got)
	}
	if _, err := crawler.ReleaseLease(ctx(t, 10*time.Second), &leasev1.ReleaseLeaseRequest{LeaseId: second.GetLease().GetLeaseId()}); err != nil {
		t.Fatal(err)
	}

	// A squid that refuses the proxy's credentials is noticed by health:
	// the instance's htpasswd file is made to admit someone else, and squid
	// (told to re-read its configuration) refuses health's probes.
	refuseProxyCredentials(t, filepath.Join(s.stateDir, p.GetUid()))
	// Squid reopens its port while it reconfigures, and may admit the
	// credentials it had cached until their credentialsttl (1m) passes.
	waittest.For(t, 90*time.Second, "squid refusing the proxy's credentials", func() bool {
		code, err := s.tryProxyStatus(host, port, url.UserPassword(c2.GetUsername(), c2.GetPassword()))
		return err == nil && code == http.StatusProxyAuthRequired
	})
	s.waitAll("cred", 1, "unhealthy once squid refuses the credentials", 60*time.Second, func(p *proxyv1.Proxy) bool {
		return p.GetStatus().GetPhase() == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING && p.GetStatus().GetReason() == "Unhealthy"
	})

	// Secrets scan: no service's debug log holds a credential.
	for name, proc := range procs {
		out := proc.Output()
		for _, secret := range secrets {
			if strings.Contains(out, secret) {
				t.Errorf("the %s log holds a proxy password", name)
			}
		}
	}
}

// startHealthWithCredentials starts a health replica that fetches the
// proxies' credentials from the orchestrator.
func startHealthWithCredentials(s *suite, replica string) (*proctest.Process, servicetest.Addrs) {
	return s.startHealthWith(replica, append(s.peer("orchestrator"), "--orchestrator-addr="+s.orchestrator.GRPC)...)
}

// refuseProxyCredentials makes the local instance in dir admit only a
// stranger: its htpasswd file is rewritten and its squid reconfigured
// (SIGHUP). Credentials squid admitted shortly before may still pass
// until its credentialsttl ends.
func refuseProxyCredentials(t *testing.T, dir string) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, "instance.json"))
	if err != nil {
		t.Fatal(err)
	}
	var rec struct {
		PID int `json:"pid"`
	}
	if err := json.Unmarshal(raw, &rec); err != nil || rec.PID <= 0 {
		t.Fatalf("instance.json %s: pid %d, %v", dir, rec.PID, err)
	}
	stranger, err := squid.HTPasswd("egress-stranger", "not-the-proxys-password")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "htpasswd"), stranger, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(rec.PID, syscall.SIGHUP); err != nil {
		t.Fatalf("reconfiguring squid %d: %v", rec.PID, err)
	}
}
