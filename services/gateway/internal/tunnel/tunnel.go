// Package tunnel is what CONNECT and SOCKS5 share: lease a proxy for the
// target, open a tunnel through it (moving to another proxy when one
// cannot be reached or refuses), relay bytes both ways under the idle and
// lifetime limits while renewing the lease, and give the lease back when
// the tunnel ends.
package tunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/access"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/metrics"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/session"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/upstream"
)

// Core holds what every request and tunnel uses.
type Core struct {
	Leaser   *upstream.Leaser
	Dialer   *upstream.Dialer
	Sessions *session.Registry
	Metrics  *metrics.Metrics
	Limits   *access.Limits
	// Retries is how many more proxies a request or tunnel may try when
	// its proxy cannot be reached or refuses.
	Retries int
	// IdleTimeout ends a tunnel with no byte either way for that long;
	// MaxLifetime ends any tunnel that old.
	IdleTimeout time.Duration
	MaxLifetime time.Duration
	Log         *slog.Logger
}

// Failure is a refusal for the client: an HTTP status and a message, the
// outcome it counts as, and the SOCKS5 reply code that says the same.
type Failure struct {
	Status  int
	Message string
	Outcome string
	Socks   byte
}

func (f *Failure) Error() string { return f.Message }

// SOCKS5 reply codes (RFC 1928).
const (
	SocksOK             byte = 0x00
	SocksFailure        byte = 0x01
	SocksNotAllowed     byte = 0x02
	SocksHostUnreach    byte = 0x04
	SocksRefused        byte = 0x05
	SocksCmdUnsupported byte = 0x07
	SocksAddrUnsupport  byte = 0x08
)

// Acquire leases a proxy for caller's request to target (a host), as a
// Failure when none can be had. A session's move is counted once, by the
// request whose acquire made it (requests that shared it are Joined).
func (c *Core) Acquire(ctx context.Context, caller access.Caller, target string) (*upstream.Lease, *Failure) {
	lease, err := c.Leaser.Acquire(ctx, upstream.Want{ClientID: caller.ClientID, Options: caller.Options, Target: target})
	var np *upstream.NoProxyError
	var inv *upstream.InvalidError
	switch {
	case errors.As(err, &np):
		return nil, &Failure{Status: http.StatusServiceUnavailable, Message: np.Error(), Outcome: "no_proxy", Socks: SocksFailure}
	case errors.As(err, &inv):
		return nil, &Failure{Status: http.StatusBadRequest, Message: inv.Message, Outcome: "bad_request", Socks: SocksNotAllowed}
	case err != nil:
		c.Log.WarnContext(ctx, "acquiring a lease failed", "error", err)
		return nil, &Failure{Status: http.StatusBadGateway, Message: "the lease service cannot be reached", Outcome: "lease_error", Socks: SocksFailure}
	}
	traceLease(ctx, lease)
	if lease.Moved() && !lease.Joined {
		c.Metrics.SessionMoves.WithLabelValues(lease.MoveReason).Inc()
		c.Log.InfoContext(ctx, "session moved", "client", caller.ClientID, "session", caller.Options.Session,
			"from", lease.MovedFrom, "to", lease.ProxyName, "reason", lease.MoveReason)
	}
	return lease, nil
}

// Finish ends a request's or tunnel's use of lease: a lease of no session
// is released.
func (c *Core) Finish(lease *upstream.Lease) {
	if !lease.Session() {
		go c.Leaser.Release(lease)
	}
}

// Tunnel is an open tunnel to the target through a leased proxy.
type Tunnel struct {
	Up     net.Conn
	Lease  *upstream.Lease
	Kind   string
	Target string
	// Moved is the first move a session made for this tunnel: the proxy
	// it left and why.
	MovedFrom, MoveReason string

	caller  access.Caller
	release func()
	sess    *session.Counters
}

// Open opens a tunnel of kind (connect, socks5) for caller to target
// (host:port).
func (c *Core) Open(ctx context.Context, caller access.Caller, kind, target string) (_ *Tunnel, f *Failure) {
	defer func() {
		if f != nil {
			TraceFailure(ctx, f)
		}
	}()
	host, _, err := net.SplitHostPort(target)
	if err != nil || host == "" {
		return nil, &Failure{Status: http.StatusBadRequest, Message: fmt.Sprintf("target %q: want host:port", target), Outcome: "bad_request", Socks: SocksAddrUnsupport}
	}
	release, err := c.Limits.Open(caller.ClientID)
	if err != nil {
		limit, st := "tunnels_total", http.StatusServiceUnavailable
		if errors.Is(err, access.ErrTooManyClientTunnels) {
			limit, st = "tunnels_per_client", http.StatusTooManyRequests
		}
		c.Metrics.Refusals.WithLabelValues(limit).Inc()
		return nil, &Failure{Status: st, Message: err.Error(), Outcome: "refused", Socks: SocksFailure}
	}
	var movedFrom, moveReason string
	for attempt := 0; ; attempt++ {
		lease, f := c.Acquire(ctx, caller, host)
		if f != nil {
			release()
			return nil, f
		}
		if lease.Moved() && movedFrom == "" {
			movedFrom, moveReason = lease.MovedFrom, lease.MoveReason
		}
		up, err := c.Dialer.Connect(ctx, lease.Addr, lease.User, target)
		if err == nil {
			t := &Tunnel{Up: up, Lease: lease, Kind: kind, Target: target, MovedFrom: movedFrom, MoveReason: moveReason,
				caller: caller, release: release}
			if lease.Session() {
				t.sess = c.Sessions.Use(session.Key{ClientID: caller.ClientID, ID: caller.Options.Session},
					lease.SessionKey, lease.ID, lease.ProxyName, lease.Addr, lease.Pool, lease.TTL, moveReason)
			}
			return t, nil
		}
		f = c.upstreamFailed(ctx, lease, host, err)
		c.Finish(lease)
		if attempt >= c.Retries || ctx.Err() != nil {
			release()
			return nil, f
		}
	}
}

// upstreamFailed reports a proxy that could not be reached (a cooldown
// for every target: the proxy is at fault) or that refused the CONNECT (a
// cooldown for this target), and says what the client would be told.
func (c *Core) upstreamFailed(ctx context.Context, lease *upstream.Lease, host string, err error) *Failure {
	var refused *upstream.RefusedError
	if errors.As(err, &refused) {
		c.Metrics.Retries.WithLabelValues("connect_refused").Inc()
		_ = c.Leaser.Report(ctx, lease.ID, leasev1.Outcome_OUTCOME_ERROR, host, upstream.TargetScope)
		code, socks := http.StatusBadGateway, SocksHostUnreach
		if refused.Status == http.StatusForbidden {
			code, socks = http.StatusForbidden, SocksNotAllowed
		}
		return &Failure{Status: code, Message: fmt.Sprintf("the proxy could not open a tunnel to %s (%d)", host, refused.Status),
			Outcome: "upstream_error", Socks: socks}
	}
	c.Metrics.Retries.WithLabelValues("upstream_unreachable").Inc()
	c.Log.InfoContext(ctx, "upstream proxy unreachable", "proxy", lease.ProxyName, "error", err)
	c.Dialer.Forget(lease.Addr, lease.User)
	_ = c.Leaser.Report(ctx, lease.ID, leasev1.Outcome_OUTCOME_ERROR, host, upstream.GlobalScope)
	return &Failure{Status: http.StatusBadGateway, Message: "no proxy could be reached", Outcome: "upstream_error", Socks: SocksHostUnreach}
}

// Abort gives up an opened tunnel whose client went away before its
// answer.
func (c *Core) Abort(t *Tunnel) {
	_ = t.Up.Close()
	t.sess.Done()
	c.Finish(t.Lease)
	t.release()
}

// Relay copies bytes between client and the tunnel until either side
// ends, the tunnel idles past IdleTimeout or lives past MaxLifetime; its
// lease is renewed meanwhile and given back at the end. client's buffered
// holds bytes the client sent that were already read. The caller's
// goroutine copies the answers down and one more copies the client's
// bytes up; the limits and the renewal run on a timer, not a goroutine of
// their own: a goroutine's stack is the largest part of a live tunnel's
// memory.
func (c *Core) Relay(t *Tunnel, client net.Conn, buffered []byte) {
	start := time.Now()
	labels := []string{t.caller.ClientID, t.Lease.Pool, t.caller.Options.Provider}
	active := c.Metrics.ActiveTunnels.WithLabelValues(t.Kind)
	active.Inc()
	defer func() {
		active.Dec()
		c.Metrics.TunnelDuration.WithLabelValues(t.Kind).Observe(time.Since(start).Seconds())
		c.Metrics.Requests.WithLabelValues(append(labels, t.Kind, "success")...).Inc()
		t.sess.Done()
		c.Finish(t.Lease)
		t.release()
	}()

	var closeOnce sync.Once
	var endedBy atomic.Value
	closeBoth := func(reason string) {
		closeOnce.Do(func() {
			if reason != "" {
				endedBy.Store(reason)
			}
			_ = client.Close()
			_ = t.Up.Close()
		})
	}
	w := c.watch(t, start, closeBoth)
	// Activity is looked for only when an idle timeout uses it.
	var window time.Duration
	if c.IdleTimeout > 0 {
		window = w.tick
	}

	var up int64
	upDone := make(chan struct{})
	go func() {
		defer close(upDone)
		if len(buffered) > 0 {
			n, err := t.Up.Write(buffered)
			up += int64(n)
			if err != nil {
				closeBoth("")
				return
			}
		}
		n, _ := Pipe(t.Up, client, window, &w.lastActive)
		up += n
		closeWrite(t.Up)
	}()
	down, _ := Pipe(client, t.Up, window, &w.lastActive)
	closeWrite(client)
	<-upDone
	w.stop()
	closeBoth("")
	if r, ok := endedBy.Load().(string); ok {
		c.Metrics.Refusals.WithLabelValues(r).Inc()
	}
	c.Metrics.Bytes.WithLabelValues(append([]string{"up"}, labels...)...).Add(float64(up))
	c.Metrics.Bytes.WithLabelValues(append([]string{"down"}, labels...)...).Add(float64(down))
	t.sess.Add(up, down)
}

// watcher renews a tunnel's lease at a third of its TTL and ends the
// tunnel when it idles or lives too long, looking every tick from a
// timer that re-arms itself until stop.
type watcher struct {
	c          *Core
	t          *Tunnel
	start      time.Time
	tick       time.Duration
	closeBoth  func(reason string)
	lastActive atomic.Int64 // unix nanoseconds of the last byte either way, within a tick
	lastRenew  time.Time    // touched by check alone, one run at a time
	ctx        context.Context
	cancel     context.CancelFunc

	mu      sync.Mutex
	timer   *time.Timer
	stopped bool
}

func (c *Core) watch(t *Tunnel, start time.Time, closeBoth func(string)) *watcher {
	w := &watcher{c: c, t: t, start: start, tick: c.watchTick(), closeBoth: closeBoth, lastRenew: start}
	w.lastActive.Store(start.UnixNano())
	w.ctx, w.cancel = context.WithCancel(context.Background())
	w.mu.Lock()
	w.timer = time.AfterFunc(w.tick, w.check)
	w.mu.Unlock()
	return w
}

// check is one look at the tunnel; it re-arms the timer unless the
// tunnel ended.
func (w *watcher) check() {
	now := time.Now()
	c := w.c
	switch {
	case c.MaxLifetime > 0 && now.Sub(w.start) >= c.MaxLifetime:
		w.closeBoth("tunnel_lifetime")
		return
	case c.IdleTimeout > 0 && now.Sub(time.Unix(0, w.lastActive.Load())) >= c.IdleTimeout:
		w.closeBoth("idle")
		return
	}
	if renewEvery := w.t.Lease.TTL / 3; renewEvery > 0 && now.Sub(w.lastRenew) >= renewEvery {
		w.lastRenew = now
		if err := c.Leaser.Renew(w.ctx, w.t.Lease); err != nil && w.ctx.Err() == nil {
			c.Log.Warn("renewing a tunnel's lease failed", "lease_id", w.t.Lease.ID, "proxy", w.t.Lease.ProxyName, "error", err)
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.stopped {
		w.timer.Reset(w.tick)
	}
}

// stop ends the watching: no check starts after it, and a renewal under
// way is cancelled.
func (w *watcher) stop() {
	w.mu.Lock()
	w.stopped = true
	w.timer.Stop()
	w.mu.Unlock()
	w.cancel()
}

// watchTick is how often a tunnel's watcher looks at it: a second, or a
// quarter of the idle timeout when that is shorter.
func (c *Core) watchTick() time.Duration {
	tick := time.Second
	if c.IdleTimeout > 0 && c.IdleTimeout/4 < tick {
		tick = max(c.IdleTimeout/4, 10*time.Millisecond)
	}
	return tick
}

// Pipe copies src to dst until src ends or either fails, and returns the
// bytes copied. It hands the two connections to io.Copy as they are, so
// that two TCP connections are relayed by the kernel (splice) without the
// bytes passing through user space; a wrapper that counted or timed each
// write would hide that path. Activity is seen without one: when window
// is set, src's read deadline ends each copy after window, and a copy that
// moved bytes stores the time in last, so last lags the real last byte by
// at most window.
func Pipe(dst, src net.Conn, window time.Duration, last *atomic.Int64) (int64, error) {
	var total int64
	for {
		if window > 0 {
			_ = src.SetReadDeadline(time.Now().Add(window))
		}
		n, err := io.Copy(dst, src)
		total += n
		if n > 0 {
			last.Store(time.Now().UnixNano())
		}
		if window > 0 && errors.Is(err, os.ErrDeadlineExceeded) {
			continue
		}
		return total, err
	}
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}
