package egress

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

// RoundTripper sends every request through a proxy leased for the
// request's target host: the first request to a host acquires a lease
// (waiting with backoff while none is available, until the request's
// context ends), later ones reuse it while it is held. Every answer goes
// through Classifier; on a ban (anything but Success) it reports the
// outcome, releases the lease, and sends the request again through another
// proxy, up to MaxAttempts in all. The service's cooldown keeps the banned
// proxy away from that target (or from every target) for the cooldown.
//
// A request is sent again only when its body can be replayed (no body, or
// GetBody set) and, after a transport error, only when its method is
// idempotent. Close releases every lease. Set the fields before the first
// request.
type RoundTripper struct {
	// Client acquires the leases. Required.
	Client *Client
	// Selector narrows the proxies used.
	Selector Selector
	// TTL of each lease; 0: the service's default. Leases are renewed in
	// the background, so a short TTL only bounds how long a crashed
	// crawler holds its proxies.
	TTL time.Duration
	// Classifier judges answers; nil: DefaultClassifier.
	Classifier Classifier
	// MaxAttempts is how many proxies one request may try; 0: 3.
	MaxAttempts int
	// OnVerdict, when set, is called after every attempt with the lease it
	// went through and how it was classified (for logs and metrics).
	OnVerdict func(req *http.Request, l *Lease, v Verdict)
	// IdleTimeout releases a host's lease once no request of that host
	// has been in flight for this long (counted from the last response's
	// headers), so that a crawler visiting many hosts does not keep a
	// proxy for each. 0: one minute; negative: keep leases until a ban, a
	// loss or Close.
	IdleTimeout time.Duration

	mu     sync.Mutex
	hosts  map[string]*hostSlot
	closed bool
	idle   sync.WaitGroup // idle releases running
}

// hostSlot holds the lease of one target host. acquiring lets one request
// acquire while the others of that host wait (or give up with their
// context).
type hostSlot struct {
	acquiring chan struct{}
	mu        sync.Mutex
	lease     *Lease
	inflight  int
	lastUsed  time.Time
	timer     *time.Timer
}

// ErrRoundTripperClosed is returned by RoundTrip after Close.
var ErrRoundTripperClosed = errors.New("egress: round tripper closed")

// RoundTrip implements http.RoundTripper.
func (rt *RoundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	if rt.Client == nil {
		closeBody(req)
		return nil, errors.New("egress: RoundTripper.Client is nil")
	}
	host := strings.TrimSuffix(strings.ToLower(req.URL.Hostname()), ".")
	if host == "" {
		closeBody(req)
		return nil, errors.New("egress: request URL has no host")
	}
	ctx := req.Context()
	attempts := rt.MaxAttempts
	if attempts <= 0 {
		attempts = 3
	}
	classifier := rt.Classifier
	if classifier == nil {
		classifier = DefaultClassifier
	}
	for attempt := 1; ; attempt++ {
		l, err := rt.lease(ctx, host)
		if err != nil {
			closeBody(req)
			return nil, err
		}
		out := req
		if attempt > 1 {
			if out, err = rewind(req); err != nil {
				return nil, err
			}
		}
		slot := rt.begin(host)
		resp, err := l.Transport().RoundTrip(out)
		rt.end(host, slot)
		var lost *LostError
		if errors.As(err, &lost) || errors.Is(err, ErrReleased) {
			// The lease ended before the request left: not the
			// proxy's fault, take another.
			if attempt < attempts && replayable(req) {
				continue
			}
			return nil, err
		}
		v := classifier.Classify(out, resp, err)
		if rt.OnVerdict != nil {
			rt.OnVerdict(out, l, v)
		}
		if !v.Ban() {
			return resp, err
		}
		// Forget the lease first so that no new request of this host
		// takes it, report before releasing so that no acquire gets the
		// proxy back for this host in between.
		rt.forget(host, l)
		if _, rerr := l.Report(context.WithoutCancel(ctx), v.Outcome, v.options()...); rerr != nil {
			l.c.log.Warn("WARNING: reporting a ban failed; the proxy may be offered for this target again",
				"lease_id", l.ID, "proxy_name", l.ProxyName, "target", host, "outcome", v.Outcome.String(), "error", rerr)
		}
		_ = l.Release()
		retry := attempt < attempts && ctx.Err() == nil && replayable(req) && (err == nil || idempotent(req))
		if !retry {
			return resp, err
		}
		if resp != nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
			resp.Body.Close()
		}
	}
}

// lease returns the host's held lease, acquiring one if needed.
func (rt *RoundTripper) lease(ctx context.Context, host string) (*Lease, error) {
	rt.mu.Lock()
	if rt.closed {
		rt.mu.Unlock()
		return nil, ErrRoundTripperClosed
	}
	if rt.hosts == nil {
		rt.hosts = map[string]*hostSlot{}
	}
	slot := rt.hosts[host]
	if slot == nil {
		slot = &hostSlot{acquiring: make(chan struct{}, 1)}
		rt.hosts[host] = slot
	}
	rt.mu.Unlock()

	if l := slot.held(); l != nil {
		return l, nil
	}
	select {
	case slot.acquiring <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-slot.acquiring }()
	if l := slot.held(); l != nil {
		return l, nil
	}
	l, err := rt.Client.Acquire(ctx, host, rt.Selector, rt.TTL)
	if err != nil {
		return nil, err
	}
	rt.mu.Lock()
	closed := rt.closed
	if !closed {
		slot.mu.Lock()
		slot.lease = l
		slot.mu.Unlock()
	}
	rt.mu.Unlock()
	if closed {
		_ = l.Release()
		return nil, ErrRoundTripperClosed
	}
	return l, nil
}

func (s *hostSlot) held() *Lease {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.lease != nil && s.lease.Err() == nil {
		return s.lease
	}
	return nil
}

func (rt *RoundTripper) idleTimeout() time.Duration {
	if rt.IdleTimeout == 0 {
		return time.Minute
	}
	return rt.IdleTimeout
}

// begin counts a request of host in flight.
func (rt *RoundTripper) begin(host string) *hostSlot {
	rt.mu.Lock()
	slot := rt.hosts[host]
	rt.mu.Unlock()
	slot.mu.Lock()
	slot.inflight++
	slot.mu.Unlock()
	return slot
}

// end counts it done and, when the host has nothing in flight, arms the
// idle release.
func (rt *RoundTripper) end(host string, slot *hostSlot) {
	idle := rt.idleTimeout()
	slot.mu.Lock()
	defer slot.mu.Unlock()
	slot.inflight--
	slot.lastUsed = time.Now()
	if idle < 0 || slot.inflight > 0 {
		return
	}
	if slot.timer != nil {
		slot.timer.Stop()
	}
	slot.timer = time.AfterFunc(idle, func() { rt.releaseIdle(slot, idle) })
}

// releaseIdle releases the slot's lease if it stayed unused for idle.
func (rt *RoundTripper) releaseIdle(slot *hostSlot, idle time.Duration) {
	rt.mu.Lock()
	if rt.closed {
		rt.mu.Unlock()
		return
	}
	rt.idle.Add(1)
	rt.mu.Unlock()
	defer rt.idle.Done()
	slot.mu.Lock()
	l := slot.lease
	if l == nil || slot.inflight > 0 || time.Since(slot.lastUsed) < idle {
		slot.mu.Unlock()
		return
	}
	slot.lease = nil
	slot.mu.Unlock()
	_ = l.Release()
}

// forget drops the host's lease l unless another already replaced it.
func (rt *RoundTripper) forget(host string, l *Lease) {
	rt.mu.Lock()
	slot := rt.hosts[host]
	rt.mu.Unlock()
	if slot != nil {
		slot.mu.Lock()
		if slot.lease == l {
			slot.lease = nil
		}
		slot.mu.Unlock()
	}
}

// Leases returns the leases held now, by target host.
func (rt *RoundTripper) Leases() map[string]*Lease {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	out := map[string]*Lease{}
	for host, slot := range rt.hosts {
		if l := slot.held(); l != nil {
			out[host] = l
		}
	}
	return out
}

// Close releases every lease; later requests fail with
// ErrRoundTripperClosed. The first release error is returned.
func (rt *RoundTripper) Close() error {
	rt.mu.Lock()
	rt.closed = true
	var held []*Lease
	for _, slot := range rt.hosts {
		slot.mu.Lock()
		if slot.timer != nil {
			slot.timer.Stop()
		}
		if slot.lease != nil {
			held = append(held, slot.lease)
			slot.lease = nil
		}
		slot.mu.Unlock()
	}
	rt.mu.Unlock()
	var first error
	for _, l := range held {
		if err := l.Release(); err != nil && first == nil {
			first = err
		}
	}
	rt.idle.Wait()
	return first
}

func replayable(req *http.Request) bool {
	return req.Body == nil || req.Body == http.NoBody || req.GetBody != nil
}

func idempotent(req *http.Request) bool {
	switch req.Method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace, http.MethodPut, http.MethodDelete:
		return true
	}
	return req.Header.Get("Idempotency-Key") != "" || req.Header.Get("X-Idempotency-Key") != ""
}

// rewind is req again with a fresh body.
func rewind(req *http.Request) (*http.Request, error) {
	out := req.Clone(req.Context())
	if req.Body != nil && req.Body != http.NoBody {
		body, err := req.GetBody()
		if err != nil {
			return nil, err
		}
		out.Body = body
	}
	return out, nil
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}
