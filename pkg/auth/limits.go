package auth

import (
	"context"
	"flag"
	"fmt"
	"math"
	"strconv"
	"sync"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// RateLimitedReason is the ErrorInfo reason of a call refused by a
// per-client rate limit (as opposed to, say, no proxy being available).
const RateLimitedReason = "RATE_LIMITED"

// ErrorDomain is the ErrorInfo domain of errors this package makes.
const ErrorDomain = "auth.egress-proxies"

// RetryAfterHeader is the response metadata key carrying the seconds to
// wait after RESOURCE_EXHAUSTED; the REST layer sends it as Retry-After.
const RetryAfterHeader = "retry-after"

// RateLimit is one per-client token bucket: Rate calls a second on
// average, Burst at once. A Rate of 0 turns the limit off.
type RateLimit struct {
	Rate  float64
	Burst int
}

// Limits are the per-client rate limits of the rate-limited method
// classes (Rule.Limit).
type Limits struct {
	Lease       RateLimit
	ProxyWrites RateLimit
}

// DefaultLimits are generous enough for one crawler fleet sharing a token
// and for scripted fleet changes, and stop a runaway client.
func DefaultLimits() Limits {
	return Limits{
		Lease:       RateLimit{Rate: 2000, Burst: 4000},
		ProxyWrites: RateLimit{Rate: 50, Burst: 200},
	}
}

// RegisterFlags adds the rate-limit flags.
func (l *Limits) RegisterFlags(fs *flag.FlagSet) {
	fs.Float64Var(&l.Lease.Rate, "rate-limit-lease", l.Lease.Rate,
		"acquire, renew, release and report calls per second one client may make on average; 0 turns the limit off")
	fs.IntVar(&l.Lease.Burst, "rate-limit-lease-burst", l.Lease.Burst, "lease calls one client may make at once")
	fs.Float64Var(&l.ProxyWrites.Rate, "rate-limit-proxy-writes", l.ProxyWrites.Rate,
		"proxy create, update and delete calls per second one client may make on average; 0 turns the limit off")
	fs.IntVar(&l.ProxyWrites.Burst, "rate-limit-proxy-writes-burst", l.ProxyWrites.Burst, "proxy writes one client may make at once")
}

// Validate checks the limits.
func (l Limits) Validate() error {
	for name, r := range map[string]RateLimit{"lease": l.Lease, "proxy-writes": l.ProxyWrites} {
		if r.Rate < 0 || math.IsNaN(r.Rate) || math.IsInf(r.Rate, 0) {
			return fmt.Errorf("--rate-limit-%s must be 0 (off) or a positive rate", name)
		}
		if r.Rate > 0 && r.Burst < 1 {
			return fmt.Errorf("--rate-limit-%s-burst must be at least 1", name)
		}
	}
	return nil
}

// limiters holds one bucket per client and limited class. Client ids come
// from the token file, so the map is bounded by it.
type limiters struct {
	cfg Limits
	now func() time.Time

	mu      sync.Mutex
	buckets map[limiterKey]*rate.Limiter
}

type limiterKey struct {
	class  Limit
	client string
}

// SetLimits sets the per-client rate limits; before it, nothing is rate
// limited.
func (a *Authenticator) SetLimits(l Limits) error {
	if err := l.Validate(); err != nil {
		return err
	}
	a.limits = &limiters{cfg: l, now: time.Now, buckets: map[limiterKey]*rate.Limiter{}}
	return nil
}

func (l *limiters) allow(ctx context.Context, class Limit, client string) error {
	if l == nil || class == NoLimit {
		return nil
	}
	var cfg RateLimit
	switch class {
	case LeaseLimit:
		cfg = l.cfg.Lease
	case ProxyWriteLimit:
		cfg = l.cfg.ProxyWrites
	}
	if cfg.Rate <= 0 {
		return nil
	}
	k := limiterKey{class, client}
	l.mu.Lock()
	b, ok := l.buckets[k]
	if !ok {
		b = rate.NewLimiter(rate.Limit(cfg.Rate), cfg.Burst)
		l.buckets[k] = b
	}
	l.mu.Unlock()
	now := l.now()
	res := b.ReserveN(now, 1)
	wait := res.DelayFrom(now)
	if wait == 0 {
		return nil
	}
	res.CancelAt(now)
	secs := int64(math.Ceil(wait.Seconds()))
	// Unary and streaming calls alike: the REST layer turns it into
	// Retry-After.
	_ = grpc.SetHeader(ctx, metadata.Pairs(RetryAfterHeader, strconv.FormatInt(secs, 10)))
	st := status.Newf(codes.ResourceExhausted, "client %q exceeded its %s rate limit of %g calls/s (burst %d); retry in %ds",
		client, class, cfg.Rate, cfg.Burst, secs)
	if d, err := st.WithDetails(
		&errdetails.ErrorInfo{Reason: RateLimitedReason, Domain: ErrorDomain, Metadata: map[string]string{"limit": string(class)}},
		&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Duration(secs) * time.Second)},
	); err == nil {
		st = d
	}
	return st.Err()
}

// IsRateLimited reports whether st is a refusal by a per-client rate limit.
func IsRateLimited(st *status.Status) bool {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetReason() == RateLimitedReason && info.GetDomain() == ErrorDomain {
			return true
		}
	}
	return false
}
