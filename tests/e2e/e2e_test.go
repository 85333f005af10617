//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// The whole flow: 20 proxies Ready and healthy, leased over gRPC and REST
// and used for HTTPS, a ban keeping one away from its target only, and
// deletion ending instances and leases.
func TestFlow(t *testing.T) {
	s := newSuite(t)
	s.startAll()
	s.createProxies("flow", 20)
	all := s.waitAll("flow", 20, "Ready and healthy", 3*time.Minute, ready)
	if dirs := s.instanceDirs(); len(dirs) != 20 {
		t.Errorf("local instances = %d, want 20", len(dirs))
	}

	// Lease one through gRPC and fetch through it.
	leases := s.leases()
	var grpcLease *leasev1.Lease
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := leases.AcquireLease(ctx(t, 10*time.Second), &leasev1.AcquireLeaseRequest{
			TargetHost: "shop.example", Ttl: durationpb.New(time.Minute),
			Selector: &leasev1.ProxySelector{Labels: map[string]string{"id": "flow-03"}},
		})
		if err == nil {
			grpcLease = resp.GetLease()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("acquire over gRPC: %v", err)
		}
		time.Sleep(200 * time.Millisecond) // the pool learns Ready proxies from events
	}
	a := grpcLease.GetAddress()
	if body, err := s.fetchThrough(a.GetHost(), a.GetPort(), "/via-grpc-lease"); err != nil || body != "hello from the site, /via-grpc-lease" {
		t.Fatalf("fetch through the gRPC-leased proxy %v: %q %v", a, body, err)
	}

	// Lease another through REST.
	req, _ := http.NewRequest("POST", s.base(s.lease.HTTP)+"/v1/leases",
		strings.NewReader(`{"targetHost":"news.example","ttl":"60s","selector":{"labels":{"id":"flow-07"}}}`))
	req.Header.Set("Authorization", "Bearer "+crawlerToken)
	resp, err := s.httpClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var rest struct {
		Lease struct {
			LeaseID string `json:"leaseId"`
			Address struct {
				Host string `json:"host"`
				Port uint32 `json:"port"`
			} `json:"address"`
		} `json:"lease"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&rest)
	resp.Body.Close()
	if resp.StatusCode != 200 || rest.Lease.LeaseID == "" {
		t.Fatalf("acquire over REST = %d %+v", resp.StatusCode, rest)
	}
	if body, err := s.fetchThrough(rest.Lease.Address.Host, rest.Lease.Address.Port, "/via-rest-lease"); err != nil || !strings.Contains(body, "/via-rest-lease") {
		t.Fatalf("fetch through the REST-leased proxy: %q %v", body, err)
	}

	// A ban on flow-03 for shop.example keeps it from that target only.
	if _, err := leases.ReportOutcome(ctx(t, 10*time.Second), &leasev1.ReportOutcomeRequest{
		LeaseId: grpcLease.GetLeaseId(), Outcome: leasev1.Outcome_OUTCOME_BANNED, Cooldown: durationpb.New(10 * time.Minute),
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := leases.ReleaseLease(ctx(t, 10*time.Second), &leasev1.ReleaseLeaseRequest{LeaseId: grpcLease.GetLeaseId()}); err != nil {
		t.Fatal(err)
	}
	only03 := &leasev1.ProxySelector{Labels: map[string]string{"id": "flow-03"}}
	_, err = leases.AcquireLease(ctx(t, 10*time.Second), &leasev1.AcquireLeaseRequest{TargetHost: "shop.example", Selector: only03})
	if status.Code(err) != codes.ResourceExhausted {
		t.Errorf("acquiring the banned proxy for its target: %v, want RESOURCE_EXHAUSTED", err)
	}
	other, err := leases.AcquireLease(ctx(t, 10*time.Second), &leasev1.AcquireLeaseRequest{TargetHost: "other.example", Selector: only03})
	if err != nil || other.GetLease().GetProxyName() != "flow-03" {
		t.Fatalf("acquiring the banned proxy for another target: %v %v", other, err)
	}
	// Without a selector, shop.example never gets flow-03.
	for range 10 {
		l, err := leases.AcquireLease(ctx(t, 10*time.Second), &leasev1.AcquireLeaseRequest{TargetHost: "shop.example"})
		if err != nil {
			t.Fatal(err)
		}
		if l.GetLease().GetProxyName() == "flow-03" {
			t.Fatal("a proxy banned for shop.example was leased for it")
		}
	}

	// Delete flow-07 (leased over REST): its instance goes, its lease ends.
	c := s.proxies()
	var uid07 string
	for _, p := range all {
		if p.GetName() == "flow-07" {
			uid07 = p.GetUid()
		}
	}
	if _, err := c.DeleteProxy(ctx(t, 10*time.Second), &proxyv1.DeleteProxyRequest{Name: "flow-07"}); err != nil {
		t.Fatal(err)
	}
	waittest.For(t, time.Minute, "flow-07 gone with its instance", func() bool {
		_, err := c.GetProxy(ctx(t, 10*time.Second), &proxyv1.GetProxyRequest{Name: "flow-07"})
		_, statErr := os.Stat(filepath.Join(s.stateDir, uid07))
		return status.Code(err) == codes.NotFound && os.IsNotExist(statErr)
	})
	if _, err := s.fetchThrough(rest.Lease.Address.Host, rest.Lease.Address.Port, "/after-delete"); err == nil {
		t.Error("the deleted proxy still forwards")
	}
	waittest.For(t, 10*time.Second, "the lease on the deleted proxy ended", func() bool {
		_, err := leases.RenewLease(ctx(t, 10*time.Second), &leasev1.RenewLeaseRequest{LeaseId: rest.Lease.LeaseID})
		return err != nil
	})
}

// The provisioner dies in the middle of Creates; a second replica finishes
// them with no duplicate instance.
func TestProvisionerKilledMidCreates(t *testing.T) {
	s := newSuite(t)
	// One command at a time, so most creates are still to do at the kill.
	first := s.startProvisioner("prov-1", "--max-concurrent=1")
	s.startOrchestrator()
	s.createProxies("kill", 10)
	waittest.For(t, time.Minute, "a first instance", func() bool { return len(s.instanceDirs()) > 0 })
	first.Kill(t)
	atKill := len(s.instanceDirs())
	t.Logf("provisioner killed with %d of 10 instances made", atKill)
	if atKill == 10 {
		t.Fatal("every create finished before the kill; the test proves nothing")
	}
	s.startProvisioner("prov-2")
	s.waitAll("kill", 10, "Running", 3*time.Minute, running)
	if dirs := s.instanceDirs(); len(dirs) != 10 {
		t.Errorf("local instances = %d, want 10: %v", len(dirs), dirs)
	}
	assertDistinctAddresses(t, s, "kill", 10)
}

func assertDistinctAddresses(t *testing.T, s *suite, prefix string, n int) {
	t.Helper()
	resp, err := s.proxies().ListProxies(ctx(t, 10*time.Second), &proxyv1.ListProxiesRequest{PageSize: 1000})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]string{}
	for _, p := range resp.GetProxies() {
		if !strings.HasPrefix(p.GetName(), prefix) {
			continue
		}
		if other, dup := seen[p.GetStatus().GetIp()]; dup {
			t.Errorf("%s and %s share %s", p.GetName(), other, p.GetStatus().GetIp())
		}
		seen[p.GetStatus().GetIp()] = p.GetName()
	}
	if len(seen) != n {
		t.Errorf("%d distinct addresses, want %d", len(seen), n)
	}
}

// The orchestrator restarts in the middle of provisioning; everything
// converges with one instance per proxy.
func TestOrchestratorRestartMidFlight(t *testing.T) {
	s := newSuite(t)
	s.startProvisioner("prov-1")
	orch := s.startOrchestrator()
	s.createProxies("restart", 10)
	waittest.For(t, time.Minute, "a first instance", func() bool { return len(s.instanceDirs()) > 0 })
	orch.Kill(t)
	t.Logf("orchestrator killed with %d of 10 instances made", len(s.instanceDirs()))
	s.startOrchestrator()
	s.waitAll("restart", 10, "Running", 3*time.Minute, running)
	if dirs := s.instanceDirs(); len(dirs) != 10 {
		t.Errorf("local instances = %d, want 10", len(dirs))
	}
	assertDistinctAddresses(t, s, "restart", 10)
}

// Every service starts while NATS is down and serves; once NATS is up the
// proxies created meanwhile converge, and a NATS restart mid-flight loses
// nothing: the proxies become Ready and the lease service leases them.
func TestNATSOutage(t *testing.T) {
	s := newSuite(t)
	s.nats.Stop()
	s.startAll()
	s.createProxies("down", 3) // the orchestrator's API needs no NATS
	s.nats.Start(t)
	s.waitAll("down", 3, "Ready and healthy after NATS came up", 3*time.Minute, ready)

	s.createProxies("restart", 3)
	s.nats.Restart(t)
	s.waitAll("restart", 3, "Ready and healthy after a NATS restart", 3*time.Minute, ready)
	leases := s.leases()
	waittest.For(t, time.Minute, "a lease on a proxy created around the restart", func() bool {
		resp, err := leases.AcquireLease(ctx(t, 10*time.Second), &leasev1.AcquireLeaseRequest{
			Ttl: durationpb.New(time.Minute), Selector: &leasev1.ProxySelector{Labels: map[string]string{"id": "restart-01"}},
		})
		return err == nil && resp.GetLease().GetProxyName() == "restart-01"
	})
	if dirs := s.instanceDirs(); len(dirs) != 6 {
		t.Errorf("local instances = %d, want 6 (one per proxy)", len(dirs))
	}
}

// One of two health replicas dies; the other probes every proxy.
func TestHealthReplicaKilled(t *testing.T) {
	s := newSuite(t)
	s.startProvisioner("prov-1")
	s.startOrchestrator()
	h1, _ := s.startHealth("health-1")
	_, a2 := s.startHealth("health-2")
	s.createProxies("hr", 6)
	s.waitAll("hr", 6, "Ready and healthy", 3*time.Minute, ready)
	h1.Kill(t)
	// The survivor must probe all six: each one's last probe must be fresh
	// and made by health-2.
	killed := time.Now()
	client := s.health(a2.GRPC)
	waittest.For(t, time.Minute, "every proxy probed by health-2 after the kill", func() bool {
		resp, err := client.ListProxyHealth(ctx(t, 10*time.Second), &healthv1.ListProxyHealthRequest{PageSize: 100})
		if err != nil {
			return false
		}
		n := 0
		for _, h := range resp.GetProxies() {
			if strings.HasPrefix(h.GetProxyName(), "hr-") && h.GetProber() == "health-2" &&
				h.GetLastProbeTime().AsTime().After(killed) && h.GetHealthy() {
				n++
			}
		}
		return n == 6
	})
	s.waitAll("hr", 6, "still Ready", 10*time.Second, ready)
}

// An instance whose proxy was deleted behind the system's back (its row
// removed from the store) is an orphan; GC deletes it.
func TestOrphanGC(t *testing.T) {
	s := newSuite(t)
	s.startProvisioner("prov-1")
	s.startOrchestrator()
	created := s.createProxies("gc", 2)
	s.waitAll("gc", 2, "Running", 2*time.Minute, running)
	victim := created[0].GetUid()
	conn, err := pgx.Connect(context.Background(), s.dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(context.Background(), "DELETE FROM orchestrator.proxies WHERE uid = $1", victim); err != nil {
		t.Fatal(err)
	}
	waittest.For(t, time.Minute, "the orphan deleted", func() bool {
		_, err := os.Stat(filepath.Join(s.stateDir, victim))
		return os.IsNotExist(err)
	})
	if _, err := os.Stat(filepath.Join(s.stateDir, created[1].GetUid())); err != nil {
		t.Errorf("the live proxy's instance: %v", err)
	}
}

// The orchestrator and provisioner-proxmox agree on the contract: a proxy
// on the fake Proxmox VE API is cloned, started, Running with the guest
// agent's address, survives orphan GC, and is destroyed on delete.
func TestProxmoxBackend(t *testing.T) {
	s := newSuite(t)
	fake := proctest.Start(t, proctest.Build(t, "../../services/provisioner-proxmox/internal/pvefake/cmd/pvefake"),
		[]string{"--listen=127.0.0.1:0", "--dir=" + s.dir})
	var pveURL string
	waittest.For(t, 30*time.Second, "the fake Proxmox VE API", func() bool {
		for _, line := range strings.Split(fake.Output(), "\n") {
			if u, ok := strings.CutPrefix(strings.TrimSpace(line), "url: "); ok {
				pveURL = u
				return true
			}
		}
		return false
	})
	s.providers = s.write("providers.yaml", `providers:
  - name: pve-fake
    type: proxmox
    proxmox:
      url: `+pveURL+`
      tokenFile: `+filepath.Join(s.dir, "token")+`
      caFile: `+filepath.Join(s.dir, "ca.pem")+`
      nodes: [pv1-1]
      isoStorage: proxy-seeds
      templates: {debian-13: {vmid: 9001}}
      machineTypes: {small: {cores: 1, memoryMiB: 1024}}
`)
	servicetest.Start(t, "../../services/provisioner-proxmox", append([]string{"--nats-url=" + s.nats.URL(),
		"--providers-config=" + s.providers, "--provider=pve-fake", "--replica-id=pve-1"}, s.serving()...))
	s.startOrchestrator()
	c := s.proxies()
	resp, err := c.CreateProxy(ctx(t, 30*time.Second), &proxyv1.CreateProxyRequest{Name: "pve-00", Spec: &proxyv1.ProxySpec{
		Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve-fake", CloudInit: "#cloud-config\n",
		Placement: &proxyv1.Placement{Zone: "pv1-1", MachineType: "small", Image: "debian-13"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	p := s.waitAll("pve", 1, "Running", 2*time.Minute, running)[0]
	if !strings.HasPrefix(p.GetStatus().GetProviderId(), "vms/") || p.GetStatus().GetIp() == "" {
		t.Errorf("status %v", p.GetStatus())
	}
	// Orphan GC sweeps every 2 s with a 1 s grace: the live VM must survive
	// a few sweeps.
	waittest.For(t, time.Minute, "three GC sweeps of pve-fake", func() bool {
		return metricAtLeast(t, "http://"+s.orchestrator.HTTP+"/metrics", `egress_orchestrator_gc_sweeps_total{provider="pve-fake"}`, 3)
	})
	if got, err := c.GetProxy(ctx(t, 10*time.Second), &proxyv1.GetProxyRequest{Name: "pve-00"}); err != nil || !running(got.GetProxy()) {
		t.Fatalf("after GC sweeps: %v %v", got, err)
	}
	if _, err := c.DeleteProxy(ctx(t, 10*time.Second), &proxyv1.DeleteProxyRequest{Name: "pve-00"}); err != nil {
		t.Fatal(err)
	}
	waittest.For(t, time.Minute, "pve-00 gone", func() bool {
		_, err := c.GetProxy(ctx(t, 10*time.Second), &proxyv1.GetProxyRequest{Name: "pve-00"})
		return status.Code(err) == codes.NotFound
	})
	_ = resp
}

// metricAtLeast reports whether the sample named series on the metrics page
// at url is at least min.
func metricAtLeast(t *testing.T, url, series string, min float64) bool {
	resp, err := http.Get(url)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return err == nil && f >= min
		}
	}
	return false
}
