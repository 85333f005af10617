package fleet_test

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/fleet"
	"github.com/egress-proxies/egress-proxies/services/health/internal/membership"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

type fakeEngine struct {
	mu    sync.Mutex
	specs map[string]engine.Spec
	ops   []string
}

func (f *fakeEngine) Adopt(s engine.Spec, v *engine.Verdict) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.specs == nil {
		f.specs = map[string]engine.Spec{}
	}
	f.specs[s.UID] = s
	op := "adopt " + s.UID
	if v != nil {
		op += fmt.Sprintf(" healthy=%v", v.Healthy)
	}
	f.ops = append(f.ops, op)
}

func (f *fakeEngine) opsLog() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.ops)
}

func (f *fakeEngine) Remove(uid string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.specs, uid)
	f.ops = append(f.ops, "remove "+uid)
}

func (f *fakeEngine) has(uid string) (engine.Spec, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.specs[uid]
	return s, ok
}

func (f *fakeEngine) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.specs)
}

func proxy(uid string, phase proxyv1.ProxyPhase, ip string) *proxyv1.Proxy {
	return &proxyv1.Proxy{Uid: uid, Name: "p-" + uid,
		Spec:   &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve"},
		Status: &proxyv1.ProxyStatus{Phase: phase, Ip: ip, Port: 3128, ProviderId: "vm-" + uid}}
}

func event(rev int64, typ proxyv1.ChangeType, p *proxyv1.Proxy) *busv1.ProxyEvent {
	return &busv1.ProxyEvent{Revision: rev, Type: typ, Proxy: p}
}

const (
	created = proxyv1.ChangeType_CHANGE_TYPE_CREATED
	updated = proxyv1.ChangeType_CHANGE_TYPE_UPDATED
	deleted = proxyv1.ChangeType_CHANGE_TYPE_DELETED
	running = proxyv1.ProxyPhase_PROXY_PHASE_RUNNING
	ready   = proxyv1.ProxyPhase_PROXY_PHASE_READY
	pending = proxyv1.ProxyPhase_PROXY_PHASE_PENDING
)

func TestFleet_Apply(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		events   []*busv1.ProxyEvent
		wantAddr string  // "" means not probed
		wantRev  int64   // the revision the engine's spec carries
		wantGone []int64 // the revisions of Gone's calls
	}{
		{name: "pending is not probed", events: []*busv1.ProxyEvent{event(1, created, proxy("u", pending, ""))}, wantGone: []int64{1}},
		{name: "pending stays pending", events: []*busv1.ProxyEvent{event(1, created, proxy("u", pending, "")), event(2, updated, proxy("u", pending, ""))}, wantGone: []int64{1}},
		{name: "running is probed", events: []*busv1.ProxyEvent{event(1, created, proxy("u", pending, "")), event(2, updated, proxy("u", running, "10.0.0.1"))},
			wantAddr: "10.0.0.1:3128", wantRev: 2, wantGone: []int64{1}}, // the pending state was first seen
		{name: "an older revision is ignored", events: []*busv1.ProxyEvent{event(5, updated, proxy("u", running, "10.0.0.2")), event(4, updated, proxy("u", running, "10.0.0.1"))},
			wantAddr: "10.0.0.2:3128", wantRev: 5},
		{name: "a replayed revision is ignored", events: []*busv1.ProxyEvent{event(5, updated, proxy("u", ready, "10.0.0.2")), event(5, deleted, proxy("u", ready, "10.0.0.2"))},
			wantAddr: "10.0.0.2:3128", wantRev: 5},
		{name: "ready keeps the instance, takes the revision", events: []*busv1.ProxyEvent{event(3, updated, proxy("u", running, "10.0.0.2")), event(4, updated, proxy("u", ready, "10.0.0.2"))},
			wantAddr: "10.0.0.2:3128", wantRev: 4},
		{name: "deleted is pruned", events: []*busv1.ProxyEvent{event(1, updated, proxy("u", ready, "10.0.0.1")), event(2, deleted, proxy("u", ready, "10.0.0.1"))},
			wantGone: []int64{2}},
		{name: "first seen deleted: stored health goes too", events: []*busv1.ProxyEvent{event(2, deleted, proxy("u", ready, "10.0.0.1")), event(1, updated, proxy("u", ready, "10.0.0.1"))},
			wantGone: []int64{2}},
		{name: "back to provisioning is pruned", events: []*busv1.ProxyEvent{event(1, updated, proxy("u", ready, "10.0.0.1")), event(2, updated, proxy("u", proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, ""))},
			wantGone: []int64{2}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			eng := &fakeEngine{}
			var gone []int64
			f := &fleet.Fleet{Engine: eng, Defaults: engine.DefaultDefaults, Gone: func(uid string, rev int64) {
				if uid != "u" {
					t.Errorf("Gone(%q)", uid)
				}
				gone = append(gone, rev)
			}}
			for _, ev := range tc.events {
				f.Apply(ev)
			}
			s, ok := eng.has("u")
			if (tc.wantAddr != "") != ok || (ok && (s.Address != tc.wantAddr || s.Revision != tc.wantRev)) {
				t.Errorf("engine holds %+v (%v), want address %q at revision %d", s, ok, tc.wantAddr, tc.wantRev)
			}
			if !slices.Equal(gone, tc.wantGone) {
				t.Errorf("Gone at revisions %v, want %v", gone, tc.wantGone)
			}
		})
	}
}

func TestFleet_ownershipAndRebalance(t *testing.T) {
	t.Parallel()
	eng := &fakeEngine{}
	f := &fleet.Fleet{Engine: eng, Defaults: engine.DefaultDefaults, Self: "r1"}
	var uids []string
	for i := range 300 {
		uids = append(uids, fmt.Sprintf("uid-%03d", i))
		f.Apply(event(int64(i+1), created, proxy(uids[i], ready, "10.0.0.1")))
	}
	if eng.count() != 0 {
		t.Fatalf("engine holds %d proxies before any replica set, want none", eng.count())
	}
	// Joins and leaves in turn: after each, this replica holds exactly the
	// proxies rendezvous hashing over the whole set gives it, and a proxy
	// that moves goes to or comes from the member that joined or left.
	steps := [][]string{{"r1"}, {"r1", "r2"}, {"r1", "r2", "r3", "r4"}, {"r1", "r3", "r4"}, {"r1", "r4", "r5"}, {"r1"}}
	for _, members := range steps {
		f.Rebalance(members)
		want := 0
		for _, uid := range uids {
			mine := membership.Owner(members, uid) == "r1"
			if mine {
				want++
			}
			if _, held := eng.has(uid); held != mine {
				t.Fatalf("members %v: engine holds %s = %v, want %v", members, uid, held, mine)
			}
		}
		if f.Owned() != want || eng.count() != want {
			t.Fatalf("members %v: owned %d, engine %d, want %d", members, f.Owned(), eng.count(), want)
		}
	}
}

// credsAt is a credentials time at PostgreSQL's precision.
var credsAt = time.Date(2026, 12, 5, 12, 0, 0, 123456000, time.UTC)

func TestFleet_priorVerdicts(t *testing.T) {
	t.Parallel()
	eng := &fakeEngine{}
	var asked [][]string
	f := &fleet.Fleet{Engine: eng, Defaults: engine.DefaultDefaults,
		Prior: func(uids []string) map[string]fleet.Prior {
			asked = append(asked, slices.Sorted(slices.Values(uids)))
			return map[string]fleet.Prior{
				"a": {ProviderID: "vm-a", Verdict: engine.Verdict{Healthy: true}},
				"b": {ProviderID: "vm-old", Verdict: engine.Verdict{Healthy: true}}, // another instance
				// The same provider ID with other credentials: an instance
				// replaced under the same ID.
				"d": {ProviderID: "vm-d", CredentialsTime: credsAt.Add(-time.Hour), Verdict: engine.Verdict{Healthy: true}},
				"e": {ProviderID: "vm-e", CredentialsTime: credsAt, Verdict: engine.Verdict{Healthy: true}},
			}
		}}
	withCreds := func(p *proxyv1.Proxy) *proxyv1.Proxy {
		// Nanoseconds in the event: compared at the store's microseconds.
		p.Status.CredentialsTime = timestamppb.New(credsAt.Add(789 * time.Nanosecond))
		return p
	}
	f.Apply(event(1, created, proxy("a", ready, "10.0.0.1")))
	f.Apply(event(2, created, proxy("b", ready, "10.0.0.2")))
	f.Apply(event(3, created, proxy("c", running, "10.0.0.3")))
	f.Apply(event(4, updated, proxy("a", ready, "10.0.0.1"))) // already held: no prior asked
	f.Apply(event(5, updated, withCreds(proxy("d", running, "10.0.0.4"))))
	f.Apply(event(6, updated, withCreds(proxy("e", running, "10.0.0.5"))))
	want := []string{"adopt a healthy=true", "adopt b", "adopt c", "adopt a", "adopt d", "adopt e healthy=true"}
	if got := eng.opsLog(); !slices.Equal(got, want) {
		t.Errorf("engine calls = %v, want %v", got, want)
	}
	if len(asked) != 5 {
		t.Errorf("prior asked %d times (%v), want once per proxy taken", len(asked), asked)
	}
}

// TestFleet_Follow reads real events from JetStream: the latest state of
// every proxy first (DeliverLastPerSubject), then new ones.
func TestFleet_Follow(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js := natstest.New(t).JetStream(t)
	names := bus.Names{Prefix: "t"}
	if err := bus.EnsureStreams(ctx, js, names); err != nil {
		t.Fatal(err)
	}
	publish := func(ev *busv1.ProxyEvent) {
		t.Helper()
		if _, err := bus.Publish(ctx, js, names.ProxyEventSubject(ev.GetProxy().GetUid()), ev); err != nil {
			t.Fatal(err)
		}
	}
	// History before the fleet starts: only each proxy's latest counts.
	publish(event(1, created, proxy("a", pending, "")))
	publish(event(2, updated, proxy("a", running, "10.0.0.1")))
	publish(event(3, created, proxy("b", ready, "10.0.0.2")))
	publish(event(4, deleted, proxy("b", ready, "10.0.0.2")))
	publish(event(5, created, proxy("c", ready, "10.0.0.3")))
	// Garbage is skipped.
	if _, err := js.Publish(ctx, names.ProxyEventSubject("junk"), []byte{0xff, 0x01}); err != nil {
		t.Fatal(err)
	}

	eng := &fakeEngine{}
	f := &fleet.Fleet{Engine: eng, Defaults: engine.DefaultDefaults, Log: slog.New(slog.DiscardHandler)}
	fctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- f.Follow(fctx, js, names) }()

	waittest.For(t, 10*time.Second, "a and c from history", func() bool { _, a := eng.has("a"); _, c := eng.has("c"); return a && c })
	if _, ok := eng.has("b"); ok {
		t.Error("b was deleted before start but is probed")
	}
	publish(event(6, deleted, proxy("a", running, "10.0.0.1")))
	publish(event(7, created, proxy("d", running, "10.0.0.4")))
	waittest.For(t, 10*time.Second, "a pruned and d added", func() bool { _, a := eng.has("a"); _, d := eng.has("d"); return !a && d })

	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// lister is an orchestrator listing in memory; during is called inside
// the call, as if an event arrived while the listing was taken.
type lister struct {
	revision int64
	proxies  []*proxyv1.Proxy
	during   func()
}

func (l *lister) ListProxies(context.Context, *proxyv1.ListProxiesRequest, ...grpc.CallOption) (*proxyv1.ListProxiesResponse, error) {
	if l.during != nil {
		l.during()
	}
	return &proxyv1.ListProxiesResponse{Proxies: l.proxies, Revision: l.revision}, nil
}

// A resync after the orchestrator's database was reset (its revisions far
// below the events') adopts what it lists and stops probing what it does
// not, but keeps a proxy whose event arrived while it listed.
func TestFleet_Resync(t *testing.T) {
	t.Parallel()
	eng := &fakeEngine{}
	var gone []string
	f := &fleet.Fleet{Engine: eng, Defaults: engine.DefaultDefaults, Log: slog.New(slog.DiscardHandler), Gone: func(uid string, rev int64) {
		if rev != math.MaxInt64 {
			t.Errorf("Gone(%s) through revision %d, want every revision: the listing lacks it", uid, rev)
		}
		gone = append(gone, uid)
	}}
	f.Apply(event(50, created, proxy("old-a", running, "10.0.0.1")))
	f.Apply(event(60, created, proxy("old-b", ready, "10.0.0.2")))
	l := &lister{revision: 3, proxies: []*proxyv1.Proxy{proxy("new-c", running, "10.0.0.3")},
		during: func() { f.Apply(event(4, created, proxy("new-d", running, "10.0.0.4"))) }}
	listed, changed, purged, err := f.Resync(context.Background(), l)
	if err != nil {
		t.Fatal(err)
	}
	if listed != 1 || changed != 1 || purged != 2 {
		t.Errorf("listed %d, changed %d, purged %d; want 1, 1, 2", listed, changed, purged)
	}
	for uid, want := range map[string]bool{"old-a": false, "old-b": false, "new-c": true, "new-d": true} {
		if _, ok := eng.has(uid); ok != want {
			t.Errorf("%s probed = %v, want %v", uid, ok, want)
		}
	}
	slices.Sort(gone)
	if !slices.Equal(gone, []string{"old-a", "old-b"}) {
		t.Errorf("Gone calls %v, want old-a and old-b", gone)
	}
	// A replay of a purged proxy's last event changes nothing.
	if f.Apply(event(60, created, proxy("old-b", ready, "10.0.0.2"))) {
		t.Error("a replayed event brought a purged proxy back")
	}
}

// A resync adopts the proxies of a page together: their earlier verdicts
// are read in one call, not one a proxy (a first resync of 100,000
// proxies made 100,000 reads).
func TestFleet_ResyncReadsPriorVerdictsOncePerPage(t *testing.T) {
	t.Parallel()
	eng := &fakeEngine{}
	var asked [][]string
	f := &fleet.Fleet{Engine: eng, Defaults: engine.DefaultDefaults, Log: slog.New(slog.DiscardHandler),
		Prior: func(uids []string) map[string]fleet.Prior {
			asked = append(asked, slices.Sorted(slices.Values(uids)))
			return map[string]fleet.Prior{"b": {ProviderID: "vm-b", Verdict: engine.Verdict{Healthy: true}}}
		}}
	l := &lister{revision: 3, proxies: []*proxyv1.Proxy{
		proxy("a", running, "10.0.0.1"), proxy("b", ready, "10.0.0.2"), proxy("c", running, "10.0.0.3")}}
	if _, changed, _, err := f.Resync(context.Background(), l); err != nil || changed != 3 {
		t.Fatalf("resync: %d changed, %v; want 3", changed, err)
	}
	if want := [][]string{{"a", "b", "c"}}; !slices.EqualFunc(asked, want, slices.Equal) {
		t.Errorf("prior verdicts asked for %v, want %v", asked, want)
	}
	if got, want := slices.Sorted(slices.Values(eng.opsLog())), []string{"adopt a", "adopt b healthy=true", "adopt c"}; !slices.Equal(got, want) {
		t.Errorf("engine calls = %v, want %v", got, want)
	}
}

// TestFleet_followBatches: the events the consumer holds are applied
// together, so the earlier verdicts of the proxies they bring are read a
// batch at a time, not a proxy at a time; a proxy's events within a batch
// still apply in order.
func TestFleet_followBatches(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js := natstest.New(t).JetStream(t)
	names := bus.Names{Prefix: "batch"}
	if err := bus.EnsureStreams(ctx, js, names); err != nil {
		t.Fatal(err)
	}
	const n = 300
	for i := range n {
		uid := fmt.Sprint("h", i)
		if _, err := bus.Publish(ctx, js, names.ProxyEventSubject(uid), event(int64(i+1), created, proxy(uid, running, "10.0.0.1"))); err != nil {
			t.Fatal(err)
		}
	}
	eng := &fakeEngine{}
	var mu sync.Mutex
	var calls int
	var gone []string
	f := &fleet.Fleet{Engine: eng, Defaults: engine.DefaultDefaults, Log: slog.New(slog.DiscardHandler),
		Prior: func(uids []string) map[string]fleet.Prior {
			mu.Lock()
			defer mu.Unlock()
			calls++
			return nil
		},
		Gone: func(uid string, rev int64) {
			mu.Lock()
			defer mu.Unlock()
			gone = append(gone, fmt.Sprint(uid, "@", rev))
		}}
	fctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- f.Follow(fctx, js, names) }()
	waittest.For(t, 10*time.Second, "every proxy adopted", func() bool { return eng.count() == n })
	mu.Lock()
	if calls > n/10 {
		t.Errorf("earlier verdicts read in %d calls for %d proxies, want a call a batch", calls, n)
	}
	mu.Unlock()

	// A burst with a proxy's several events: applied in order.
	var futures []jetstream.PubAckFuture
	for i, ev := range []*busv1.ProxyEvent{
		event(1001, created, proxy("x", running, "10.0.0.9")),
		event(1002, deleted, proxy("x", running, "10.0.0.9")),
		event(1003, deleted, proxy("h0", running, "10.0.0.1")),
		event(1004, created, proxy("y", running, "10.0.0.8")),
	} {
		m, err := bus.Message(ctx, names.ProxyEventSubject(ev.GetProxy().GetUid()), ev)
		if err != nil {
			t.Fatal(err)
		}
		f, err := js.PublishMsgAsync(m)
		if err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		futures = append(futures, f)
	}
	if err := bus.WaitAcks(ctx, futures); err != nil {
		t.Fatal(err)
	}
	waittest.For(t, 10*time.Second, "the burst applied", func() bool {
		_, y := eng.has("y")
		_, h0 := eng.has("h0")
		return y && !h0
	})
	if _, ok := eng.has("x"); ok {
		t.Error("x is probed after its deletion")
	}
	mu.Lock()
	if !slices.Contains(gone, "x@1002") || !slices.Contains(gone, "h0@1003") {
		t.Errorf("Gone calls %v, want x@1002 and h0@1003", gone)
	}
	mu.Unlock()
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
