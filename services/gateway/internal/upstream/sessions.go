package upstream

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
)

// minRenewTTL is the lease service's shortest TTL: a session whose
// lifetime left is shorter is no longer confirmed from the cache.
const minRenewTTL = 5 * time.Second

// sessionEntry is a session's lease as the last acquire answered it.
type sessionEntry struct {
	lease *Lease
	// life is the session's lifetime: its lease ends life after its last
	// request.
	life      time.Duration
	confirmed time.Time
	lastUse   time.Time
	// usedSince: a request used the entry since its last renewal.
	usedSince bool
	renewing  bool
	ended     bool
}

// sessionKey is a session acquire's request without its target: a
// request with another selector or lifetime goes to the lease service.
func sessionKey(req *leasev1.AcquireLeaseRequest) string {
	cp := proto.CloneOf(req)
	cp.TargetHost = ""
	key, _ := proto.MarshalOptions{Deterministic: true}.Marshal(cp)
	return string(key)
}

// session answers a session's request from its cached lease when the
// fleet view is trusted, the lease was confirmed within the bound, has
// not ended, is younger than SessionMaxAge and its proxy cools down
// neither for target nor globally; nil otherwise.
func (r *Reservoir) session(req *leasev1.AcquireLeaseRequest) *Lease {
	trusted, since := r.Fleet.Trusted()
	if !trusted {
		return nil
	}
	now := time.Now()
	key := sessionKey(req)
	r.mu.Lock()
	e := r.sessions[key]
	if e == nil || e.ended || e.confirmed.Before(since) || now.Sub(e.confirmed) > 2*r.ConfirmInterval ||
		r.Leaser.SessionMaxAge > 0 && now.Sub(e.lease.AcquireTime) > r.Leaser.SessionMaxAge {
		r.mu.Unlock()
		return nil
	}
	lease := *e.lease
	r.mu.Unlock()
	if r.Fleet.Cooldowns.Cooling(lease.ProxyUID, req.GetTargetHost(), now) {
		return nil
	}
	r.mu.Lock()
	e.lastUse, e.usedSince = now, true
	r.mu.Unlock()
	lease.Result = leasev1.SessionResult_SESSION_RESULT_EXISTING
	lease.MovedFrom, lease.MoveReason, lease.Joined = "", "", false
	return &lease
}

// sessionAcquired records the lease an acquire of the session answered,
// confirmed as of sent.
func (r *Reservoir) sessionAcquired(req *leasev1.AcquireLeaseRequest, lease *Lease, sent time.Time) {
	key := sessionKey(req)
	cp := *lease
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.sessions == nil {
		r.sessions = map[string]*sessionEntry{}
		r.sessionOf = map[string]string{}
	}
	if old := r.sessions[key]; old != nil {
		delete(r.sessionOf, old.lease.ID)
	}
	r.sessions[key] = &sessionEntry{lease: &cp, life: req.GetTtl().AsDuration(), confirmed: sent, lastUse: time.Now()}
	r.sessionOf[lease.ID] = key
}

// sessionEnded forgets the session whose lease ended; r.mu is held.
func (r *Reservoir) sessionEnded(leaseID string) {
	key, ok := r.sessionOf[leaseID]
	if !ok {
		return
	}
	delete(r.sessionOf, leaseID)
	if e := r.sessions[key]; e != nil && e.lease.ID == leaseID {
		e.ended = true
		delete(r.sessions, key)
	}
}

// sessionsToRenew picks the cached sessions used since their last
// renewal and due; the others are forgotten once unconfirmed (their next
// request acquires). r.mu is held.
func (r *Reservoir) sessionsToRenew(now time.Time, tick time.Duration) []*sessionEntry {
	var out []*sessionEntry
	for key, e := range r.sessions {
		switch {
		case e.renewing:
		case now.Sub(e.confirmed) > 2*r.ConfirmInterval:
			delete(r.sessions, key)
			delete(r.sessionOf, e.lease.ID)
		case e.usedSince && now.Sub(e.confirmed) >= r.ConfirmInterval-tick:
			e.renewing, e.usedSince = true, false
			out = append(out, e)
		}
	}
	return out
}

// confirmSession renews a session's lease to end its lifetime after the
// session's last request, as the acquire of that request would have; a
// renewal refused drops it, so the next request acquires (and moves the
// session when its proxy is gone).
func (r *Reservoir) confirmSession(ctx context.Context, e *sessionEntry) {
	r.mu.Lock()
	ttl := e.life - time.Since(e.lastUse)
	r.mu.Unlock()
	if ttl < minRenewTTL {
		r.mu.Lock()
		e.renewing = false
		r.sessionEnded(e.lease.ID)
		r.mu.Unlock()
		return
	}
	sent := time.Now()
	cctx, cancel := context.WithTimeout(ctx, r.Leaser.CallTimeout)
	start := time.Now()
	_, err := r.Leaser.Client.RenewLease(cctx, &leasev1.RenewLeaseRequest{LeaseId: e.lease.ID, Ttl: durationpb.New(ttl.Round(time.Millisecond))})
	r.Leaser.observe("renew", start)
	cancel()
	r.mu.Lock()
	defer r.mu.Unlock()
	e.renewing = false
	switch status.Code(err) {
	case codes.OK:
		e.confirmed = sent
	case codes.FailedPrecondition, codes.NotFound:
		r.sessionEnded(e.lease.ID)
	}
}
