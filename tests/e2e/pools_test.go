//go:build e2e

package e2e

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

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

// poolSuite is a suite whose orchestrator and lease service run with the
// pool knobs short enough for a test.
func (s *suite) startPoolOrchestrator(extra ...string) *proctest.Process {
	p, a := servicetest.Start(s.t, "../../services/orchestrator", append(append(s.common(), extra...),
		"--providers-config="+s.providers, "--cloud-init-key-file="+s.cloudInitKeys,
		"--gc-interval=2s", "--gc-grace=1s", "--resync-interval=3s", "--pool-resync=500ms",
		"--provisioning-poll=200ms", "--deletion-poll=200ms", "--create-deadline=30s", "--get-deadline=10s", "--delete-deadline=20s"))
	s.orchestrator = a
	return p
}

func (s *suite) startPoolLease() {
	_, a := servicetest.Start(s.t, "../../services/lease", append(append(s.common(), s.peer("orchestrator")...),
		"--orchestrator-addr="+s.orchestrator.GRPC, "--resync-interval=5s", "--demand-interval=300ms"))
	s.lease = a
}

func (s *suite) pools() proxyv1.ProxyPoolServiceClient {
	return proxyv1.NewProxyPoolServiceClient(s.conn(s.orchestrator.GRPC, opsToken))
}

// poolCounts are a pool's proxies as ListProxies shows them.
type poolCounts struct {
	live, ready, draining int
	names                 map[string]bool // live ones
	byProvider            map[string]int  // live ones
}

func (s *suite) poolProxies(pool string) (poolCounts, error) {
	resp, err := s.proxies().ListProxies(ctx(s.t, 10*time.Second), &proxyv1.ListProxiesRequest{
		Labels: map[string]string{"pool": pool}, PageSize: 1000})
	c := poolCounts{names: map[string]bool{}, byProvider: map[string]int{}}
	if err != nil {
		return c, err
	}
	for _, p := range resp.GetProxies() {
		switch {
		case p.GetDeleteTime() != nil:
		case p.GetDraining():
			c.draining++
		default:
			c.live++
			c.names[p.GetName()] = true
			c.byProvider[p.GetSpec().GetProvider()]++
			if p.GetStatus().GetPhase() == proxyv1.ProxyPhase_PROXY_PHASE_READY {
				c.ready++
			}
		}
	}
	return c, nil
}

func (s *suite) waitPool(pool, what string, timeout time.Duration, cond func(poolCounts) bool) poolCounts {
	s.t.Helper()
	var last poolCounts
	waittest.For(s.t, timeout, pool+" "+what, func() bool {
		c, err := s.poolProxies(pool)
		last = c
		return err == nil && cond(c)
	})
	return last
}

// watchBounds samples the pool until stop is closed and records the most
// live and the fewest Ready proxies seen.
func (s *suite) watchBounds(pool string, stop <-chan struct{}) (result func() (maxLive, minReady int)) {
	var mu sync.Mutex
	maxLive, minReady := 0, 1<<30
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			c, err := s.poolProxies(pool)
			if err != nil {
				continue // the orchestrator may be down (killed on purpose)
			}
			mu.Lock()
			maxLive, minReady = max(maxLive, c.live), min(minReady, c.ready)
			mu.Unlock()
		}
	}()
	return func() (int, int) {
		<-done
		mu.Lock()
		defer mu.Unlock()
		return maxLive, minReady
	}
}

func localTemplate() *proxyv1.ProxyTemplate {
	return &proxyv1.ProxyTemplate{Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "local"}}
}

// Crawlers lease from an autoscaled pool: refused acquires scale it up to
// max_replicas; once idle it scales down to min_replicas after the
// stabilisation window, and the proxy a crawler still holds is kept and
// keeps forwarding.
func TestPoolScalesOnLeaseLoad(t *testing.T) {
	s := newSuite(t)
	s.startProvisioner("prov-1")
	s.startPoolOrchestrator()
	s.startPoolLease()
	s.startHealth("health-1")
	pools := s.pools()
	if _, err := pools.CreateProxyPool(ctx(t, 10*time.Second), &proxyv1.CreateProxyPoolRequest{Name: "crawl", Spec: &proxyv1.ProxyPoolSpec{
		Template: localTemplate(), Replicas: 1,
		Autoscaling: &proxyv1.Autoscaling{MinReplicas: 1, MaxReplicas: 3, TargetUtilizationPercent: 100,
			ScaleDownStabilization: durationpb.New(5 * time.Second)},
		DrainTimeout: durationpb.New(10 * time.Minute),
	}}); err != nil {
		t.Fatal(err)
	}
	s.waitPool("crawl", "1 Ready", 2*time.Minute, func(c poolCounts) bool { return c.ready == 1 })

	// Three crawlers want a proxy each (capacity 1): the refusals scale
	// the pool up, and all three get one.
	leases := s.leases()
	sel := &leasev1.ProxySelector{Pool: "crawl"}
	var held []*leasev1.Lease
	waittest.For(t, 3*time.Minute, "three leases from the pool", func() bool {
		resp, err := leases.AcquireLease(ctx(t, 10*time.Second), &leasev1.AcquireLeaseRequest{TargetHost: "shop.example", Selector: sel, Ttl: durationpb.New(10 * time.Minute)})
		if err == nil {
			held = append(held, resp.GetLease())
		} else if status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("acquire: %v", err)
		}
		return len(held) == 3
	})
	resp, err := pools.GetProxyPool(ctx(t, 10*time.Second), &proxyv1.GetProxyPoolRequest{Name: "crawl"})
	if err != nil || resp.GetPool().GetStatus().GetDesiredReplicas() != 3 {
		t.Fatalf("pool after the load: %v %v", resp.GetPool().GetStatus(), err)
	}
	if _, err := leases.AcquireLease(ctx(t, 10*time.Second), &leasev1.AcquireLeaseRequest{Selector: sel}); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a fourth lease beyond max_replicas: %v", err)
	}

	// Two crawlers finish; one keeps its lease. The pool goes down to 1
	// after the window and keeps the leased proxy.
	kept := held[0]
	for _, l := range held[1:] {
		if _, err := leases.ReleaseLease(ctx(t, 10*time.Second), &leasev1.ReleaseLeaseRequest{LeaseId: l.GetLeaseId()}); err != nil {
			t.Fatal(err)
		}
	}
	c := s.waitPool("crawl", "scaled down to 1", 2*time.Minute, func(c poolCounts) bool { return c.live == 1 && c.draining == 0 })
	if !c.names[kept.GetProxyName()] {
		t.Fatalf("scale-down gave up the leased proxy %s; left %v", kept.GetProxyName(), c.names)
	}
	a := kept.GetAddress()
	if body, err := s.fetchThrough(a.GetHost(), a.GetPort(), "/still-leased"); err != nil || !strings.Contains(body, "/still-leased") {
		t.Fatalf("the leased proxy stopped forwarding: %q %v", body, err)
	}
	if _, err := leases.RenewLease(ctx(t, 10*time.Second), &leasev1.RenewLeaseRequest{LeaseId: kept.GetLeaseId()}); err != nil {
		t.Fatalf("the kept lease cannot be renewed: %v", err)
	}
	resp, _ = pools.GetProxyPool(ctx(t, 10*time.Second), &proxyv1.GetProxyPoolRequest{Name: "crawl"})
	if d := resp.GetPool().GetStatus().GetLastScalingDecision(); d.GetReason() != "DemandDown" || d.GetToReplicas() != 1 {
		t.Errorf("last decision %v", d)
	}
}

// Proxies older than max_age are rolled, one beyond the count at a time
// (max_surge 1, max_unavailable 0), never fewer than replicas Ready; the
// orchestrator is killed mid-rollout and the rollout finishes after its
// restart without ever exceeding replicas + max_surge live proxies.
func TestPoolRotationByAgeSurvivesOrchestratorKill(t *testing.T) {
	s := newSuite(t)
	s.startProvisioner("prov-1")
	orch := s.startPoolOrchestrator()
	s.startPoolLease()
	s.startHealth("health-1")
	const replicas = 3
	if _, err := s.pools().CreateProxyPool(ctx(t, 10*time.Second), &proxyv1.CreateProxyPoolRequest{Name: "aging", Spec: &proxyv1.ProxyPoolSpec{
		Template: localTemplate(), Replicas: replicas, MaxAge: durationpb.New(time.Minute), MaxSurge: 1,
		DrainTimeout: durationpb.New(time.Minute),
	}}); err != nil {
		t.Fatal(err)
	}
	first := s.waitPool("aging", "3 Ready", 2*time.Minute, func(c poolCounts) bool { return c.ready == replicas })
	stop := make(chan struct{})
	bounds := s.watchBounds("aging", stop)

	// The rollout starts a minute after creation: the first surge proxy.
	s.waitPool("aging", "a replacement", 3*time.Minute, func(c poolCounts) bool { return c.live > replicas })
	orch.Kill(t)
	t.Log("orchestrator killed mid-rollout")
	orch = s.startPoolOrchestrator()
	s.waitPool("aging", "fully rotated", 5*time.Minute, func(c poolCounts) bool {
		if c.ready != replicas || c.live != replicas || c.draining != 0 {
			return false
		}
		for n := range first.names {
			if c.names[n] {
				return false
			}
		}
		return true
	})
	close(stop)
	maxLive, minReady := bounds()
	if maxLive > replicas+1 {
		t.Errorf("%d live proxies at once, more than replicas %d + max_surge 1", maxLive, replicas)
	}
	if minReady < replicas {
		t.Errorf("only %d Ready at one point, fewer than replicas %d - max_unavailable 0", minReady, replicas)
	}
}

// freezeInstance stops (SIGSTOP) the proxy process of one local instance:
// it still holds its port, so nothing restarts it, but it answers no
// probe.
func (s *suite) freezeInstance(uid string) {
	entries, _ := os.ReadDir("/proc")
	killed := 0
	for _, e := range entries {
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(cmdline), filepath.Join(s.stateDir, uid)+"/") {
			if p, err := os.FindProcess(atoi(e.Name())); err == nil && p.Signal(syscall.SIGSTOP) == nil {
				killed++
			}
		}
	}
	if killed == 0 {
		s.t.Fatalf("no process of instance %s", uid)
	}
}

// A second provider, local-b, has room for two instances: when it runs
// out (QuotaExceeded) the pool moves its missing share to local. A pool
// proxy that stops answering is replaced after the unhealthy grace.
func TestPoolSpreadMovesAndUnhealthyReplaced(t *testing.T) {
	s := newSuite(t)
	stateB := filepath.Join(s.dir, "local-b")
	b2, b3 := 200+time.Now().Nanosecond()%50, time.Now().Nanosecond()/50%250
	netB := fmt.Sprintf("127.%d.%d.0/24", b2, b3)
	// local-b has room for two instances: every other address of its
	// network is taken on the proxies' port.
	for host := 3; host <= 254; host++ {
		l, err := net.Listen("tcp", fmt.Sprintf("127.%d.%d.%d:3128", b2, b3, host))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
	}
	s.providers = s.write("providers.yaml", fmt.Sprintf(
		"providers:\n  - name: local\n    type: local\n    local: {stateDir: %q, network: %q}\n  - name: local-b\n    type: local\n    local: {stateDir: %q, network: %q}\n",
		s.stateDir, fmt.Sprintf("127.%d.%d.0/24", 150+time.Now().Nanosecond()%50, time.Now().Nanosecond()/50%250), stateB, netB))
	s.startProvisioner("prov-1")
	s.startProvisioner("prov-b", "--provider=local-b")
	s.startPoolOrchestrator()
	s.startPoolLease()
	s.startHealth("health-1")
	t.Cleanup(func() { killInstancesUnder(stateB) })
	spec := &proxyv1.ProxyPoolSpec{
		Template: &proxyv1.ProxyTemplate{Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED}},
		Replicas: 6, Spread: []*proxyv1.SpreadTarget{{Provider: "local", Weight: 1}, {Provider: "local-b", Weight: 1}},
		UnhealthyGrace: durationpb.New(10 * time.Second), DrainTimeout: durationpb.New(30 * time.Second),
	}
	if _, err := s.pools().CreateProxyPool(ctx(t, 10*time.Second), &proxyv1.CreateProxyPoolRequest{Name: "spread", Spec: spec}); err != nil {
		t.Fatal(err)
	}
	c := s.waitPool("spread", "6 Ready, 2 on local-b and 4 on local", 3*time.Minute, func(c poolCounts) bool {
		return c.ready == 6 && c.byProvider["local-b"] == 2 && c.byProvider["local"] == 4
	})
	t.Logf("spread: %v", c.byProvider)
	resp, err := s.pools().GetProxyPool(ctx(t, 10*time.Second), &proxyv1.GetProxyPoolRequest{Name: "spread"})
	if err != nil {
		t.Fatal(err)
	}
	degraded := false
	for _, cond := range resp.GetPool().GetStatus().GetConditions() {
		if cond.GetType() == "ProviderDegraded" && cond.GetStatus() == proxyv1.ConditionStatus_CONDITION_STATUS_TRUE {
			degraded = true
		}
	}
	if !degraded {
		t.Errorf("no ProviderDegraded condition: %v", resp.GetPool().GetStatus().GetConditions())
	}

	// Freeze one proxy on local: health finds it down, and after the
	// grace the pool replaces it.
	list, err := s.proxies().ListProxies(ctx(t, 10*time.Second), &proxyv1.ListProxiesRequest{Labels: map[string]string{"pool": "spread"}, Provider: "local"})
	if err != nil || len(list.GetProxies()) == 0 {
		t.Fatal(list, err)
	}
	victim := list.GetProxies()[0]
	s.freezeInstance(victim.GetUid())
	s.waitPool("spread", "the dead proxy replaced", 3*time.Minute, func(c poolCounts) bool {
		return !c.names[victim.GetName()] && c.ready == 6
	})
}

// The pools follow the providers' health as the health service reports
// it: while local-b's backend is NOT_READY (its state directory is not
// usable) its share goes to local, and ProviderDegraded says why; once it
// is READY again the pool moves half back.
func TestPoolSpreadFollowsProviderHealth(t *testing.T) {
	s := newSuite(t)
	stateB := filepath.Join(s.dir, "local-b")
	netB := fmt.Sprintf("127.%d.%d.0/24", 200+time.Now().Nanosecond()%50, time.Now().Nanosecond()/50%250)
	s.providers = s.write("providers.yaml", fmt.Sprintf(
		"providers:\n  - name: local\n    type: local\n    local: {stateDir: %q, network: %q}\n  - name: local-b\n    type: local\n    local: {stateDir: %q, network: %q}\n",
		s.stateDir, fmt.Sprintf("127.%d.%d.0/24", 150+time.Now().Nanosecond()%50, time.Now().Nanosecond()/50%250), stateB, netB))
	s.startProvisioner("prov-1")
	_, provB := servicetest.Start(t, "../../services/provisioner-local", append([]string{"--nats-url=" + s.nats.URL(), "--log-level=debug",
		"--providers-config=" + s.providers, "--provider=local-b", "--replica-id=prov-b", "--ack-wait=5s"}, s.serving()...))
	t.Cleanup(func() { killInstancesUnder(stateB) })
	_, health := servicetest.Start(t, "../../services/health", append(append(s.common(), s.peer("provisioner")...),
		"--providers-config="+s.providers, "--replica-id=health-1",
		"--probe-target="+s.site.URL+"/probe", "--probe-ca-file="+s.siteCA, "--probe-interval=500ms", "--probe-timeout=500ms",
		"--membership-ttl=3s", "--provisioner=local="+s.provisioner.GRPC+",local-b="+provB.GRPC, "--provider-check-interval=10s"))
	providerReadiness := func(name string) healthv1.ProviderReadiness {
		r, err := s.health(health.GRPC).GetProviderHealth(ctx(t, 10*time.Second), &healthv1.GetProviderHealthRequest{Provider: name})
		if err != nil {
			return healthv1.ProviderReadiness_PROVIDER_READINESS_UNSPECIFIED
		}
		return r.GetHealth().GetReadiness()
	}

	// local-b's state directory becomes a file: its check fails.
	if err := os.Rename(stateB, stateB+".away"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(stateB, []byte("not a directory"), 0o644); err != nil {
		t.Fatal(err)
	}
	waittest.For(t, time.Minute, "local-b NOT_READY and local READY", func() bool {
		return providerReadiness("local-b") == healthv1.ProviderReadiness_PROVIDER_READINESS_NOT_READY &&
			providerReadiness("local") == healthv1.ProviderReadiness_PROVIDER_READINESS_READY
	})

	// The orchestrator reads the providers' health with the service token.
	p := s.startPoolOrchestrator(append(s.peer("health"), "--health-addr="+health.GRPC, "--provider-health-interval=500ms")...)
	spec := &proxyv1.ProxyPoolSpec{
		Template: &proxyv1.ProxyTemplate{Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED}},
		Replicas: 4, Spread: []*proxyv1.SpreadTarget{{Provider: "local", Weight: 1}, {Provider: "local-b", Weight: 1}},
		DrainTimeout: durationpb.New(30 * time.Second),
	}
	if _, err := s.pools().CreateProxyPool(ctx(t, 10*time.Second), &proxyv1.CreateProxyPoolRequest{Name: "follow", Spec: spec}); err != nil {
		t.Fatal(err)
	}
	s.waitPool("follow", "4 Ready, all on local", 3*time.Minute, func(c poolCounts) bool {
		return c.ready == 4 && c.byProvider["local"] == 4 && c.byProvider["local-b"] == 0
	})
	pool := s.getPool("follow")
	cond := condition(pool, "ProviderDegraded")
	if cond.GetStatus() != proxyv1.ConditionStatus_CONDITION_STATUS_TRUE || !strings.Contains(cond.GetMessage(), "local-b (provider NOT_READY: TargetsNotReady: localhost StateDirNotWritable)") {
		t.Errorf("ProviderDegraded = %v, want TRUE naming local-b's NOT_READY", cond)
	}
	for _, sp := range pool.GetStatus().GetSpread() {
		if sp.GetProvider() == "local-b" && (sp.GetDesired() != 0 || !sp.GetFailing() || sp.GetLastFailureTime() != nil) {
			t.Errorf("local-b's spread = %v, want desired 0, failing, and no proxy ever failed there", sp)
		}
	}
	if !strings.Contains(p.Output(), "pools follow the providers' health") {
		t.Errorf("the orchestrator did not say it follows the providers' health")
	}

	// local-b recovers: half the pool moves back.
	if err := os.Remove(stateB); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(stateB+".away", stateB); err != nil {
		t.Fatal(err)
	}
	waittest.For(t, time.Minute, "local-b READY again", func() bool {
		return providerReadiness("local-b") == healthv1.ProviderReadiness_PROVIDER_READINESS_READY
	})
	c := s.waitPool("follow", "4 Ready, 2 on each provider", 3*time.Minute, func(c poolCounts) bool {
		return c.ready == 4 && c.byProvider["local"] == 2 && c.byProvider["local-b"] == 2 && c.draining == 0
	})
	t.Logf("spread after recovery: %v", c.byProvider)
	waittest.For(t, 30*time.Second, "ProviderDegraded FALSE", func() bool {
		return condition(s.getPool("follow"), "ProviderDegraded").GetStatus() == proxyv1.ConditionStatus_CONDITION_STATUS_FALSE
	})
}

func (s *suite) getPool(name string) *proxyv1.ProxyPool {
	s.t.Helper()
	resp, err := s.pools().GetProxyPool(ctx(s.t, 10*time.Second), &proxyv1.GetProxyPoolRequest{Name: name})
	if err != nil {
		s.t.Fatal(err)
	}
	return resp.GetPool()
}

func condition(p *proxyv1.ProxyPool, typ string) *proxyv1.PoolCondition {
	for _, c := range p.GetStatus().GetConditions() {
		if c.GetType() == typ {
			return c
		}
	}
	return nil
}
