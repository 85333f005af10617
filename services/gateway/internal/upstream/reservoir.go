package upstream

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
)

// Reservoir keeps, per selector, leases acquired ahead without a target,
// so that a request or tunnel without a session takes one instead of
// calling AcquireLease. Each lease is one capacity unit of the lease
// service and serves one request or tunnel at a time. A lease is used
// only while the fleet view is trusted, it was confirmed (renewed) within
// twice ConfirmInterval, and its proxy cools down neither for the target
// nor globally; otherwise the request acquires for itself, as without the
// reservoir.
type Reservoir struct {
	Leaser *Leaser
	Fleet  *Fleet
	// Headroom is how many leases beyond the recent peak of concurrent
	// use a selector keeps.
	Headroom int
	// IdleTime is how long a lease beyond the target size stays idle
	// before it is released; the peak is taken over two of it.
	IdleTime time.Duration
	// ConfirmInterval is how often each held lease is renewed; a lease
	// not confirmed within twice it is not used.
	ConfirmInterval time.Duration
	// Results counts takes by result (hit, miss, fallback); Size is the
	// leases held in all, idle and in use.
	Results *prometheus.CounterVec
	Size    prometheus.Gauge

	mu        sync.Mutex
	selectors map[string]*selector
	held      map[string]*held // by lease id
	// missed is the proxy uid of each lease acquired on a miss and in
	// use, by lease id: a report on it updates the cooldowns at once too.
	missed map[string]string
	// sessions is each session's lease by its acquire request (no
	// target); sessionOf its key by lease id.
	sessions  map[string]*sessionEntry
	sessionOf map[string]string
	// closed: Run ended; leases given back are released.
	closed bool
}

// selector is one selector's leases and its recent use.
type selector struct {
	req *leasev1.AcquireLeaseRequest // without target or session
	// idle is the queue of leases given back, oldest first: a take scans
	// from the front, so requests rotate over the proxies.
	idle []*held
	// size is the leases held (idle and in use), acquiring those being
	// acquired ahead; active the requests in flight (reservoir leases
	// and leases of misses), peak and lastPeak its highest this window
	// and the last.
	size, acquiring, active int
	peak, lastPeak          int
	// growAfter holds growth back after a failed acquire.
	growAfter time.Time
}

// held is one lease of the reservoir.
type held struct {
	lease     *Lease
	sel       *selector
	confirmed time.Time
	idleSince time.Time
	inUse     bool
	renewing  bool
	// ended: the lease service ended it or refused its renewal; it is
	// never used again.
	ended bool
}

// target is the size the selector grows to: the recent peak of
// concurrent use plus the headroom, or nothing without use.
func (r *Reservoir) target(s *selector) int {
	p := max(s.peak, s.lastPeak)
	if p == 0 {
		return 0
	}
	return p + r.Headroom
}

// count records a take's result.
func (r *Reservoir) count(result string) {
	if r.Results != nil {
		r.Results.WithLabelValues(result).Inc()
	}
}

// usable reports whether h may serve a request to target now.
func (r *Reservoir) usable(h *held, target string, now, trustedSince time.Time) bool {
	if h.ended || h.confirmed.Before(trustedSince) || now.Sub(h.confirmed) > 2*r.ConfirmInterval {
		return false
	}
	return !r.Fleet.Cooldowns.Cooling(h.lease.ProxyUID, target, now)
}

// acquire answers a request without a session: an idle lease of its
// selector that qualifies, or one acquired for it.
func (r *Reservoir) acquire(ctx context.Context, req *leasev1.AcquireLeaseRequest) (*Lease, error) {
	trusted, since := r.Fleet.Trusted()
	if !trusted {
		r.count("fallback")
		return r.Leaser.acquire(ctx, req)
	}
	key := selectorKey(req)
	now := time.Now()
	r.mu.Lock()
	if r.selectors == nil {
		r.selectors = map[string]*selector{}
		r.held = map[string]*held{}
		r.missed = map[string]string{}
	}
	s := r.selectors[key]
	if s == nil {
		s = &selector{req: proto.CloneOf(req)}
		s.req.TargetHost = ""
		r.selectors[key] = s
	}
	s.active++
	s.peak = max(s.peak, s.active)
	for i, h := range s.idle {
		if r.usable(h, req.GetTargetHost(), now, since) {
			s.idle = append(s.idle[:i:i], s.idle[i+1:]...)
			h.inUse = true
			r.mu.Unlock()
			r.count("hit")
			return h.lease, nil
		}
	}
	r.mu.Unlock()
	r.count("miss")
	lease, err := r.Leaser.acquireFreeing(ctx, req)
	if err != nil {
		r.mu.Lock()
		s.active--
		r.mu.Unlock()
		return nil, err
	}
	lease.sel = s
	r.mu.Lock()
	r.missed[lease.ID] = lease.ProxyUID
	r.mu.Unlock()
	return lease, nil
}

// giveBack ends a request's use of lease: a reservoir lease goes to the
// back of its selector's queue (or away, when it ended meanwhile); a
// lease acquired for a miss is released.
func (r *Reservoir) giveBack(lease *Lease) {
	r.mu.Lock()
	if lease.sel != nil {
		lease.sel.active--
		delete(r.missed, lease.ID)
	}
	h := r.held[lease.ID]
	if h == nil || !h.inUse {
		r.mu.Unlock()
		r.Leaser.ReleaseID(lease.ID)
		return
	}
	h.sel.active--
	h.inUse = false
	if h.ended || r.closed {
		r.forget(h)
		r.mu.Unlock()
		if !h.ended {
			r.Leaser.ReleaseID(lease.ID)
		}
		return
	}
	h.idleSince = time.Now()
	h.sel.idle = append(h.sel.idle, h)
	r.mu.Unlock()
}

// freeIdle releases every idle lease the reservoir holds ahead and
// returns once the lease service has them back, reporting whether there
// were any: a request the lease service found every free proxy taken for
// gets the capacity the reservoir was holding (Leaser.acquireFreeing).
// The selectors grow again only after IdleTime, so a run of refusals finds
// little left to free meanwhile.
func (r *Reservoir) freeIdle() bool {
	r.mu.Lock()
	var ids []string
	for _, s := range r.selectors {
		idle := s.idle
		s.idle = nil
		for _, h := range idle {
			if r.held[h.lease.ID] == h {
				ids = append(ids, h.lease.ID)
				r.forget(h)
			}
		}
		s.growAfter = time.Now().Add(r.IdleTime)
	}
	r.mu.Unlock()
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Go(func() { r.Leaser.ReleaseID(id) })
	}
	wg.Wait()
	return len(ids) > 0
}

// forget drops h from the reservoir; r.mu is held.
func (r *Reservoir) forget(h *held) {
	if r.held[h.lease.ID] != h {
		return
	}
	delete(r.held, h.lease.ID)
	h.sel.size--
	for i, x := range h.sel.idle {
		if x == h {
			h.sel.idle = append(h.sel.idle[:i:i], h.sel.idle[i+1:]...)
			break
		}
	}
	if r.Size != nil {
		r.Size.Dec()
	}
}

// Ended drops a lease the lease service ended (released elsewhere or
// expired): it is never used again.
func (r *Reservoir) Ended(leaseID string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sessionEnded(leaseID)
	h := r.held[leaseID]
	if h == nil {
		return
	}
	h.ended = true
	if !h.inUse {
		r.forget(h)
	}
}

// reported records at once the cooldown a report of this gateway started
// on a lease it holds, ahead of the watch.
func (r *Reservoir) reported(leaseID string, cd *leasev1.Cooldown) {
	r.mu.Lock()
	uid, ok := r.missed[leaseID]
	if h := r.held[leaseID]; h != nil {
		uid, ok = h.lease.ProxyUID, true
	}
	if key, isSession := r.sessionOf[leaseID]; isSession && r.sessions[key] != nil {
		uid, ok = r.sessions[key].lease.ProxyUID, true
	}
	r.mu.Unlock()
	if ok && cd.GetExpireTime() != nil {
		r.Fleet.Cooldowns.Set(uid, cd.GetTargetHost(), cd.GetExpireTime().AsTime())
	}
}

// Run confirms the held leases, grows each selector toward its target and
// releases the idle leases beyond it, until ctx ends; then it releases
// every idle lease.
func (r *Reservoir) Run(ctx context.Context) {
	tick := max(r.ConfirmInterval/4, 10*time.Millisecond)
	t := time.NewTicker(tick)
	defer t.Stop()
	window := time.Now()
	for {
		select {
		case <-ctx.Done():
			r.drain()
			return
		case now := <-t.C:
			if now.Sub(window) >= r.IdleTime {
				window = now
				r.mu.Lock()
				for _, s := range r.selectors {
					s.lastPeak, s.peak = s.peak, s.active
				}
				r.mu.Unlock()
			}
			r.step(ctx, now, tick)
		}
	}
}

// step is one round of Run.
func (r *Reservoir) step(ctx context.Context, now time.Time, tick time.Duration) {
	trusted, _ := r.Fleet.Trusted()
	var renew []*held
	var release []string
	type grow struct {
		s *selector
		n int
	}
	var grows []grow
	r.mu.Lock()
	for _, h := range r.held {
		// Renewed a tick early, so that a lease is confirmed about every
		// interval, never later than twice it when the calls answer.
		if !h.renewing && !h.ended && now.Sub(h.confirmed) >= r.ConfirmInterval-tick {
			h.renewing = true
			renew = append(renew, h)
		}
	}
	sessions := r.sessionsToRenew(now, tick)
	for key, s := range r.selectors {
		target := r.target(s)
		// The oldest idle leases go first, once idle long enough.
		for s.size > target && len(s.idle) > 0 && now.Sub(s.idle[0].idleSince) >= r.IdleTime {
			h := s.idle[0]
			release = append(release, h.lease.ID)
			r.forget(h)
		}
		if n := target - s.size - s.acquiring; trusted && !r.closed && n > 0 && now.After(s.growAfter) {
			n = min(n, 8)
			s.acquiring += n
			grows = append(grows, grow{s, n})
		}
		if s.size == 0 && s.acquiring == 0 && s.active == 0 && target == 0 {
			delete(r.selectors, key)
		}
	}
	r.mu.Unlock()
	for _, h := range renew {
		go r.confirm(ctx, h)
	}
	for _, e := range sessions {
		go r.confirmSession(ctx, e)
	}
	for _, id := range release {
		go r.Leaser.ReleaseID(id)
	}
	for _, g := range grows {
		for range g.n {
			go r.grow(ctx, g.s)
		}
	}
}

// confirm renews h: a renewal refused because the lease ended or its
// proxy is no longer leasable (unhealthy, draining, deleted) drops it.
func (r *Reservoir) confirm(ctx context.Context, h *held) {
	sent := time.Now()
	err := r.Leaser.Renew(ctx, h.lease)
	r.mu.Lock()
	defer r.mu.Unlock()
	h.renewing = false
	switch status.Code(err) {
	case codes.OK:
		h.confirmed = sent
		return
	case codes.FailedPrecondition, codes.NotFound:
	default:
		// Unconfirmed: not used past twice the interval; tried again.
		return
	}
	h.ended = true
	if h.inUse {
		return
	}
	r.forget(h)
	if status.Code(err) == codes.FailedPrecondition {
		// Still active on a proxy no longer leasable: its slot is freed.
		go r.Leaser.ReleaseID(h.lease.ID)
	}
}

// grow acquires one lease ahead for s.
func (r *Reservoir) grow(ctx context.Context, s *selector) {
	sent := time.Now()
	lease, err := r.Leaser.acquire(ctx, s.req)
	r.mu.Lock()
	defer r.mu.Unlock()
	s.acquiring--
	if err != nil {
		var np *NoProxyError
		if !errors.As(err, &np) && ctx.Err() == nil {
			r.Leaser.Log.Warn("acquiring a lease ahead failed", "error", err)
		}
		s.growAfter = time.Now().Add(r.IdleTime)
		return
	}
	if r.closed {
		go r.Leaser.ReleaseID(lease.ID)
		return
	}
	h := &held{lease: lease, sel: s, confirmed: sent, idleSince: time.Now()}
	r.held[lease.ID] = h
	s.size++
	s.idle = append(s.idle, h)
	if r.Size != nil {
		r.Size.Inc()
	}
}

// drain releases every idle lease (at shutdown); leases in use are
// released when their requests end, and none is acquired ahead again.
func (r *Reservoir) drain() {
	r.mu.Lock()
	r.closed = true
	var ids []string
	for _, h := range r.held {
		if !h.inUse {
			ids = append(ids, h.lease.ID)
			r.forget(h)
		}
	}
	r.mu.Unlock()
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Go(func() { r.Leaser.ReleaseID(id) })
	}
	wg.Wait()
}

// selectorKey is the selector a request asks for, without its target.
func selectorKey(req *leasev1.AcquireLeaseRequest) string {
	s := req.GetSelector()
	var b strings.Builder
	for _, part := range []string{s.GetPool(), s.GetProvider(), s.GetRegion(), s.GetZone()} {
		b.WriteString(part)
		b.WriteByte(0)
	}
	key, _ := proto.MarshalOptions{Deterministic: true}.Marshal(&leasev1.ProxySelector{Labels: s.GetLabels()})
	b.Write(key)
	return b.String()
}
