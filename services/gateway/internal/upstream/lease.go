// Package upstream is the gateway's side toward the fleet: it leases a
// proxy from the lease service for each request, tunnel or session, reports
// what the target did, gives the lease back, and reaches the leased proxy
// (CONNECT, or HTTP forwarding over a keep-alive pool per proxy).
package upstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/options"
)

// Lease is a proxy held for one request, tunnel or session.
type Lease struct {
	ID        string
	ProxyName string
	ProxyUID  string
	Pool      string
	// ClientID is the client the lease service granted it to: the
	// gateway's own.
	ClientID string
	// Addr is host:port of the proxy; User its credentials, nil when the
	// proxy demands none.
	Addr string
	User *url.Userinfo
	// SessionKey is set for a session's lease, which outlives the
	// request: it is renewed by the session's next request and ends
	// after the session's lifetime without one.
	SessionKey string
	// TTL is the duration the lease was acquired (and is renewed) for.
	TTL time.Duration
	// AcquireTime is when the lease service granted it.
	AcquireTime time.Time
	// Result is what the acquire did to the session (unspecified for no
	// session); for a move, MovedFrom and MoveReason say from where and
	// why.
	Result     leasev1.SessionResult
	MovedFrom  string
	MoveReason string
	// Joined is set when the acquire was made for this request and others
	// of its session together: one of them (the one without Joined)
	// counts a move.
	Joined bool

	// sel is the reservoir selector whose request a lease acquired on a
	// miss serves.
	sel *selector
}

// Session reports whether the lease is a session's.
func (l *Lease) Session() bool { return l.SessionKey != "" }

// Moved reports whether acquiring it moved the session off another proxy.
func (l *Lease) Moved() bool { return l.Result == leasev1.SessionResult_SESSION_RESULT_MOVED }

// Want is what a request asks of the fleet.
type Want struct {
	ClientID string
	Options  options.Options
	// Target is the host (no port) the request or tunnel goes to.
	Target string
}

// Leaser talks to the lease service.
type Leaser struct {
	Client leasev1.LeaseServiceClient
	// TTL is the lease duration of a request or tunnel (tunnels renew at
	// a third of it).
	TTL time.Duration
	// SessionLifetime is a session's lifetime when the username sets
	// none; SessionMaxAge ends a session's lease that old at its next
	// request (0: never).
	SessionLifetime time.Duration
	SessionMaxAge   time.Duration
	// CallTimeout bounds each call to the lease service.
	CallTimeout time.Duration
	Log         *slog.Logger
	// Calls, when set, observes each call's duration in seconds by call
	// (acquire, renew, release, report).
	Calls prometheus.ObserverVec
	// Reservoir, when set, answers the requests without a session from
	// leases held ahead.
	Reservoir *Reservoir

	sessions batcher
}

// observe records a call's duration since start.
func (l *Leaser) observe(call string, start time.Time) {
	if l.Calls != nil {
		l.Calls.WithLabelValues(call).Observe(time.Since(start).Seconds())
	}
}

// NoProxyError is the lease service's refusal: no proxy can serve.
// AtCapacity is how many matching proxies it ruled out for being at
// capacity (from the refusal's details).
type NoProxyError struct {
	Message    string
	AtCapacity int
}

func (e *NoProxyError) Error() string { return "no proxy available: " + e.Message }

// InvalidError is an acquire the lease service found invalid (a selector
// it does not accept).
type InvalidError struct{ Message string }

func (e *InvalidError) Error() string { return e.Message }

// Acquire leases a proxy for w.
func (l *Leaser) Acquire(ctx context.Context, w Want) (*Lease, error) {
	o := w.Options
	req := &leasev1.AcquireLeaseRequest{
		TargetHost: w.Target,
		Ttl:        durationpb.New(l.TTL),
		Selector: &leasev1.ProxySelector{
			Pool: o.Pool, Provider: o.Provider, Region: o.Region, Zone: o.Zone, Labels: o.Labels,
		},
		SessionKey: options.SessionKey(w.ClientID, o.Session),
	}
	if req.SessionKey != "" {
		life := o.Lifetime
		if life == 0 {
			life = l.SessionLifetime
		}
		req.Ttl = durationpb.New(life)
	}
	if req.SessionKey != "" {
		// A session's concurrent requests share one acquire: the lease
		// service answers a session's acquires one after another with the
		// same lease, so one call per request only queues.
		if l.Reservoir != nil {
			if lease := l.Reservoir.session(req); lease != nil {
				l.Reservoir.count("hit")
				return lease, nil
			}
		}
		key, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
		if err != nil {
			return nil, err
		}
		return l.sessions.do(ctx, string(key), func() (*Lease, error) {
			// The call answers every request of its batch: one that goes
			// away does not end it (CallTimeout bounds it).
			return l.acquireSession(context.WithoutCancel(ctx), req)
		})
	}
	if l.Reservoir != nil {
		return l.Reservoir.acquire(ctx, req)
	}
	return l.acquire(ctx, req)
}

// acquireSession acquires a session's lease, starting the session anew
// when its lease has lived SessionMaxAge.
func (l *Leaser) acquireSession(ctx context.Context, req *leasev1.AcquireLeaseRequest) (*Lease, error) {
	sent := time.Now()
	lease, err := l.acquireFreeing(ctx, req)
	if err != nil {
		return nil, err
	}
	if lease.Session() && l.SessionMaxAge > 0 && lease.Result == leasev1.SessionResult_SESSION_RESULT_EXISTING &&
		time.Since(lease.AcquireTime) > l.SessionMaxAge {
		// The session has lived its longest: end it and start anew.
		l.Release(lease)
		sent = time.Now()
		if lease, err = l.acquire(ctx, req); err != nil {
			return nil, err
		}
	}
	if l.Reservoir != nil && lease.Session() {
		if trusted, _ := l.Reservoir.Fleet.Trusted(); trusted {
			l.Reservoir.count("miss")
		} else {
			l.Reservoir.count("fallback")
		}
		l.Reservoir.sessionAcquired(req, lease, sent)
	}
	return lease, nil
}

// acquireFreeing acquires for a request (a session's or a miss of the
// reservoir). Refused because matching proxies are at capacity while this
// replica's reservoir holds idle leases, it gives those back and asks once
// more: the reservoir must not keep the replica's own requests out (on a
// small fleet it can hold every proxy). A refusal for cooldowns or health
// alone frees nothing.
func (l *Leaser) acquireFreeing(ctx context.Context, req *leasev1.AcquireLeaseRequest) (*Lease, error) {
	lease, err := l.acquire(ctx, req)
	var np *NoProxyError
	if errors.As(err, &np) && np.AtCapacity > 0 && l.Reservoir != nil && l.Reservoir.freeIdle() {
		lease, err = l.acquire(ctx, req)
	}
	return lease, err
}

func (l *Leaser) acquire(ctx context.Context, req *leasev1.AcquireLeaseRequest) (*Lease, error) {
	cctx, cancel := context.WithTimeout(ctx, l.CallTimeout)
	defer cancel()
	defer l.observe("acquire", time.Now())
	resp, err := l.Client.AcquireLease(cctx, req)
	if err != nil {
		switch status.Code(err) {
		case codes.ResourceExhausted:
			st := status.Convert(err)
			np := &NoProxyError{Message: strings.TrimPrefix(st.Message(), "no proxy available: ")}
			for _, d := range st.Details() {
				if u, ok := d.(*leasev1.NoProxyAvailable); ok {
					np.AtCapacity = int(u.GetAtCapacity())
				}
			}
			return nil, np
		case codes.InvalidArgument:
			return nil, &InvalidError{Message: status.Convert(err).Message()}
		}
		return nil, fmt.Errorf("lease service: %s", status.Convert(err).Message())
	}
	pl := resp.GetLease()
	a := pl.GetAddress()
	if a.GetHost() == "" || a.GetPort() == 0 {
		return nil, errors.New("lease service: the lease carries no proxy address")
	}
	out := &Lease{
		ID: pl.GetLeaseId(), ProxyName: pl.GetProxyName(), ProxyUID: pl.GetProxyUid(), Pool: pl.GetPool(), ClientID: pl.GetClientId(),
		Addr:       net.JoinHostPort(a.GetHost(), strconv.Itoa(int(a.GetPort()))),
		SessionKey: pl.GetSessionKey(), TTL: req.GetTtl().AsDuration(),
		AcquireTime: pl.GetAcquireTime().AsTime(),
	}
	if l.Reservoir != nil {
		// The watch of the gateway's ended leases follows this client.
		l.Reservoir.Fleet.LearnClient(out.ClientID)
	}
	if c := resp.GetCredentials(); c.GetUsername() != "" {
		out.User = url.UserPassword(c.GetUsername(), c.GetPassword())
	}
	if s := resp.GetSession(); s != nil {
		out.Result = s.GetResult()
		out.MovedFrom = s.GetPreviousProxyName()
		if s.GetMoveReason() != leasev1.SessionMoveReason_SESSION_MOVE_REASON_UNSPECIFIED {
			out.MoveReason = strings.ToLower(strings.TrimPrefix(s.GetMoveReason().String(), "SESSION_MOVE_REASON_"))
		}
	}
	return out, nil
}

// Renew extends a lease by its TTL.
func (l *Leaser) Renew(ctx context.Context, lease *Lease) error {
	cctx, cancel := context.WithTimeout(ctx, l.CallTimeout)
	defer cancel()
	defer l.observe("renew", time.Now())
	_, err := l.Client.RenewLease(cctx, &leasev1.RenewLeaseRequest{LeaseId: lease.ID, Ttl: durationpb.New(lease.TTL)})
	return err
}

// Release ends a lease that is no session's (a session's lease lives on
// until its lifetime passes without a request), in the background of the
// request: the client already has its answer.
func (l *Leaser) Release(lease *Lease) {
	if l.Reservoir != nil {
		// A reservoir lease goes back to it; any other is released.
		l.Reservoir.giveBack(lease)
		return
	}
	l.ReleaseID(lease.ID)
}

// ReleaseID ends a lease by id.
func (l *Leaser) ReleaseID(id string) {
	if l.Reservoir != nil {
		// A session ended here is not answered from the cache meanwhile.
		l.Reservoir.Ended(id)
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.CallTimeout)
	defer cancel()
	defer l.observe("release", time.Now())
	if _, err := l.Client.ReleaseLease(ctx, &leasev1.ReleaseLeaseRequest{LeaseId: id}); err != nil {
		l.Log.Warn("releasing a lease failed; it ends at its expiry", "lease_id", id, "error", status.Convert(err).Message())
	}
}

// Scope is where a report's cooldown applies.
type Scope int

// The scopes: the request's target only, or every target (the proxy
// itself failed).
const (
	TargetScope Scope = iota
	GlobalScope
)

// Report tells the lease service how target treated the proxy of lease.
func (l *Leaser) Report(ctx context.Context, leaseID string, outcome leasev1.Outcome, target string, scope Scope) error {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.CallTimeout)
	defer cancel()
	req := &leasev1.ReportOutcomeRequest{LeaseId: leaseID, Outcome: outcome, TargetHost: target,
		Scope: leasev1.CooldownScope_COOLDOWN_SCOPE_TARGET}
	if scope == GlobalScope {
		req.Scope = leasev1.CooldownScope_COOLDOWN_SCOPE_GLOBAL
	}
	start := time.Now()
	resp, err := l.Client.ReportOutcome(cctx, req)
	l.observe("report", start)
	if err != nil {
		l.Log.Warn("reporting an outcome failed", "lease_id", leaseID, "outcome", outcome.String(), "error", status.Convert(err).Message())
		return err
	}
	if l.Reservoir != nil && resp.GetCooldown() != nil {
		l.Reservoir.reported(leaseID, resp.GetCooldown())
	}
	return nil
}

// SessionLease returns the live lease of a client's session, acquiring
// with its key and no target or selector (so the session does not move),
// and whether the session already had it (false: the acquire started the
// session anew, and the caller may want to release it).
func (l *Leaser) SessionLease(ctx context.Context, clientID, sessionID string) (*Lease, bool, error) {
	lease, err := l.acquire(ctx, &leasev1.AcquireLeaseRequest{
		SessionKey: options.SessionKey(clientID, sessionID),
		Ttl:        durationpb.New(l.SessionLifetime),
	})
	if err != nil {
		return nil, false, err
	}
	return lease, lease.Result == leasev1.SessionResult_SESSION_RESULT_EXISTING, nil
}
