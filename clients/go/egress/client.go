// Package egress is the crawler's client of the egress-proxies lease
// service: it acquires a lease on a proxy, keeps it alive in the
// background, sends HTTP through the leased proxy, reports how the target
// answered and releases the lease on every exit path.
//
// Two levels:
//
//   - Client.Acquire returns a Lease: renewed in the background until
//     Release or until it is lost (Lease.Done, Lease.Err, Options.OnLost),
//     with Report for outcomes and Transport for an http.RoundTripper
//     through the proxy (CONNECT for https).
//   - RoundTripper leases a proxy per target host on demand, classifies
//     every answer (Classifier, DefaultClassifier by default), reports
//     bans and moves to another proxy after one.
//
// Acquire waits while no proxy is available (RESOURCE_EXHAUSTED) or the
// service is briefly unavailable, with exponential backoff and jitter,
// until its context ends. The module depends only on the generated API
// stubs and gRPC, so a crawler imports it without the services.
package egress

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// Options configure a Client. Only the token and the TLS settings are
// required to talk to a suite; the rest have working defaults.
type Options struct {
	// Token is the bearer token the lease service knows this crawler by
	// (a token with the crawler role). Empty sends none: only for a
	// service running with --auth-disabled.
	Token string
	// Insecure talks to the service without TLS (a local suite only; the
	// token then travels in clear text).
	Insecure bool
	// CAFile is a PEM bundle verifying the service's certificate; empty:
	// the system roots.
	CAFile string
	// ServerName is the name verified in the service's certificate; empty:
	// the host of the address.
	ServerName string
	// TLSConfig, when set, is used as is (CAFile and ServerName are then
	// ignored).
	TLSConfig *tls.Config
	// DialOptions are added to the gRPC connection's options.
	DialOptions []grpc.DialOption

	// BaseTransport is cloned for every lease's Transport; set its
	// TLSClientConfig to trust a target's CA. Nil: a clone of
	// http.DefaultTransport.
	BaseTransport *http.Transport

	// AcquireBackoff is the wait between acquire attempts while no proxy
	// is available. Nil: 250ms growing 1.5 times per attempt up to 15s,
	// each wait randomised by ±50%.
	AcquireBackoff func() backoff.BackOff
	// CallTimeout bounds each renew, report and release call. Default 10s.
	CallTimeout time.Duration
	// OnLost is called (on its own goroutine) when a lease is lost: the
	// service no longer holds it for this client, or it could not be
	// renewed before it expired.
	OnLost func(l *Lease, err error)
	// Logger receives WARNING lines for lost leases and failed releases.
	// Nil: slog.Default().
	Logger *slog.Logger
}

// Selector narrows which proxies qualify; empty fields match everything.
type Selector struct {
	Provider string
	Region   string
	Zone     string
	Labels   map[string]string
}

func (s Selector) proto() *leasev1.ProxySelector {
	return &leasev1.ProxySelector{Provider: s.Provider, Region: s.Region, Zone: s.Zone, Labels: s.Labels}
}

// Client talks to one lease service. It is safe for concurrent use.
type Client struct {
	conn    *grpc.ClientConn
	api     leasev1.LeaseServiceClient
	opts    Options
	log     *slog.Logger
	base    *http.Transport
	backoff func() backoff.BackOff

	mu     sync.Mutex
	leases map[*Lease]struct{}
	closed bool
}

// New connects to the lease service's gRPC address (host:port). It does not
// block: the connection is made on the first call.
func New(addr string, o Options) (*Client, error) {
	if addr == "" {
		return nil, errors.New("egress: address is empty")
	}
	var tc credentials.TransportCredentials
	switch {
	case o.Insecure:
		tc = insecure.NewCredentials()
	case o.TLSConfig != nil:
		tc = credentials.NewTLS(o.TLSConfig)
	default:
		cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: o.ServerName}
		if o.CAFile != "" {
			pem, err := os.ReadFile(o.CAFile)
			if err != nil {
				return nil, fmt.Errorf("egress: Options.CAFile: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("egress: Options.CAFile %s: no PEM certificate in it", o.CAFile)
			}
			cfg.RootCAs = pool
		}
		tc = credentials.NewTLS(cfg)
	}
	dial := []grpc.DialOption{grpc.WithTransportCredentials(tc)}
	if o.Token != "" {
		dial = append(dial, grpc.WithPerRPCCredentials(bearer{token: o.Token, requireTLS: !o.Insecure}))
	}
	dial = append(dial, o.DialOptions...)
	conn, err := grpc.NewClient(addr, dial...)
	if err != nil {
		return nil, fmt.Errorf("egress: %w", err)
	}
	return newClient(conn, o), nil
}

func newClient(conn *grpc.ClientConn, o Options) *Client {
	c := &Client{conn: conn, api: leasev1.NewLeaseServiceClient(conn), opts: o, leases: map[*Lease]struct{}{}}
	c.log = o.Logger
	if c.log == nil {
		c.log = slog.Default()
	}
	if o.CallTimeout <= 0 {
		c.opts.CallTimeout = 10 * time.Second
	}
	c.base = o.BaseTransport
	if c.base == nil {
		c.base = http.DefaultTransport.(*http.Transport)
	}
	c.backoff = o.AcquireBackoff
	if c.backoff == nil {
		c.backoff = DefaultAcquireBackoff
	}
	return c
}

// DefaultAcquireBackoff is the wait between acquire attempts: 250ms growing
// 1.5 times per attempt up to 15s, each randomised by ±50% so that a fleet
// does not retry in lockstep.
func DefaultAcquireBackoff() backoff.BackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 250 * time.Millisecond
	b.Multiplier = 1.5
	b.MaxInterval = 15 * time.Second
	b.RandomizationFactor = 0.5
	return b
}

// Close releases every lease still held and closes the connection.
func (c *Client) Close() error {
	c.mu.Lock()
	c.closed = true
	held := make([]*Lease, 0, len(c.leases))
	for l := range c.leases {
		held = append(held, l)
	}
	c.mu.Unlock()
	for _, l := range held {
		_ = l.Release()
	}
	return c.conn.Close()
}

// bearer sends the token on every call. It never appears in errors.
type bearer struct {
	token      string
	requireTLS bool
}

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

func (b bearer) RequireTransportSecurity() bool { return b.requireTLS }

// ErrNoProxyAvailable is matched (errors.Is) by a *NoProxyError.
var ErrNoProxyAvailable = errors.New("no proxy available")

// NoProxyError is TryAcquire's answer when no proxy qualifies: how the
// proxies matching the selector were ruled out.
type NoProxyError struct {
	Matching          int
	Unhealthy         int
	AtCapacity        int
	CoolingDownTarget int
	CoolingDownGlobal int
	msg               string
}

func (e *NoProxyError) Error() string { return "egress: " + e.msg }

// Is makes errors.Is(err, ErrNoProxyAvailable) hold.
func (e *NoProxyError) Is(target error) bool { return target == ErrNoProxyAvailable }

// ErrRateLimited is matched (errors.Is) by a *RateLimitError.
var ErrRateLimited = errors.New("rate limited")

// RateLimitError is the service refusing a call over this client's rate
// limit (RESOURCE_EXHAUSTED with reason RATE_LIMITED); Acquire waits
// RetryAfter before its next attempt.
type RateLimitError struct {
	RetryAfter time.Duration
	msg        string
}

func (e *RateLimitError) Error() string { return "egress: " + e.msg }

// Is makes errors.Is(err, ErrRateLimited) hold.
func (e *RateLimitError) Is(target error) bool { return target == ErrRateLimited }

// exhausted is the error for a RESOURCE_EXHAUSTED answer: a rate limit
// when its details say so, else no proxy available.
func exhausted(st *status.Status) error {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetReason() == "RATE_LIMITED" {
			e := &RateLimitError{msg: st.Message()}
			for _, d := range st.Details() {
				if ri, ok := d.(*errdetails.RetryInfo); ok {
					e.RetryAfter = ri.GetRetryDelay().AsDuration()
				}
			}
			return e
		}
	}
	return noProxyError(st)
}

func noProxyError(st *status.Status) *NoProxyError {
	e := &NoProxyError{msg: st.Message()}
	for _, d := range st.Details() {
		if n, ok := d.(*leasev1.NoProxyAvailable); ok {
			e.Matching, e.Unhealthy, e.AtCapacity = int(n.GetMatching()), int(n.GetUnhealthy()), int(n.GetAtCapacity())
			e.CoolingDownTarget, e.CoolingDownGlobal = int(n.GetCoolingDownTarget()), int(n.GetCoolingDownGlobal())
		}
	}
	return e
}

// TryAcquire asks once for a lease on a proxy for target (a host name or IP
// without port; empty: any target) among those matching sel, for ttl (0:
// the service's default). A *NoProxyError (errors.Is ErrNoProxyAvailable)
// when none qualifies, a *RateLimitError (errors.Is ErrRateLimited) when
// this client is over its rate limit.
func (c *Client) TryAcquire(ctx context.Context, target string, sel Selector, ttl time.Duration) (*Lease, error) {
	c.mu.Lock()
	closed := c.closed
	c.mu.Unlock()
	if closed {
		return nil, errors.New("egress: client closed")
	}
	req := &leasev1.AcquireLeaseRequest{TargetHost: target, Selector: sel.proto()}
	if ttl > 0 {
		req.Ttl = durationpb.New(ttl)
	}
	resp, err := c.api.AcquireLease(ctx, req)
	if err != nil {
		st := status.Convert(err)
		if st.Code() == codes.ResourceExhausted {
			return nil, exhausted(st)
		}
		return nil, fmt.Errorf("egress: acquire lease: %w", err)
	}
	return c.track(resp.GetLease(), resp.GetCredentials(), ttl)
}

// Acquire is TryAcquire retried with backoff and jitter while no proxy is
// available or the service is unavailable (after a rate limit's refusal,
// the delay it names), until a lease is granted or ctx
// ends (then the last error, wrapped with ctx's). Errors that retrying
// cannot fix (invalid arguments, a bad token) return at once.
func (c *Client) Acquire(ctx context.Context, target string, sel Selector, ttl time.Duration) (*Lease, error) {
	var last error
	l, err := backoff.Retry(ctx, func() (*Lease, error) {
		l, err := c.TryAcquire(ctx, target, sel, ttl)
		var limited *RateLimitError
		if errors.As(err, &limited) && limited.RetryAfter > 0 {
			last = err
			return nil, backoff.RetryAfter(int(limited.RetryAfter.Round(time.Second) / time.Second))
		}
		if err == nil || retryable(err) {
			last = err
			return l, err
		}
		return nil, backoff.Permanent(err)
	}, backoff.WithBackOff(c.backoff()), backoff.WithMaxElapsedTime(0))
	if err != nil && ctx.Err() != nil && last != nil {
		return nil, fmt.Errorf("%w (last attempt: %w)", ctx.Err(), last)
	}
	return l, err
}

// retryable: no proxy now, or the service briefly unavailable. A
// certificate the client cannot verify is a setting to fix, not a moment
// to wait out.
func retryable(err error) bool {
	if errors.Is(err, ErrNoProxyAvailable) || errors.Is(err, ErrRateLimited) {
		return true
	}
	switch status.Code(err) {
	case codes.Unavailable:
		msg := status.Convert(errors.Unwrap(err)).Message()
		return !strings.Contains(msg, "x509:") && !strings.Contains(msg, "tls: failed to verify")
	case codes.ResourceExhausted, codes.Aborted:
		return true
	}
	return false
}

func (c *Client) track(pl *leasev1.Lease, creds *proxyv1.ProxyCredentials, ttl time.Duration) (*Lease, error) {
	l, err := newLease(c, pl, creds, ttl)
	if err != nil {
		// Granted but unusable (no address): give it back.
		ctx, cancel := context.WithTimeout(context.Background(), c.opts.CallTimeout)
		defer cancel()
		_, _ = c.api.ReleaseLease(ctx, &leasev1.ReleaseLeaseRequest{LeaseId: pl.GetLeaseId()})
		return nil, err
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		_ = l.Release()
		return nil, errors.New("egress: client closed")
	}
	c.leases[l] = struct{}{}
	c.mu.Unlock()
	go l.keepAlive()
	return l, nil
}

func (c *Client) untrack(l *Lease) {
	c.mu.Lock()
	delete(c.leases, l)
	c.mu.Unlock()
}
