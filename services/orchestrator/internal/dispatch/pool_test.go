package dispatch_test

import (
	"context"
	"io"
	"log/slog"
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
	poolctl "github.com/egress-proxies/egress-proxies/services/orchestrator/internal/pool"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

func poolSpec(replicas int32) *proxyv1.ProxyPoolSpec {
	return &proxyv1.ProxyPoolSpec{
		Template: &proxyv1.ProxyTemplate{
			Labels: map[string]string{"team": "crawl"},
			Spec: &proxyv1.ProxySpec{
				Mode:      proxyv1.ProxyMode_PROXY_MODE_MANAGED,
				Placement: &proxyv1.Placement{Zone: "z1", MachineType: "small", Image: "debian"},
			},
		},
		Replicas:     replicas,
		Spread:       []*proxyv1.SpreadTarget{{Provider: "fake", Weight: 1}, {Provider: "other", Weight: 1}},
		DrainTimeout: durationpb.New(time.Second),
	}
}

func TestPoolValidation(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	mut := func(f func(*proxyv1.ProxyPoolSpec)) *proxyv1.ProxyPoolSpec {
		s := poolSpec(1)
		f(s)
		return s
	}
	cases := []struct {
		name string
		req  *proxyv1.CreateProxyPoolRequest
		want string
	}{
		{"name too long for its proxies", &proxyv1.CreateProxyPoolRequest{Name: strings.Repeat("a", 57), Spec: poolSpec(1)}, "name: does not match regex pattern"},
		{"no spec", &proxyv1.CreateProxyPoolRequest{Name: "p"}, "spec: value is required"},
		{"no template", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Template = nil })}, "spec.template: value is required"},
		{"negative replicas", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Replicas = -1 })}, "spec.replicas: must be greater than or equal to 0"},
		{"external template", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) {
			s.Template.Spec = &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "h", Port: 1}}
		})}, "spec.template.spec.mode: must be MANAGED"},
		{"unconfigured spread provider", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Spread[1].Provider = "gcp" })}, `spec.spread[1].provider: "gcp" is not configured`},
		{"spread twice the same", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Spread[1].Provider = "fake" })}, "spec.spread[1]: provider \"fake\" zone \"\" appears twice"},
		{"provider with spread", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Template.Spec.Provider = "fake" })}, "spec.template.spec.provider: leave it empty"},
		{"no provider at all", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Spread = nil })}, "spec.template.spec.provider: required"},
		{"pool label in template", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Template.Labels["pool"] = "x" })}, `spec.template.labels["pool"]: is set by the pool`},
		{"min over max", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) {
			s.Autoscaling = &proxyv1.Autoscaling{MinReplicas: 5, MaxReplicas: 2}
		})}, "spec.autoscaling.min_replicas: 5 is more than max_replicas 2"},
		{"max age too short", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.MaxAge = durationpb.New(time.Second) })}, "spec.max_age: must be greater than or equal to 60s"},
		{"weight too big", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Spread[0].Weight = 5000 })}, "spec.spread[0].weight: must be less than or equal to 1000"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := h.pools.CreateProxyPool(context.Background(), tc.req)
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), tc.want) {
				t.Fatalf("err = %v, want InvalidArgument containing %q", err, tc.want)
			}
		})
	}
	if names, err := h.store.PoolNames(context.Background()); err != nil || len(names) != 0 {
		t.Fatalf("refused creates stored pools: %v %v", names, err)
	}
}

func TestPoolAPI(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	watch, err := h.pools.WatchProxyPools(ctx, &proxyv1.WatchProxyPoolsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := watch.Header(); err != nil {
		t.Fatal(err)
	}
	created, err := h.pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "web", Spec: poolSpec(0)})
	if err != nil || !created.GetCreated() {
		t.Fatalf("create: %v %v", created, err)
	}
	again, err := h.pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "web", Spec: poolSpec(0)})
	if err != nil || again.GetCreated() || again.GetPool().GetUid() != created.GetPool().GetUid() {
		t.Fatalf("create again: %v %v", again, err)
	}
	if _, err := h.pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "web", Spec: poolSpec(3)}); status.Code(err) != codes.AlreadyExists {
		t.Fatalf("create different: %v, want AlreadyExists", err)
	}
	scaled, err := h.pools.ScaleProxyPool(ctx, &proxyv1.ScaleProxyPoolRequest{Name: "web", Replicas: 2})
	if err != nil {
		t.Fatal(err)
	}
	if scaled.GetPool().GetSpec().GetReplicas() != 2 || scaled.GetPool().GetGeneration() != 2 ||
		scaled.GetPool().GetStatus().GetLastScalingDecision().GetReason() != "Scaled" {
		t.Fatalf("scaled: %v", scaled.GetPool())
	}
	spec := poolSpec(2)
	spec.MaxSurge = 2
	if _, err := h.pools.UpdateProxyPool(ctx, &proxyv1.UpdateProxyPoolRequest{Name: "web", Spec: spec}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("update without generation: %v", err)
	}
	if _, err := h.pools.UpdateProxyPool(ctx, &proxyv1.UpdateProxyPoolRequest{Name: "web", Spec: spec, Generation: 1}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("update with an old generation: %v", err)
	}
	upd, err := h.pools.UpdateProxyPool(ctx, &proxyv1.UpdateProxyPoolRequest{Name: "web", Spec: spec, Generation: 2, Labels: map[string]string{"env": "prod"}})
	if err != nil || upd.GetPool().GetSpec().GetMaxSurge() != 2 || upd.GetPool().GetLabels()["env"] != "prod" {
		t.Fatalf("update: %v %v", upd, err)
	}
	got, err := h.pools.GetProxyPool(ctx, &proxyv1.GetProxyPoolRequest{Name: "web"})
	if err != nil || got.GetPool().GetEtag() != upd.GetPool().GetEtag() {
		t.Fatalf("get: %v %v", got, err)
	}
	if _, err := h.pools.GetProxyPool(ctx, &proxyv1.GetProxyPoolRequest{Name: "nope"}); status.Code(err) != codes.NotFound {
		t.Fatalf("get missing: %v", err)
	}
	if _, err := h.pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "api", Spec: poolSpec(0)}); err != nil {
		t.Fatal(err)
	}
	page1, err := h.pools.ListProxyPools(ctx, &proxyv1.ListProxyPoolsRequest{PageSize: 1})
	if err != nil || len(page1.GetPools()) != 1 || page1.GetPools()[0].GetName() != "api" || page1.GetNextPageToken() == "" {
		t.Fatalf("list page 1: %v %v", page1, err)
	}
	page2, err := h.pools.ListProxyPools(ctx, &proxyv1.ListProxyPoolsRequest{PageSize: 1, PageToken: page1.GetNextPageToken()})
	if err != nil || len(page2.GetPools()) != 1 || page2.GetPools()[0].GetName() != "web" {
		t.Fatalf("list page 2: %v %v", page2, err)
	}
	del, err := h.pools.DeleteProxyPool(ctx, &proxyv1.DeleteProxyPoolRequest{Name: "api"})
	if err != nil || del.GetPool().GetDeleteTime() == nil {
		t.Fatalf("delete: %v %v", del, err)
	}
	if _, err := h.pools.GetProxyPool(ctx, &proxyv1.GetProxyPoolRequest{Name: "api"}); status.Code(err) != codes.NotFound {
		t.Fatalf("a pool without proxies is gone at once: %v", err)
	}
	var seen []string
	for len(seen) < 5 {
		c, err := watch.Recv()
		if err != nil {
			t.Fatal(err)
		}
		seen = append(seen, c.GetPool().GetName()+":"+strings.TrimPrefix(c.GetType().String(), "CHANGE_TYPE_"))
	}
	if want := "web:CREATED web:UPDATED web:UPDATED api:CREATED api:DELETED"; strings.Join(seen, " ") != want {
		t.Fatalf("watch saw %v, want %s", seen, want)
	}
}

func TestDrainProxy(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	h.create(managed("p1"))
	resp, err := h.client.DrainProxy(ctx, &proxyv1.DrainProxyRequest{Name: "p1", DrainTimeout: durationpb.New(time.Minute)})
	if err != nil || !resp.GetProxy().GetDraining() || resp.GetProxy().GetDrainDeadline() == nil {
		t.Fatalf("drain: %v %v", resp, err)
	}
	first := resp.GetProxy().GetDrainDeadline().AsTime()
	again, err := h.client.DrainProxy(ctx, &proxyv1.DrainProxyRequest{Name: "p1", DrainTimeout: durationpb.New(time.Hour)})
	if err != nil || !again.GetProxy().GetDrainDeadline().AsTime().Equal(first) {
		t.Fatalf("draining again moved the deadline: %v %v", again, err)
	}
	undo, err := h.client.DrainProxy(ctx, &proxyv1.DrainProxyRequest{Name: "p1", Cancel: true})
	if err != nil || undo.GetProxy().GetDraining() || undo.GetProxy().GetDrainTime() != nil {
		t.Fatalf("cancel: %v %v", undo, err)
	}
	if _, err := h.client.DrainProxy(ctx, &proxyv1.DrainProxyRequest{Name: "p1", DrainTimeout: durationpb.New(30 * 24 * time.Hour)}); status.Code(err) != codes.InvalidArgument ||
		!strings.Contains(err.Error(), "drain_timeout") {
		t.Fatalf("a month-long drain: %v", err)
	}
	if _, err := h.client.DrainProxy(ctx, &proxyv1.DrainProxyRequest{Name: "nope"}); status.Code(err) != codes.NotFound {
		t.Fatalf("drain missing: %v", err)
	}
}

// autoHealth marks every RUNNING proxy healthy, as the health service would
// once its probes pass, until the test ends.
func (h *harness) autoHealth() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	h.t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		sent := map[string]bool{}
		for ctx.Err() == nil {
			rows, _, err := h.store.List(ctx, store.Filter{Limit: 10000})
			if err == nil {
				for _, r := range rows {
					if r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING && !sent[r.UID] {
						sent[r.UID] = true
						h.publishHealth(r.UID, r.ProviderID, 1, true)
					}
				}
			}
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
}

// waitPool polls the pool's proxies until cond holds, failing after 30s.
func (h *harness) waitPool(name, what string, cond func(live, ready, draining []*store.Row) bool) []*store.Row {
	h.t.Helper()
	return h.waitPoolFor(name, what, 30*time.Second, 20*time.Millisecond, cond)
}

// waitPoolLong waits up to 10 minutes, polling gently (benchmarks).
func (h *harness) waitPoolLong(name string, cond func(live, ready, draining []*store.Row) bool) {
	h.t.Helper()
	h.waitPoolFor(name, "as wanted", 10*time.Minute, 200*time.Millisecond, cond)
}

// controller is a pool controller on the harness's store, for calling Sync
// directly.
func (h *harness) controller() *poolctl.Controller {
	return &poolctl.Controller{Store: h.store, Changes: store.NewSignal(), Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Metrics: poolctl.NewMetrics(nil)}
}

func (h *harness) waitPoolFor(name, what string, timeout, poll time.Duration, cond func(live, ready, draining []*store.Row) bool) []*store.Row {
	h.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		rows, _, err := h.store.List(context.Background(), store.Filter{Labels: map[string]string{"pool": name}, Limit: 10000})
		if err != nil {
			h.t.Fatal(err)
		}
		var live, ready, draining []*store.Row
		for _, r := range rows {
			switch {
			case r.Deleting():
			case r.Draining():
				draining = append(draining, r)
			default:
				live = append(live, r)
				if r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_READY {
					ready = append(ready, r)
				}
			}
		}
		if cond(live, ready, draining) {
			return rows
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("pool %s: not %s within %s: %d live, %d ready, %d draining", name, what, timeout, len(live), len(ready), len(draining))
		}
		time.Sleep(poll)
	}
}

func TestPoolScalesUpAndDown(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.demand = poolctl.NewBook(time.Minute)
	cloud := newCloud()
	h.startProvisioner("fake", cloud.answer)
	h.startProvisioner("other", cloud.answer)
	h.startReplica()
	h.autoHealth()
	ctx := context.Background()
	if _, err := h.pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "web", Spec: poolSpec(4)}); err != nil {
		t.Fatal(err)
	}
	rows := h.waitPool("web", "4 Ready", func(live, ready, _ []*store.Row) bool { return len(live) == 4 && len(ready) == 4 })
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
	h.demand.Record("web", &proxyv1.PoolDemand{ActiveLeases: 1}, map[string]int{leased.UID: 1})
	if _, err := h.pools.ScaleProxyPool(ctx, &proxyv1.ScaleProxyPoolRequest{Name: "web", Replicas: 2}); err != nil {
		t.Fatal(err)
	}
	h.waitPool("web", "2 live", func(live, _, draining []*store.Row) bool { return len(live) == 2 })
	if r, err := h.store.Get(ctx, leased.Name); err != nil || r.Deleting() || r.Draining() {
		t.Fatalf("the leased proxy was given up: %v %v", r, err)
	}

	// Scale to 0 with the lease still held: the leased proxy drains and
	// goes when its lease ends.
	if _, err := h.pools.ScaleProxyPool(ctx, &proxyv1.ScaleProxyPoolRequest{Name: "web", Replicas: 0}); err != nil {
		t.Fatal(err)
	}
	h.waitFor(leased.Name, "draining", func(r *store.Row) bool { return r.Draining() })
	h.demand.Record("web", &proxyv1.PoolDemand{}, map[string]int{})
	h.waitGone(leased.Name)
	h.waitPool("web", "empty", func(live, _, draining []*store.Row) bool { return len(live)+len(draining) == 0 })
	p := waitStatus(t, h, "web", func(p *proxyv1.ProxyPool) bool { return p.GetStatus().GetCurrentReplicas() == 0 })
	if d := p.GetStatus().GetLastScalingDecision(); d.GetFromReplicas() != 2 || d.GetToReplicas() != 0 {
		t.Errorf("last decision %v", d)
	}
}

func waitStatus(t *testing.T, h *harness, name string, cond func(*proxyv1.ProxyPool) bool) *proxyv1.ProxyPool {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := h.pools.GetProxyPool(context.Background(), &proxyv1.GetProxyPoolRequest{Name: name})
		if err == nil && cond(resp.GetPool()) {
			return resp.GetPool()
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool %s status not as wanted within 30s: %v %v", name, resp.GetPool().GetStatus(), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A template change rolls the pool: never more than replicas + max_surge
// live proxies, never fewer than replicas - max_unavailable Ready, and in
// the end every proxy is made from the new template.
func TestPoolRollsOnTemplateChange(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cloud := newCloud()
	h.startProvisioner("fake", cloud.answer)
	h.startProvisioner("other", cloud.answer)
	h.startReplica()
	h.startReplica() // two controllers: one owner per pool at a time
	h.autoHealth()
	ctx := context.Background()
	spec := poolSpec(4)
	spec.MaxSurge = 1
	resp, err := h.pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "web", Spec: spec})
	if err != nil {
		t.Fatal(err)
	}
	h.waitPool("web", "4 Ready", func(live, ready, _ []*store.Row) bool { return len(live) == 4 && len(ready) == 4 })

	var mu sync.Mutex
	maxLive, minReady := 0, 1<<30
	stop := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for {
			select {
			case <-stop:
				return
			default:
			}
			rows, _, err := h.store.List(ctx, store.Filter{Labels: map[string]string{"pool": "web"}, Limit: 1000})
			if err != nil {
				continue
			}
			live, ready := 0, 0
			for _, r := range rows {
				if !r.Deleting() && !r.Draining() {
					live++
					if r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_READY {
						ready++
					}
				}
			}
			mu.Lock()
			maxLive, minReady = max(maxLive, live), min(minReady, ready)
			mu.Unlock()
			time.Sleep(5 * time.Millisecond)
		}
	}()
	spec.Template.Spec.Placement.MachineType = "large"
	if _, err := h.pools.UpdateProxyPool(ctx, &proxyv1.UpdateProxyPoolRequest{Name: "web", Spec: spec, Generation: resp.GetPool().GetGeneration()}); err != nil {
		t.Fatal(err)
	}
	h.waitPool("web", "rolled", func(live, ready, draining []*store.Row) bool {
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
	if _, err := h.pools.DeleteProxyPool(ctx, &proxyv1.DeleteProxyPoolRequest{Name: "web"}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := h.pools.GetProxyPool(ctx, &proxyv1.GetProxyPoolRequest{Name: "web"})
		if status.Code(err) == codes.NotFound {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool not gone after delete: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if rows, _, _ := h.store.List(ctx, store.Filter{Labels: map[string]string{"pool": "web"}, Limit: 100}); len(rows) != 0 {
		t.Fatalf("%d proxies left after the pool", len(rows))
	}
}

// publishDemand publishes a demand report as the lease service does.
func (h *harness) publishDemand(pool string, leases map[string]int32) {
	h.t.Helper()
	var active int64
	for _, n := range leases {
		active += int64(n)
	}
	ev := &busv1.PoolDemandEvent{Pool: pool, Demand: &proxyv1.PoolDemand{ActiveLeases: active, ObserveTime: timestamppb.Now()}, LeasesByProxy: leases}
	if _, err := bus.Publish(context.Background(), h.js, h.names.DemandSubject(pool), ev); err != nil {
		h.t.Fatal(err)
	}
}

// An admin drains a proxy of no pool: it stays while the lease service
// reports a lease on it, and is deleted once a report shows none.
func TestDrainedProxyGoesWhenItsLeasesEnd(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.demand = poolctl.NewBook(time.Minute)
	cloud := newCloud()
	h.startProvisioner("fake", cloud.answer)
	h.startReplica()
	p := h.create(managed("solo"))
	h.waitFor("solo", "running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	if _, err := h.client.DrainProxy(context.Background(), &proxyv1.DrainProxyRequest{Name: "solo", DrainTimeout: durationpb.New(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	h.publishDemand("", map[string]int32{p.GetUid(): 1})
	// The report with the lease arrived: the proxy stays.
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		if d := h.demand.Get(""); d != nil && d.LeasesByProxyID[p.GetUid()] == 1 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if d := h.demand.Get(""); d == nil || d.LeasesByProxyID[p.GetUid()] != 1 {
		t.Fatal("the demand report never reached the controller")
	}
	time.Sleep(500 * time.Millisecond) // two resyncs of the controller: it must keep the proxy
	if r, err := h.store.Get(context.Background(), "solo"); err != nil || r.Deleting() {
		t.Fatalf("a drained proxy with a lease was deleted: %v %v", r, err)
	}
	h.publishDemand("", map[string]int32{})
	h.waitGone("solo")
	if _, live := cloud.live(p.GetUid()); live {
		t.Fatal("the instance was not cleaned up")
	}
}

// A draining proxy of no pool goes at its deadline even with leases.
func TestDrainedProxyGoesAtItsDeadline(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.demand = poolctl.NewBook(time.Minute)
	cloud := newCloud()
	h.startProvisioner("fake", cloud.answer)
	h.startReplica()
	p := h.create(managed("solo"))
	h.waitFor("solo", "running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	h.publishDemand("", map[string]int32{p.GetUid(): 3})
	start := time.Now()
	if _, err := h.client.DrainProxy(context.Background(), &proxyv1.DrainProxyRequest{Name: "solo", DrainTimeout: durationpb.New(time.Second)}); err != nil {
		t.Fatal(err)
	}
	h.waitGone("solo")
	if time.Since(start) < time.Second {
		t.Fatalf("deleted after %s, before its 1s drain timeout", time.Since(start))
	}
}

// Autoscaling on the lease demand published on NATS: refused acquires
// scale up at once within max_replicas; idle demand scales down to
// min_replicas only after the stabilisation window.
func TestPoolAutoscalesOnDemand(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.demand = poolctl.NewBook(time.Minute)
	cloud := newCloud()
	h.startProvisioner("fake", cloud.answer)
	h.startProvisioner("other", cloud.answer)
	h.startReplica()
	h.autoHealth()
	ctx := context.Background()
	spec := poolSpec(1)
	spec.Autoscaling = &proxyv1.Autoscaling{MinReplicas: 1, MaxReplicas: 4, TargetUtilizationPercent: 100,
		ScaleDownStabilization: durationpb.New(2 * time.Second)}
	if _, err := h.pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "auto", Spec: spec}); err != nil {
		t.Fatal(err)
	}
	rows := h.waitPool("auto", "1 Ready", func(live, ready, _ []*store.Row) bool { return len(ready) == 1 })
	busy := rows[0].UID
	report := func(active, capacity, leasable, refused int64, leases map[string]int32) {
		ev := &busv1.PoolDemandEvent{Pool: "auto", LeasesByProxy: leases, Demand: &proxyv1.PoolDemand{
			ActiveLeases: active, Capacity: capacity, LeasableProxies: leasable, RefusedAcquires: refused, ObserveTime: timestamppb.Now()}}
		if _, err := bus.Publish(ctx, h.js, h.names.DemandSubject("auto"), ev); err != nil {
			t.Fatal(err)
		}
	}
	// One proxy of capacity 1, leased, and 9 acquires refused: 10 wanted,
	// capped at 4.
	report(1, 1, 1, 9, map[string]int32{busy: 1})
	refusedAt := time.Now()
	p := waitStatus(t, h, "auto", func(p *proxyv1.ProxyPool) bool { return p.GetStatus().GetDesiredReplicas() == 4 })
	if d := p.GetStatus().GetLastScalingDecision(); d.GetReason() != "RefusedAcquires" || d.GetFromReplicas() != 1 || d.GetDemand().GetRefusedAcquires() != 9 ||
		!strings.Contains(d.GetMessage(), "capped at max_replicas") {
		t.Errorf("scale-up decision %v", d)
	}
	h.waitPool("auto", "4 Ready", func(live, ready, _ []*store.Row) bool { return len(ready) == 4 })
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
	if d := p.GetStatus().GetLastScalingDecision(); d.GetReason() != "DemandDown" {
		t.Errorf("scale-down decision %v", d)
	}
	if at := p.GetStatus().GetLastScalingDecision().GetTime().AsTime(); at.Sub(refusedAt) < 2*time.Second {
		t.Errorf("scaled down %s after the refusals, within the 2s window", at.Sub(refusedAt))
	}
	h.waitPool("auto", "1 live", func(live, _, _ []*store.Row) bool { return len(live) == 1 && live[0].UID == busy })
}
