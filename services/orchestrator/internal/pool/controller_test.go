package pool_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
	poolctl "github.com/egress-proxies/egress-proxies/services/orchestrator/internal/pool"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// members are a pool's proxies as the waits see them: live (neither
// draining nor deleting), the Ready ones among them, and the draining.
type members struct{ live, ready, draining []*lifecycle.Proxy }

func poolMembers(h *orchtest.Harness, name string) (members, []*lifecycle.Proxy, error) {
	rows, _, err := h.Store.List(context.Background(), store.Filter{Labels: map[string]string{"pool": name}, Limit: 10000})
	var m members
	for _, r := range rows {
		switch {
		case r.Deleting():
		case r.Draining():
			m.draining = append(m.draining, r)
		default:
			m.live = append(m.live, r)
			if r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_READY {
				m.ready = append(m.ready, r)
			}
		}
	}
	return m, rows, err
}

// waitPool waits until the pool's proxies satisfy cond and returns them
// all (deleting ones too).
func waitPool(t testing.TB, h *orchtest.Harness, name, what string, cond func(live, ready, draining []*lifecycle.Proxy) bool) []*lifecycle.Proxy {
	t.Helper()
	return waitPoolFor(t, h, name, what, 30*time.Second, cond)
}

func waitPoolFor(t testing.TB, h *orchtest.Harness, name, what string, timeout time.Duration, cond func(live, ready, draining []*lifecycle.Proxy) bool) []*lifecycle.Proxy {
	t.Helper()
	var rows []*lifecycle.Proxy
	waittest.ForErr(t, timeout, "pool "+name+" "+what, func() error {
		m, all, err := poolMembers(h, name)
		if err != nil {
			return err
		}
		if !cond(m.live, m.ready, m.draining) {
			return fmt.Errorf("%d live, %d ready, %d draining", len(m.live), len(m.ready), len(m.draining))
		}
		rows = all
		return nil
	})
	return rows
}

// startPools is a harness for the pool controller: providers fake and
// other answer every command at once, health marks every running proxy
// healthy, lease demand comes from a book (h.Demand), and one replica
// runs.
func startPools(t testing.TB) *orchtest.Harness {
	t.Helper()
	h := orchtest.New(t)
	h.Demand = poolctl.NewBook()
	cloud := orchtest.NewCloud()
	h.StartProvisioner("fake", cloud.Answer)
	h.StartProvisioner("other", cloud.Answer)
	h.StartReplica()
	h.AutoHealth()
	return h
}

// startSolo is a harness with lease demand from a book and one replica,
// and a proxy "solo" of no pool, running.
func startSolo(t testing.TB) (*orchtest.Harness, *orchtest.Cloud, *proxyv1.Proxy) {
	t.Helper()
	h := orchtest.New(t)
	h.Demand = poolctl.NewBook()
	cloud, _ := h.StartCloud("fake")
	h.StartReplica()
	p := h.Create(orchtest.Managed("solo"))
	h.WaitFor("solo", "running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	return h, cloud, p
}

func TestPoolScalesUpAndDown(t *testing.T) {
	t.Parallel()
	h := startPools(t)
	ctx := context.Background()
	if _, err := h.Pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "web", Spec: orchtest.PoolSpec(4)}); err != nil {
		t.Fatal(err)
	}
	rows := waitPool(t, h, "web", "4 Ready", func(live, ready, _ []*lifecycle.Proxy) bool { return len(live) == 4 && len(ready) == 4 })
	perProvider := map[string]int{}
	for _, r := range rows {
		perProvider[r.Spec.GetProvider()]++
		if r.Pool != "web" || r.Labels["pool"] != "web" || r.Labels["team"] != "crawl" || !strings.HasPrefix(r.Name, "web-") || len(r.Name) != len("web-")+5 {
			t.Errorf("pool proxy %s: pool %q labels %v", r.Name, r.Pool, r.Labels)
		}
	}
	if perProvider["fake"] != 2 || perProvider["other"] != 2 {
		t.Errorf("spread %v, want 2 and 2", perProvider)
	}
	waitStatus(t, h, "web", func(p *proxyv1.ProxyPool) bool {
		st := p.GetStatus()
		return st.GetReadyReplicas() == 4 && st.GetCurrentReplicas() == 4 && st.GetUpdatedReplicas() == 4 && st.GetDesiredReplicas() == 4
	})

	// One proxy holds a lease: scale-down deletes two idle ones and keeps
	// the leased one.
	leased := rows[0]
	h.Demand.Record("web", &proxyv1.PoolDemand{ActiveLeases: 1}, map[string]int{leased.UID: 1})
	if _, err := h.Pools.ScaleProxyPool(ctx, &proxyv1.ScaleProxyPoolRequest{Name: "web", Replicas: 2}); err != nil {
		t.Fatal(err)
	}
	waitPool(t, h, "web", "2 live", func(live, _, draining []*lifecycle.Proxy) bool { return len(live) == 2 })
	if r, err := h.Store.Get(ctx, leased.Name); err != nil || r.Deleting() || r.Draining() {
		t.Fatalf("the leased proxy was given up: %v %v", r, err)
	}

	// Scale to 0 with the lease still held: the leased proxy drains and
	// goes when its lease ends.
	if _, err := h.Pools.ScaleProxyPool(ctx, &proxyv1.ScaleProxyPoolRequest{Name: "web", Replicas: 0}); err != nil {
		t.Fatal(err)
	}
	h.WaitFor(leased.Name, "draining", func(r *lifecycle.Proxy) bool { return r.Draining() })
	h.Demand.Record("web", &proxyv1.PoolDemand{}, map[string]int{})
	h.WaitGone(leased.Name)
	waitPool(t, h, "web", "empty", func(live, _, draining []*lifecycle.Proxy) bool { return len(live)+len(draining) == 0 })
	p := waitStatus(t, h, "web", func(p *proxyv1.ProxyPool) bool { return p.GetStatus().GetCurrentReplicas() == 0 })
	if d := p.GetStatus().GetLastScalingDecision(); d.GetFromReplicas() != 2 || d.GetToReplicas() != 0 {
		t.Errorf("last decision %v", d)
	}
}

func waitStatus(t *testing.T, h *orchtest.Harness, name string, cond func(*proxyv1.ProxyPool) bool) *proxyv1.ProxyPool {
	t.Helper()
	var got *proxyv1.ProxyPool
	waittest.ForErr(t, 30*time.Second, "pool "+name+"'s status as wanted", func() error {
		resp, err := h.Pools.GetProxyPool(context.Background(), &proxyv1.GetProxyPoolRequest{Name: name})
		if err != nil {
			return err
		}
		if got = resp.GetPool(); !cond(got) {
			return fmt.Errorf("last: %v", got.GetStatus())
		}
		return nil
	})
	return got
}

// A template change rolls the pool: never more than replicas + max_surge
// live proxies, never fewer than replicas - max_unavailable Ready, and in
// the end every proxy is made from the new template.
func TestPoolRollsOnTemplateChange(t *testing.T) {
	t.Parallel()
	h := startPools(t)
	h.StartReplica() // two controllers: one owner per pool at a time
	ctx := context.Background()
	spec := orchtest.PoolSpec(4)
	spec.MaxSurge = 1
	resp, err := h.Pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "web", Spec: spec})
	if err != nil {
		t.Fatal(err)
	}
	waitPool(t, h, "web", "4 Ready", func(live, ready, _ []*lifecycle.Proxy) bool { return len(live) == 4 && len(ready) == 4 })

	var mu sync.Mutex
	maxLive, minReady := 0, 1<<30
	stop := make(chan struct{})
	watched := make(chan struct{})
	go func() { // samples the pool every 5ms during the rollout
		defer close(watched)
		for {
			if m, _, err := poolMembers(h, "web"); err == nil {
				mu.Lock()
				maxLive, minReady = max(maxLive, len(m.live)), min(minReady, len(m.ready))
				mu.Unlock()
			}
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	spec.Template.Spec.Placement.MachineType = "large"
	if _, err := h.Pools.UpdateProxyPool(ctx, &proxyv1.UpdateProxyPoolRequest{Name: "web", Spec: spec, Generation: resp.GetPool().GetGeneration()}); err != nil {
		t.Fatal(err)
	}
	waitPool(t, h, "web", "rolled", func(live, ready, draining []*lifecycle.Proxy) bool {
		if len(live) != 4 || len(ready) != 4 || len(draining) != 0 {
			return false
		}
		for _, r := range live {
			if r.Spec.GetPlacement().GetMachineType() != "large" {
				return false
			}
		}
		return true
	})
	close(stop)
	<-watched
	if maxLive > 5 || minReady < 4 {
		t.Errorf("during the rollout: at most %d live (want <= 5), at least %d Ready (want >= 4)", maxLive, minReady)
	}
	waitStatus(t, h, "web", func(p *proxyv1.ProxyPool) bool {
		return p.GetStatus().GetUpdatedReplicas() == 4 && p.GetStatus().GetObservedGeneration() == 2
	})
	// Deleting the pool drains and removes everything, then the pool.
	if _, err := h.Pools.DeleteProxyPool(ctx, &proxyv1.DeleteProxyPoolRequest{Name: "web"}); err != nil {
		t.Fatal(err)
	}
	waittest.ForErr(t, 30*time.Second, "pool web gone after its delete", func() error {
		_, err := h.Pools.GetProxyPool(ctx, &proxyv1.GetProxyPoolRequest{Name: "web"})
		if status.Code(err) == codes.NotFound {
			return nil
		}
		return fmt.Errorf("GetProxyPool: %v", err)
	})
	if rows, _, _ := h.Store.List(ctx, store.Filter{Labels: map[string]string{"pool": "web"}, Limit: 100}); len(rows) != 0 {
		t.Fatalf("%d proxies left after the pool", len(rows))
	}
}

// publishDemand publishes a demand report as the lease service does.
// An admin drains a proxy of no pool: it stays while the lease service
// reports a lease on it, and is deleted once a report shows none.
func TestDrainedProxyGoesWhenItsLeasesEnd(t *testing.T) {
	t.Parallel()
	h, cloud, p := startSolo(t)
	if _, err := h.Client.DrainProxy(context.Background(), &proxyv1.DrainProxyRequest{Name: "solo", DrainTimeout: durationpb.New(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	h.PublishDemand("", map[string]int32{p.GetUid(): 1})
	waittest.For(t, 10*time.Second, "the demand report with the lease", func() bool {
		d := h.Demand.Get("")
		return d != nil && d.LeasesByProxyID[p.GetUid()] == 1
	})
	// With the report in, sweeps keep the proxy (the replica's controller
	// sweeps too, from the same book).
	ctrl := h.Controller()
	for range 2 {
		if err := ctrl.SweepDrained(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if r, err := h.Store.Get(context.Background(), "solo"); err != nil || r.Deleting() {
		t.Fatalf("a drained proxy with a lease was deleted: %v %v", r, err)
	}
	h.PublishDemand("", map[string]int32{})
	h.WaitGone("solo")
	if _, live := cloud.Live(p.GetUid()); live {
		t.Fatal("the instance was not cleaned up")
	}
}

// A draining proxy of no pool goes at its deadline even with leases.
func TestDrainedProxyGoesAtItsDeadline(t *testing.T) {
	t.Parallel()
	h, cloud, p := startSolo(t)
	h.PublishDemand("", map[string]int32{p.GetUid(): 3})
	start := time.Now()
	if _, err := h.Client.DrainProxy(context.Background(), &proxyv1.DrainProxyRequest{Name: "solo", DrainTimeout: durationpb.New(time.Second)}); err != nil {
		t.Fatal(err)
	}
	h.WaitGone("solo")
	if time.Since(start) < time.Second {
		t.Fatalf("deleted after %s, before its 1s drain timeout", time.Since(start))
	}
	if _, live := cloud.Live(p.GetUid()); live {
		t.Fatal("the instance was not cleaned up")
	}
}

// Autoscaling on the lease demand published on NATS: refused acquires
// scale up at once within max_replicas; idle demand scales down to
// min_replicas only after the stabilisation window.
func TestPoolAutoscalesOnDemand(t *testing.T) {
	t.Parallel()
	h := startPools(t)
	ctx := context.Background()
	spec := orchtest.PoolSpec(1)
	spec.Autoscaling = &proxyv1.Autoscaling{MinReplicas: 1, MaxReplicas: 4, TargetUtilizationPercent: 100,
		ScaleDownStabilization: durationpb.New(2 * time.Second)}
	if _, err := h.Pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "auto", Spec: spec}); err != nil {
		t.Fatal(err)
	}
	rows := waitPool(t, h, "auto", "1 Ready", func(live, ready, _ []*lifecycle.Proxy) bool { return len(ready) == 1 })
	busy := rows[0].UID
	report := func(active, capacity, leasable, refused int64, leases map[string]int32) {
		ev := &busv1.PoolDemandEvent{Pool: "auto", LeasesByProxy: leases, Demand: &proxyv1.PoolDemand{
			ActiveLeases: active, Capacity: capacity, LeasableProxies: leasable, RefusedAcquires: refused, ObserveTime: timestamppb.Now()}}
		if _, err := bus.Publish(ctx, h.JS, h.Names.DemandSubject("auto"), ev); err != nil {
			t.Fatal(err)
		}
	}
	// One proxy of capacity 1, leased, and 9 acquires refused: 10 wanted,
	// capped at 4.
	refusedAt := time.Now() // no later than the report's observe time, which the window counts from
	report(1, 1, 1, 9, map[string]int32{busy: 1})
	p := waitStatus(t, h, "auto", func(p *proxyv1.ProxyPool) bool { return p.GetStatus().GetDesiredReplicas() == 4 })
	if d := p.GetStatus().GetLastScalingDecision(); d.GetReason() != poolctl.ScaleRefusedAcquires || d.GetFromReplicas() != 1 || d.GetDemand().GetRefusedAcquires() != 9 ||
		!strings.Contains(d.GetMessage(), "capped at max_replicas") {
		t.Errorf("scale-up decision %v", d)
	}
	waitPool(t, h, "auto", "4 Ready", func(live, ready, _ []*lifecycle.Proxy) bool { return len(ready) == 4 })
	// Idle, but the leased proxy still holds its lease: down to 1 after
	// the window, never giving up the leased one.
	report(1, 4, 4, 0, map[string]int32{busy: 1})
	// Reports keep coming, as the lease service sends them.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
				report(1, 4, 4, 0, map[string]int32{busy: 1})
			}
		}
	}()
	p = waitStatus(t, h, "auto", func(p *proxyv1.ProxyPool) bool { return p.GetStatus().GetDesiredReplicas() == 1 })
	if d := p.GetStatus().GetLastScalingDecision(); d.GetReason() != poolctl.ScaleDemandDown {
		t.Errorf("scale-down decision %v", d)
	}
	if at := p.GetStatus().GetLastScalingDecision().GetTime().AsTime(); at.Sub(refusedAt) < 2*time.Second {
		t.Errorf("scaled down %s after the refusals, within the 2s window", at.Sub(refusedAt))
	}
	waitPool(t, h, "auto", "1 live", func(live, _, _ []*lifecycle.Proxy) bool { return len(live) == 1 && live[0].UID == busy })
}

// TestAutoscaleHistoryOutlivesTheReplica: the scale-down window looks back
// on the pool's own history, so a replica that takes the pool over, whose
// book heard only the latest report, scales down once the window since the
// busy report has passed, not a whole window after it started listening.
func TestAutoscaleHistoryOutlivesTheReplica(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	ctx := context.Background()
	spec := orchtest.PoolSpec(1)
	spec.Autoscaling = &proxyv1.Autoscaling{MinReplicas: 1, MaxReplicas: 4, TargetUtilizationPercent: 100,
		ScaleDownStabilization: durationpb.New(20 * time.Second)}
	if _, err := h.Pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "auto", Spec: spec}); err != nil {
		t.Fatal(err)
	}
	sync := func(c *poolctl.Controller) *proxyv1.ProxyPool {
		t.Helper()
		if err := c.Sync(ctx, "auto"); err != nil {
			t.Fatal(err)
		}
		p, err := h.Pools.GetProxyPool(ctx, &proxyv1.GetProxyPoolRequest{Name: "auto"})
		if err != nil {
			t.Fatal(err)
		}
		return p.GetPool()
	}
	// Replica A heard 30s ago: one proxy leased, three acquires refused.
	busyAt := time.Now().Add(-30 * time.Second)
	a := h.Controller()
	bookA := poolctl.NewBook()
	a.Demand = bookA.Get
	bookA.Record("auto", &proxyv1.PoolDemand{ActiveLeases: 1, Capacity: 1, LeasableProxies: 1, RefusedAcquires: 3, ObserveTime: timestamppb.New(busyAt)}, nil)
	sync(a) // the pool's first count
	if p := sync(a); p.GetStatus().GetDesiredReplicas() != 4 {
		t.Fatalf("replica A: desired %d after the refusals, want 4 (%v)", p.GetStatus().GetDesiredReplicas(), p.GetStatus().GetLastScalingDecision())
	}
	row, err := h.Store.GetPool(ctx, "auto")
	if err != nil {
		t.Fatal(err)
	}
	if hist := row.ScaleHistory; hist.Since.Sub(busyAt).Abs() > time.Millisecond || len(hist.Steps) != 1 || hist.Steps[0].Want != 4 {
		t.Fatalf("stored history %+v, want since the busy report, one step of 4", hist)
	}
	// Replica B takes over; its book holds only a quiet report.
	b := h.Controller()
	bookB := poolctl.NewBook()
	b.Demand = bookB.Get
	bookB.Record("auto", &proxyv1.PoolDemand{ActiveLeases: 1, Capacity: 4, LeasableProxies: 4, ObserveTime: timestamppb.Now()}, nil)
	p := sync(b)
	if d := p.GetStatus().GetLastScalingDecision(); p.GetStatus().GetDesiredReplicas() != 1 || d.GetReason() != poolctl.ScaleDemandDown {
		t.Fatalf("replica B: desired %d (%v), want 1 by %s: the busy report is older than the window", p.GetStatus().GetDesiredReplicas(), d, poolctl.ScaleDemandDown)
	}
}
