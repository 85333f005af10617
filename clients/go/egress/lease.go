package egress

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// ErrReleased is a Lease's Err after Release.
var ErrReleased = errors.New("egress: lease released")

// LostError is a Lease's Err when the service no longer holds the lease for
// this client: it was ended elsewhere (NOT_FOUND), its proxy stopped being
// leasable (FAILED_PRECONDITION), or no renewal got through before it
// expired.
type LostError struct {
	LeaseID string
	// Cause is the renewal's error.
	Cause error
	// Expired is true when the lease ran out while renewals failed.
	Expired bool
}

func (e *LostError) Error() string {
	if e.Expired {
		return fmt.Sprintf("egress: lease %s lost: expired while renewals failed: %v", e.LeaseID, e.Cause)
	}
	return fmt.Sprintf("egress: lease %s lost: %v", e.LeaseID, e.Cause)
}

func (e *LostError) Unwrap() error { return e.Cause }

// Lease is a hold on one proxy, renewed in the background until Release or
// until it is lost. Release it on every exit path (defer l.Release()): it
// is idempotent and safe after the lease was lost.
type Lease struct {
	// ID is the lease's identifier.
	ID string
	// ProxyName and ProxyUID name the leased proxy.
	ProxyName string
	ProxyUID  string
	// Target is the host the lease was acquired for; empty for any.
	Target string
	// ProxyURL is where to send requests: http://host:port, with the
	// proxy's credentials from the acquire's answer as its user info when
	// it has some (Go's transport sends them as Proxy-Authorization). Log
	// it with Redacted, never String.
	ProxyURL *url.URL

	c      *Client
	ttl    *durationpb.Duration // nil: the service's default
	period time.Duration        // between renewals

	ctx     context.Context // ends when Release is called
	cancel  context.CancelFunc
	stopped chan struct{} // closed when keepAlive returns

	mu     sync.Mutex
	expire time.Time
	err    error
	done   chan struct{}

	releaseOnce sync.Once
	releaseErr  error

	transportOnce sync.Once
	transport     *http.Transport
}

func newLease(c *Client, pl *leasev1.Lease, creds *proxyv1.ProxyCredentials, ttl time.Duration) (*Lease, error) {
	a := pl.GetAddress()
	if a.GetHost() == "" || a.GetPort() == 0 {
		return nil, fmt.Errorf("egress: lease %s has no proxy address", pl.GetLeaseId())
	}
	scheme := a.GetScheme()
	if scheme == "" {
		scheme = "http"
	}
	l := &Lease{
		ID: pl.GetLeaseId(), ProxyName: pl.GetProxyName(), ProxyUID: pl.GetProxyUid(), Target: pl.GetTargetHost(),
		ProxyURL: &url.URL{Scheme: scheme, Host: net.JoinHostPort(a.GetHost(), strconv.Itoa(int(a.GetPort())))},
		c:        c, expire: pl.GetExpireTime().AsTime(),
		stopped: make(chan struct{}), done: make(chan struct{}),
	}
	if creds.GetUsername() != "" {
		l.ProxyURL.User = url.UserPassword(creds.GetUsername(), creds.GetPassword())
	}
	granted := pl.GetExpireTime().AsTime().Sub(pl.GetAcquireTime().AsTime())
	if ttl > 0 {
		l.ttl = durationpb.New(ttl)
		granted = ttl
	}
	// Three renewals per TTL: two may fail before the lease runs out.
	l.period = max(granted/3, 100*time.Millisecond)
	l.ctx, l.cancel = context.WithCancel(context.Background())
	return l, nil
}

// Expiry is when the lease runs out unless renewed again.
func (l *Lease) Expiry() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.expire
}

// Done is closed when the lease ends: released or lost.
func (l *Lease) Done() <-chan struct{} { return l.done }

// Err is nil while the lease is held, ErrReleased after Release, and a
// *LostError when it was lost.
func (l *Lease) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// finish ends the lease locally once; later calls change nothing.
func (l *Lease) finish(err error) bool {
	l.mu.Lock()
	if l.err != nil {
		l.mu.Unlock()
		return false
	}
	l.err = err
	close(l.done)
	t := l.transport
	l.mu.Unlock()
	l.c.untrack(l)
	if t != nil {
		t.CloseIdleConnections()
	}
	return true
}

// keepAlive renews the lease every period until Release, or until the
// service says it is gone or it expires while renewals fail.
func (l *Lease) keepAlive() {
	defer close(l.stopped)
	timer := time.NewTimer(l.period)
	defer timer.Stop()
	retry := backoff.NewExponentialBackOff()
	retry.InitialInterval = 200 * time.Millisecond
	retry.MaxInterval = l.period
	for {
		select {
		case <-l.ctx.Done():
			return
		case <-timer.C:
		}
		ctx, cancel := context.WithTimeout(l.ctx, l.c.opts.CallTimeout)
		resp, err := l.c.api.RenewLease(ctx, &leasev1.RenewLeaseRequest{LeaseId: l.ID, Ttl: l.ttl})
		cancel()
		if l.ctx.Err() != nil {
			return
		}
		switch code := status.Code(err); {
		case err == nil:
			l.mu.Lock()
			l.expire = resp.GetLease().GetExpireTime().AsTime()
			l.mu.Unlock()
			retry.Reset()
			timer.Reset(l.period)
		case code == codes.NotFound || code == codes.FailedPrecondition || code == codes.PermissionDenied ||
			code == codes.Unauthenticated || code == codes.InvalidArgument:
			l.lose(&LostError{LeaseID: l.ID, Cause: err})
			return
		default:
			left := time.Until(l.Expiry())
			if left <= 0 {
				l.lose(&LostError{LeaseID: l.ID, Cause: err, Expired: true})
				return
			}
			timer.Reset(min(retry.NextBackOff(), left))
		}
	}
}

func (l *Lease) lose(err *LostError) {
	if !l.finish(err) {
		return
	}
	l.c.log.Warn("WARNING: proxy lease lost; requests through it stop",
		"lease_id", l.ID, "proxy_name", l.ProxyName, "target", l.Target, "error", err.Cause)
	// A lease whose proxy stopped being leasable still holds its slot on
	// the service until released.
	l.releaseOnce.Do(func() { l.releaseErr = l.releaseCall() })
	if l.c.opts.OnLost != nil {
		go l.c.opts.OnLost(l, err)
	}
}

// Release ends the lease and frees the proxy for others. Idempotent: later
// calls, and calls after the lease was lost, return the first call's
// result without another request. An error means the service could not be
// told; the lease then ends at its expiry.
func (l *Lease) Release() error {
	l.cancel()
	<-l.stopped
	l.finish(ErrReleased)
	l.releaseOnce.Do(func() { l.releaseErr = l.releaseCall() })
	return l.releaseErr
}

func (l *Lease) releaseCall() error {
	ctx, cancel := context.WithTimeout(context.Background(), l.c.opts.CallTimeout)
	defer cancel()
	_, err := backoff.Retry(ctx, func() (struct{}, error) {
		_, err := l.c.api.ReleaseLease(ctx, &leasev1.ReleaseLeaseRequest{LeaseId: l.ID})
		switch status.Code(err) {
		case codes.OK, codes.NotFound: // NOT_FOUND: no longer retained, so not held either
			return struct{}{}, nil
		case codes.Unavailable, codes.Aborted, codes.ResourceExhausted: // ResourceExhausted: a rate limit
			return struct{}{}, err
		}
		return struct{}{}, backoff.Permanent(err)
	}, backoff.WithBackOff(backoff.NewExponentialBackOff()))
	if err != nil {
		l.c.log.Warn("WARNING: releasing a proxy lease failed; it ends at its expiry",
			"lease_id", l.ID, "proxy_name", l.ProxyName, "expire_time", l.Expiry(), "error", err)
		return fmt.Errorf("egress: release lease %s: %w", l.ID, err)
	}
	return nil
}

// Outcome is how a target treated a request through a leased proxy.
type Outcome int

// The outcomes a crawler reports. Every one but Success starts a cooldown;
// the service's defaults: Blocked 5m, Banned 1h and Captcha 10m for the
// lease's target; Timeout 1m and Error 30s for every target.
const (
	Success Outcome = iota + 1
	Blocked
	Banned
	Captcha
	Timeout
	Error
)

func (o Outcome) String() string {
	switch o {
	case Success:
		return "success"
	case Blocked:
		return "blocked"
	case Banned:
		return "banned"
	case Captcha:
		return "captcha"
	case Timeout:
		return "timeout"
	case Error:
		return "error"
	}
	return "outcome(" + strconv.Itoa(int(o)) + ")"
}

// Scope says which targets a cooldown covers.
type Scope int

const (
	// ScopeDefault is the outcome's default scope on the service.
	ScopeDefault Scope = iota
	// ScopeTarget keeps the proxy away from the lease's target only.
	ScopeTarget
	// ScopeGlobal keeps the proxy away from every target.
	ScopeGlobal
)

// ReportOption changes a report's cooldown.
type ReportOption func(*leasev1.ReportOutcomeRequest)

// WithCooldown sets the cooldown's length (0: none) instead of the
// outcome's default.
func WithCooldown(d time.Duration) ReportOption {
	return func(r *leasev1.ReportOutcomeRequest) { r.Cooldown = durationpb.New(d) }
}

// WithScope sets the cooldown's scope instead of the outcome's default.
func WithScope(s Scope) ReportOption {
	return func(r *leasev1.ReportOutcomeRequest) { r.Scope = leasev1.CooldownScope(s) }
}

// Cooldown is the cooldown in force after a report.
type Cooldown struct {
	// Target is the host it covers; empty for every target.
	Target string
	// Until is when it ends; zero when the report started none.
	Until time.Time
	// Outcome is the report that started it.
	Outcome Outcome
}

// Report tells the service how the target treated a request through this
// lease. Accepted after Release too, for as long as the service retains
// the lease (an hour by default), so a late verdict still counts.
func (l *Lease) Report(ctx context.Context, o Outcome, opts ...ReportOption) (Cooldown, error) {
	if o < Success || o > Error {
		return Cooldown{}, fmt.Errorf("egress: outcome %d is not one of Success..Error", int(o))
	}
	req := &leasev1.ReportOutcomeRequest{LeaseId: l.ID, Outcome: leasev1.Outcome(o)}
	for _, opt := range opts {
		opt(req)
	}
	ctx, cancel := context.WithTimeout(ctx, l.c.opts.CallTimeout)
	defer cancel()
	resp, err := l.c.api.ReportOutcome(ctx, req)
	if err != nil {
		return Cooldown{}, fmt.Errorf("egress: report %s on lease %s: %w", o, l.ID, err)
	}
	cd := resp.GetCooldown()
	if cd == nil {
		return Cooldown{}, nil
	}
	return Cooldown{Target: cd.GetTargetHost(), Until: cd.GetExpireTime().AsTime(), Outcome: Outcome(cd.GetOutcome())}, nil
}

// Transport is an http.RoundTripper through the leased proxy: plain HTTP is
// forwarded, https goes through a CONNECT tunnel. It fails every request
// once the lease has ended, so nothing is sent through a proxy this
// crawler no longer holds. It is built from Options.BaseTransport.
func (l *Lease) Transport() http.RoundTripper {
	l.transportOnce.Do(func() {
		t := l.c.base.Clone()
		t.Proxy = http.ProxyURL(l.ProxyURL)
		l.mu.Lock()
		l.transport = t
		l.mu.Unlock()
	})
	return leaseTransport{l}
}

type leaseTransport struct{ l *Lease }

func (t leaseTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if err := t.l.Err(); err != nil {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err
	}
	return t.l.transport.RoundTrip(req)
}
