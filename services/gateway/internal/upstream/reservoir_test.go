package upstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
)

// leaseCalls answers the lease calls the reservoir makes as the lease
// service does: each acquire a new lease on the next proxy in turn;
// renewals of the leases in refuse answered with that code.
type leaseCalls struct {
	leasev1.LeaseServiceClient

	mu       sync.Mutex
	proxies  []string
	n        int
	acquires int
	released map[string]bool
	refuse   map[string]codes.Code // by lease id
	proxyOf  map[string]string
	sessions map[string]*leasev1.Lease
	// oneEach: every proxy takes one lease at a time, as a proxy of
	// max_leases 1; an acquire with none free is refused.
	oneEach bool
	// cooling: every proxy cools down for every target; acquires are
	// refused.
	cooling bool
}

// noProxy is the lease service's refusal, its details saying how the
// proxies were ruled out: the cooling ones, the rest at capacity.
func (c *leaseCalls) noProxy(cooling int) error {
	atCapacity := len(c.proxies) - cooling
	st := status.Newf(codes.ResourceExhausted, "no proxy available: %d matching, 0 unhealthy, %d at capacity, %d cooling down for the target, 0 cooling down globally",
		len(c.proxies), atCapacity, cooling)
	d, err := st.WithDetails(&leasev1.NoProxyAvailable{Matching: int32(len(c.proxies)), AtCapacity: int32(atCapacity), CoolingDownTarget: int32(cooling)})
	if err != nil {
		panic(err)
	}
	return d.Err()
}

// busy reports whether proxy p holds an unreleased lease; c.mu is held.
func (c *leaseCalls) busy(p string) bool {
	for id, q := range c.proxyOf {
		if q == p && !c.released[id] {
			return true
		}
	}
	return false
}

func newLeaseCalls(proxies ...string) *leaseCalls {
	return &leaseCalls{proxies: proxies, released: map[string]bool{}, refuse: map[string]codes.Code{}, proxyOf: map[string]string{}}
}

func (c *leaseCalls) AcquireLease(_ context.Context, req *leasev1.AcquireLeaseRequest, _ ...grpc.CallOption) (*leasev1.AcquireLeaseResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.acquires++
	if l := c.sessions[req.GetSessionKey()]; l != nil {
		if _, refused := c.refuse[l.GetLeaseId()]; !refused {
			return &leasev1.AcquireLeaseResponse{Lease: l, Session: &leasev1.Session{Result: leasev1.SessionResult_SESSION_RESULT_EXISTING}}, nil
		}
	}
	if c.cooling {
		return nil, c.noProxy(len(c.proxies))
	}
	p := c.proxies[c.n%len(c.proxies)]
	if c.oneEach {
		free := ""
		for i := range c.proxies {
			if q := c.proxies[(c.n+i)%len(c.proxies)]; !c.busy(q) {
				free = q
				break
			}
		}
		if free == "" {
			return nil, c.noProxy(0)
		}
		p = free
	}
	c.n++
	id := fmt.Sprintf("lease-%d", c.n)
	c.proxyOf[id] = p
	l := &leasev1.Lease{
		LeaseId: id, ClientId: "gw", ProxyUid: "uid-" + p, ProxyName: p, TargetHost: req.GetTargetHost(),
		Address: &leasev1.ProxyAddress{Host: "127.0.0.1", Port: 3128}, AcquireTime: timestamppb.Now(), SessionKey: req.GetSessionKey(),
	}
	if req.GetSessionKey() != "" {
		if c.sessions == nil {
			c.sessions = map[string]*leasev1.Lease{}
		}
		c.sessions[req.GetSessionKey()] = l
		return &leasev1.AcquireLeaseResponse{Lease: l, Session: &leasev1.Session{Result: leasev1.SessionResult_SESSION_RESULT_NEW}}, nil
	}
	return &leasev1.AcquireLeaseResponse{Lease: l}, nil
}

func (c *leaseCalls) RenewLease(_ context.Context, req *leasev1.RenewLeaseRequest, _ ...grpc.CallOption) (*leasev1.RenewLeaseResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if code, ok := c.refuse[req.GetLeaseId()]; ok {
		return nil, status.Error(code, "refused")
	}
	return &leasev1.RenewLeaseResponse{}, nil
}

func (c *leaseCalls) ReleaseLease(_ context.Context, req *leasev1.ReleaseLeaseRequest, _ ...grpc.CallOption) (*leasev1.ReleaseLeaseResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.released[req.GetLeaseId()] = true
	return &leasev1.ReleaseLeaseResponse{Released: true}, nil
}

func (c *leaseCalls) acquired() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.acquires
}

func (c *leaseCalls) wasReleased(id string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.released[id]
}

// testReservoir is a reservoir over calls with a trusted fleet view, not
// yet running.
func testReservoir(calls *leaseCalls) *Reservoir {
	l := &Leaser{Client: calls, TTL: time.Minute, SessionLifetime: time.Minute, CallTimeout: time.Second, Log: slog.New(slog.DiscardHandler)}
	f := NewFleet(calls, time.Second, l.Log)
	f.reportsUp.Store(true)
	f.endsUp.Store(true)
	f.trustedSince.Store(time.Now().Add(-time.Hour).UnixNano())
	r := &Reservoir{Leaser: l, Fleet: f, Headroom: 1, IdleTime: 200 * time.Millisecond, ConfirmInterval: 100 * time.Millisecond,
		Results: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "results"}, []string{"result"})}
	l.Reservoir = r
	return r
}

func (r *Reservoir) results(t *testing.T, result string) float64 {
	t.Helper()
	var m dto.Metric
	if err := r.Results.WithLabelValues(result).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func (r *Reservoir) idleCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, s := range r.selectors {
		n += len(s.idle)
	}
	return n
}

func (r *Reservoir) heldCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.held)
}

func want(target string) Want { return Want{ClientID: "crawler", Target: target} }

// A miss acquires for the request and grows the reservoir; then requests
// take its leases without a call, one request per lease at a time, in
// rotation; a cooldown for one target keeps a proxy away from that target
// only, a global one from every target.
func TestReservoirExclusiveRotationAndCooldowns(t *testing.T) {
	t.Parallel()
	calls := newLeaseCalls("p1", "p2", "p3")
	r := testReservoir(calls)
	ctx := running(t, r)

	// Two at once: both miss, and the reservoir grows to the peak (2) and
	// the headroom (1).
	a, err := r.Leaser.Acquire(ctx, want("shop.example"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.Leaser.Acquire(ctx, want("shop.example"))
	if err != nil {
		t.Fatal(err)
	}
	if r.results(t, "miss") != 2 {
		t.Fatalf("misses %v, want 2", r.results(t, "miss"))
	}
	r.Leaser.Release(a)
	r.Leaser.Release(b)
	if !calls.wasReleased(a.ID) || !calls.wasReleased(b.ID) {
		t.Error("the leases of misses were not released")
	}
	waitFor(t, "the reservoir to grow to 3", func() bool { return r.idleCount() == 3 })

	before := calls.acquired()
	var taken []*Lease
	seen := map[string]bool{}
	for range 3 {
		l, err := r.Leaser.Acquire(ctx, want("shop.example"))
		if err != nil {
			t.Fatal(err)
		}
		if seen[l.ID] {
			t.Fatalf("lease %s handed to two requests at once", l.ID)
		}
		seen[l.ID] = true
		taken = append(taken, l)
	}
	if calls.acquired() != before || r.results(t, "hit") != 3 {
		t.Fatalf("three takes of three idle leases made %d acquires, %v hits", calls.acquired()-before, r.results(t, "hit"))
	}
	for _, l := range taken {
		r.Leaser.Release(l)
	}
	// Rotation: the next take is the lease given back first.
	next, _ := r.Leaser.Acquire(ctx, want("shop.example"))
	if next.ID != taken[0].ID {
		t.Errorf("took %s, want the oldest given back %s", next.ID, taken[0].ID)
	}
	r.Leaser.Release(next)

	// A cooldown of p1 for shop.example: p1 serves other targets still.
	p1 := taken[0].ProxyUID
	r.Fleet.Cooldowns.Set(p1, "SHOP.example.", time.Now().Add(time.Minute))
	for range 6 {
		l, err := r.Leaser.Acquire(ctx, want("shop.example"))
		if err != nil {
			t.Fatal(err)
		}
		if l.ProxyUID == p1 {
			t.Fatalf("a request to shop.example got %s, cooling down for it", p1)
		}
		r.Leaser.Release(l)
	}
	gotP1 := false
	for range 4 {
		l, _ := r.Leaser.Acquire(ctx, want("other.example"))
		gotP1 = gotP1 || l.ProxyUID == p1
		r.Leaser.Release(l)
	}
	if !gotP1 {
		t.Error("a cooldown for shop.example kept p1 from other.example")
	}
	// Global: p1 serves no target.
	r.Fleet.Cooldowns.Set(p1, "", time.Now().Add(time.Minute))
	for range 4 {
		l, _ := r.Leaser.Acquire(ctx, want("other.example"))
		if l.ProxyUID == p1 {
			t.Fatal("a request got p1, cooling down globally")
		}
		r.Leaser.Release(l)
	}
}

// A lease whose renewal is refused (its proxy unleasable, or the lease
// gone) is dropped and never used again; one the watch says ended too.
func TestReservoirDropsUnconfirmedAndEndedLeases(t *testing.T) {
	t.Parallel()
	calls := newLeaseCalls("p1", "p2", "p3")
	r := testReservoir(calls)
	ctx := running(t, r)

	l, _ := r.Leaser.Acquire(ctx, want("shop.example"))
	r.Leaser.Release(l)
	waitFor(t, "the reservoir to grow", func() bool { return r.idleCount() == 2 })
	r.mu.Lock()
	var ids []string
	for id := range r.held {
		ids = append(ids, id)
	}
	r.mu.Unlock()
	calls.mu.Lock()
	calls.refuse[ids[0]] = codes.FailedPrecondition
	calls.mu.Unlock()
	waitFor(t, "the refused lease to be dropped and released", func() bool {
		r.mu.Lock()
		_, ok := r.held[ids[0]]
		r.mu.Unlock()
		return !ok && calls.wasReleased(ids[0])
	})
	r.Ended(ids[1])
	r.mu.Lock()
	_, kept := r.held[ids[1]]
	r.mu.Unlock()
	if kept {
		t.Error("a lease the watch said ended is still held")
	}
	for range 4 {
		got, err := r.Leaser.Acquire(ctx, want("shop.example"))
		if err != nil {
			t.Fatal(err)
		}
		if got.ID == ids[0] || got.ID == ids[1] {
			t.Fatalf("a dropped lease %s was used", got.ID)
		}
		r.Leaser.Release(got)
	}
}

// Idle leases beyond the recent peak are released after the idle time;
// with no use, the reservoir holds nothing.
func TestReservoirShrinksWhenIdle(t *testing.T) {
	t.Parallel()
	calls := newLeaseCalls("p1", "p2")
	r := testReservoir(calls)
	ctx := running(t, r)

	l, _ := r.Leaser.Acquire(ctx, want("shop.example"))
	r.Leaser.Release(l)
	waitFor(t, "the reservoir to grow", func() bool { return r.heldCount() == 2 })
	waitFor(t, "the idle reservoir to empty and its leases to be released", func() bool {
		calls.mu.Lock()
		defer calls.mu.Unlock()
		return r.heldCount() == 0 && len(calls.released) == len(calls.proxyOf)
	})
}

// While the fleet view is not trusted (a watch down), no reservoir lease
// is used: every request acquires for itself.
func TestReservoirFallsBackWhileTheWatchIsDown(t *testing.T) {
	t.Parallel()
	calls := newLeaseCalls("p1")
	r := testReservoir(calls)
	ctx := context.Background()
	l, _ := r.Leaser.Acquire(ctx, want("shop.example"))
	r.Leaser.Release(l)
	r.step(ctx, time.Now(), 25*time.Millisecond)
	waitFor(t, "the reservoir to grow", func() bool { return r.idleCount() > 0 })
	r.Fleet.endsUp.Store(false)
	before := calls.acquired()
	got, err := r.Leaser.Acquire(ctx, want("shop.example"))
	if err != nil {
		t.Fatal(err)
	}
	if calls.acquired() != before+1 || r.results(t, "fallback") != 1 || r.results(t, "hit") != 0 {
		t.Errorf("with the watch down: %d acquires, fallback %v, hit %v", calls.acquired()-before, r.results(t, "fallback"), r.results(t, "hit"))
	}
	r.Leaser.Release(got)
	// Back up, but leases confirmed before are not used until renewed.
	r.Fleet.endsUp.Store(true)
	r.Fleet.trustedSince.Store(time.Now().UnixNano())
	if got, _ := r.Leaser.Acquire(ctx, want("shop.example")); r.results(t, "hit") != 0 {
		t.Errorf("a lease confirmed before the watch came back was used: %v", got)
	}
	r.drain()
}

// A session's request is answered from its cached lease without a call
// while it is confirmed; a cooldown of its proxy for the target, a
// refused renewal or the watch saying the lease ended sends the next
// request to the lease service.
func TestSessionCache(t *testing.T) {
	t.Parallel()
	calls := newLeaseCalls("p1", "p2")
	r := testReservoir(calls)
	ctx := running(t, r)
	sess := func(target string) *Lease {
		t.Helper()
		w := want(target)
		w.Options.Session = "s1"
		l, err := r.Leaser.Acquire(ctx, w)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	first := sess("shop.example")
	before := calls.acquired()
	for range 5 {
		if l := sess("shop.example"); l.ID != first.ID || l.Moved() {
			t.Fatalf("session request got %+v, want the session's lease %s", l, first.ID)
		}
	}
	if calls.acquired() != before {
		t.Fatalf("cached session requests made %d acquires", calls.acquired()-before)
	}
	// Used, so renewed in the background and still answered after twice
	// the confirm interval.
	entry := func() *sessionEntry {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.sessions[r.sessionOf[first.ID]]
	}
	acquired := entry().confirmed
	waitFor(t, "the used session to be renewed", func() bool {
		sess("shop.example")
		r.mu.Lock()
		defer r.mu.Unlock()
		e := r.sessions[r.sessionOf[first.ID]]
		return e != nil && e.confirmed.After(acquired)
	})
	if calls.acquired() != before {
		t.Fatalf("a cached session renewed in the background made %d acquires", calls.acquired()-before)
	}
	// A cooldown of its proxy for another target: that target's request
	// goes to the lease service; this one's does not.
	r.Fleet.Cooldowns.Set(first.ProxyUID, "other.example", time.Now().Add(time.Minute))
	before = calls.acquired()
	sess("other.example")
	if calls.acquired() != before+1 {
		t.Errorf("a request to a target its proxy cools down for made %d acquires, want 1", calls.acquired()-before)
	}
	// The watch says the lease ended: the next request acquires.
	r.Ended(first.ID)
	before = calls.acquired()
	sess("shop.example")
	if calls.acquired() != before+1 {
		t.Errorf("after the lease ended, %d acquires, want 1", calls.acquired()-before)
	}
}

// At shutdown the idle leases are released at once, and a lease in use is
// released when its request gives it back.
func TestReservoirReleasesEverythingAtShutdown(t *testing.T) {
	t.Parallel()
	calls := newLeaseCalls("p1", "p2")
	r := testReservoir(calls)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx) }()
	l, _ := r.Leaser.Acquire(ctx, want("shop.example"))
	r.Leaser.Release(l)
	waitFor(t, "the reservoir to grow", func() bool { return r.idleCount() == 2 })
	inUse, err := r.Leaser.Acquire(ctx, want("shop.example"))
	if err != nil || r.results(t, "hit") != 1 {
		t.Fatalf("take: %v, hits %v", err, r.results(t, "hit"))
	}
	cancel()
	<-done
	if r.heldCount() != 1 || calls.wasReleased(inUse.ID) {
		t.Fatalf("after shutdown: %d held, in-use lease released %v; want the idle one released only", r.heldCount(), calls.wasReleased(inUse.ID))
	}
	r.Leaser.Release(inUse)
	if r.heldCount() != 0 || !calls.wasReleased(inUse.ID) {
		t.Fatalf("the lease given back after shutdown: %d held, released %v", r.heldCount(), calls.wasReleased(inUse.ID))
	}
}

// running runs r until the test ends and returns the context it runs with.
func running(t *testing.T, r *Reservoir) context.Context {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return ctx
}

// holdingBoth is a running reservoir over the proxies p1 and p2 that holds
// a lease of each idle, after one rotated request.
func holdingBoth(t *testing.T, calls *leaseCalls) (*Reservoir, context.Context) {
	t.Helper()
	r := testReservoir(calls)
	ctx := running(t, r)
	l, err := r.Leaser.Acquire(ctx, want("shop.example"))
	if err != nil {
		t.Fatal(err)
	}
	r.Leaser.Release(l)
	waitFor(t, "the reservoir to hold both proxies", func() bool { return r.idleCount() == 2 })
	return r, ctx
}

// On a small fleet the reservoir can hold every proxy ahead. A request
// the lease service then finds no free proxy for, a session or one whose
// selector has no idle lease (here another pool's), gets one: the
// replica's idle reservoir leases are released and the acquire asked
// again.
func TestRequestsGetTheCapacityTheReservoirHeld(t *testing.T) {
	t.Parallel()
	session := want("shop.example")
	session.Options.Session = "s1"
	otherPool := want("shop.example")
	otherPool.Options.Pool = "residential"
	for _, tc := range []struct {
		name string
		want Want
		ok   func(*Lease) bool // the lease is the kind this request gets
	}{
		{"a session", session, (*Lease).Session},
		{"a reservoir miss", otherPool, func(l *Lease) bool { return l.sel != nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			calls := newLeaseCalls("p1", "p2")
			calls.oneEach = true
			r, ctx := holdingBoth(t, calls)
			got, err := r.Leaser.Acquire(ctx, tc.want)
			if err != nil {
				t.Fatalf("%s while the reservoir holds every proxy: %v; want a lease", tc.name, err)
			}
			if !tc.ok(got) {
				t.Errorf("got %+v, not the lease of %s", got, tc.name)
			}
		})
	}
}

// A refusal for cooldowns (or health) alone frees nothing: the
// reservoir's capacity would not help.
func TestRefusalForCooldownsKeepsTheReservoir(t *testing.T) {
	t.Parallel()
	calls := newLeaseCalls("p1", "p2")
	r, ctx := holdingBoth(t, calls)
	calls.mu.Lock()
	calls.cooling = true
	calls.mu.Unlock()
	other := want("shop.example")
	other.Options.Pool = "residential"
	_, err := r.Leaser.Acquire(ctx, other)
	var np *NoProxyError
	if !errors.As(err, &np) || np.AtCapacity != 0 {
		t.Fatalf("acquire with every proxy cooling down: %v; want a NoProxyError with none at capacity", err)
	}
	if n := r.idleCount(); n != 2 {
		t.Errorf("the reservoir holds %d idle leases after a refusal for cooldowns; want 2 (nothing freed)", n)
	}
}
