// Package api serves egress.lease.v1.LeaseService: it validates requests,
// takes the client id from the bearer token, calls the store and maps its
// results onto gRPC statuses (and, through the REST layer error handler, onto
// HTTP: RESOURCE_EXHAUSTED becomes 409 with the NoProxyAvailable detail).
package api

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"log/slog"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/metrics"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/store"
)

// CooldownDefault is an outcome's cooldown when the report does not set
// one.
type CooldownDefault struct {
	Duration time.Duration
	Global   bool
}

// DefaultCooldowns are the documented defaults per outcome.
func DefaultCooldowns() map[leasev1.Outcome]CooldownDefault {
	return map[leasev1.Outcome]CooldownDefault{
		leasev1.Outcome_OUTCOME_SUCCESS: {},
		leasev1.Outcome_OUTCOME_BLOCKED: {Duration: 5 * time.Minute},
		leasev1.Outcome_OUTCOME_BANNED:  {Duration: time.Hour},
		leasev1.Outcome_OUTCOME_CAPTCHA: {Duration: 10 * time.Minute},
		leasev1.Outcome_OUTCOME_TIMEOUT: {Duration: time.Minute, Global: true},
		leasev1.Outcome_OUTCOME_ERROR:   {Duration: 30 * time.Second, Global: true},
	}
}

// Config are the API's bounds and defaults.
type Config struct {
	// MinTTL and MaxTTL bound a requested lease TTL; DefaultTTL is used
	// when the request sets none.
	MinTTL, DefaultTTL, MaxTTL time.Duration
	// MaxCooldown bounds a reported cooldown.
	MaxCooldown time.Duration
	// Cooldowns are the defaults per outcome.
	Cooldowns map[leasev1.Outcome]CooldownDefault
}

// DefaultConfig is the configuration the flags default to.
func DefaultConfig() Config {
	return Config{
		MinTTL:      5 * time.Second,
		DefaultTTL:  5 * time.Minute,
		MaxTTL:      time.Hour,
		MaxCooldown: 7 * 24 * time.Hour,
		Cooldowns:   DefaultCooldowns(),
	}
}

// Server implements leasev1.LeaseServiceServer.
type Server struct {
	leasev1.UnimplementedLeaseServiceServer
	// Feed relays committed lease changes to WatchLeases; nil: WatchLeases
	// is UNAVAILABLE.
	Feed *Feed
	// Credentials fetches the leased proxy's credentials for the
	// acquire's answer; nil: answers carry none.
	Credentials CredentialsSource
	// CredentialsCache, when set, keeps the Credentials answers until the
	// mirror changes their proxy.
	CredentialsCache *CredentialsCache

	st  *store.Store
	cfg Config
	met *metrics.Metrics
	log *slog.Logger
}

// New returns the API over st.
func New(st *store.Store, cfg Config, met *metrics.Metrics, log *slog.Logger) *Server {
	if cfg.Cooldowns == nil {
		cfg.Cooldowns = DefaultCooldowns()
	}
	return &Server{st: st, cfg: cfg, met: met, log: log}
}

func (s *Server) observe(method string, start time.Time, err *error) {
	s.met.Duration.WithLabelValues(method, status.Code(*err).String()).Observe(time.Since(start).Seconds())
}

func clientID(ctx context.Context) (string, error) {
	id := auth.ClientID(ctx)
	if id == "" {
		return "", status.Error(codes.Unauthenticated, "no client identity: send `Authorization: Bearer <token>`")
	}
	return id, nil
}

// ListProxies implements leasev1.LeaseServiceServer.
func (s *Server) ListProxies(ctx context.Context, req *leasev1.ListProxiesRequest) (resp *leasev1.ListProxiesResponse, err error) {
	defer s.observe("ListProxies", time.Now(), &err)
	if _, err = clientID(ctx); err != nil {
		return nil, err
	}
	sel, err := selector(req.GetSelector())
	if err != nil {
		return nil, err
	}
	var after proxyPageToken
	if t := req.GetPageToken(); t != "" {
		raw, derr := base64.RawURLEncoding.DecodeString(t)
		switch {
		case derr != nil || json.Unmarshal(raw, &after) != nil:
			return nil, invalid("page_token", "is not a token of this listing")
		case after.Selector != selectorKey(sel):
			return nil, invalid("page_token", "was issued for another selector; keep the selector the same across pages")
		}
	}
	limit := int(req.GetPageSize()) // 0: every proxy, one reply
	fetch := 0
	if limit > 0 {
		fetch = limit + 1
	}
	proxies, err := s.st.List(ctx, sel, after.ProxyCursor, fetch)
	if err != nil {
		return nil, s.internal(ctx, "ListProxies", err)
	}
	resp = &leasev1.ListProxiesResponse{}
	if limit > 0 && len(proxies) > limit {
		proxies = proxies[:limit]
		last := proxies[limit-1]
		raw, _ := json.Marshal(proxyPageToken{ProxyCursor: store.ProxyCursor{Name: last.Name, UID: last.UID}, Selector: selectorKey(sel)})
		resp.NextPageToken = base64.RawURLEncoding.EncodeToString(raw)
	}
	resp.Proxies = make([]*leasev1.LeasableProxy, 0, len(proxies))
	for _, p := range proxies {
		free := int32(-1)
		if p.MaxLeases > 0 {
			free = int32(max(p.MaxLeases-p.ActiveLeases, 0))
		}
		lp := &leasev1.LeasableProxy{
			ProxyUid:     p.UID,
			ProxyName:    p.Name,
			Provider:     p.Provider,
			Region:       p.Region,
			Zone:         p.Zone,
			Labels:       p.Labels,
			Address:      address(p.Host, p.Port),
			MaxLeases:    uint32(p.MaxLeases),
			ActiveLeases: uint32(p.ActiveLeases),
			FreeCapacity: free,
		}
		if p.LastLeaseTime != nil {
			lp.LastLeaseTime = timestamppb.New(*p.LastLeaseTime)
		}
		for _, c := range p.Cooldowns {
			lp.Cooldowns = append(lp.Cooldowns, cooldown(c))
		}
		resp.Proxies = append(resp.Proxies, lp)
	}
	return resp, nil
}

// proxyPageToken is a ListProxies page token: where the page ended, and
// the selector it was for.
type proxyPageToken struct {
	store.ProxyCursor
	Selector string `json:"s"`
}

// selectorKey names a selector in a page token: a short hash, so that the
// token stays within its 1024 bytes whatever the labels.
func selectorKey(sel store.Selector) string {
	b, _ := json.Marshal([]any{sel.Provider, sel.Region, sel.Zone, sel.Pool, sel.Labels})
	sum := sha256.Sum256(b)
	return base64.RawURLEncoding.EncodeToString(sum[:12])
}

// ListLeases implements leasev1.LeaseServiceServer.
func (s *Server) ListLeases(ctx context.Context, req *leasev1.ListLeasesRequest) (resp *leasev1.ListLeasesResponse, err error) {
	defer s.observe("ListLeases", time.Now(), &err)
	after := ""
	if req.GetPageToken() != "" {
		if after, err = leaseID(req.GetPageToken()); err != nil {
			return nil, invalid("page_token", "is not a token of this listing")
		}
	}
	target, err := targetHost(req.GetTargetHost())
	if err != nil {
		return nil, err
	}
	limit := pageSize(req.GetPageSize())
	leases, err := s.st.ListLeases(ctx, store.LeaseFilter{
		ClientID: req.GetClientId(), Pool: req.GetPool(), TargetHost: target, ProxyName: req.GetProxyName(),
		SessionKey: req.GetSessionKey(),
	}, after, limit+1)
	if err != nil {
		return nil, s.internal(ctx, "ListLeases", err)
	}
	resp = &leasev1.ListLeasesResponse{}
	if len(leases) > limit {
		leases = leases[:limit]
		resp.NextPageToken = leases[limit-1].ID
	}
	for _, l := range leases {
		resp.Leases = append(resp.Leases, lease(l))
	}
	return resp, nil
}

// ListCooldowns implements leasev1.LeaseServiceServer.
func (s *Server) ListCooldowns(ctx context.Context, req *leasev1.ListCooldownsRequest) (resp *leasev1.ListCooldownsResponse, err error) {
	defer s.observe("ListCooldowns", time.Now(), &err)
	var after store.CooldownCursor
	if t := req.GetPageToken(); t != "" {
		raw, derr := base64.RawURLEncoding.DecodeString(t)
		if derr != nil || json.Unmarshal(raw, &after) != nil {
			return nil, invalid("page_token", "is not a token of this listing")
		}
	}
	limit := pageSize(req.GetPageSize())
	cs, err := s.st.ListCooldowns(ctx, req.GetProxyName(), req.GetPool(), after, limit+1)
	if err != nil {
		return nil, s.internal(ctx, "ListCooldowns", err)
	}
	resp = &leasev1.ListCooldownsResponse{}
	if len(cs) > limit {
		cs = cs[:limit]
		last := cs[limit-1]
		raw, _ := json.Marshal(store.CooldownCursor{ProxyName: last.ProxyName, ProxyUID: last.ProxyUID, TargetHost: last.TargetHost})
		resp.NextPageToken = base64.RawURLEncoding.EncodeToString(raw)
	}
	for _, c := range cs {
		resp.Cooldowns = append(resp.Cooldowns, &leasev1.ProxyCooldown{
			ProxyUid: c.ProxyUID, ProxyName: c.ProxyName, Pool: c.Pool, Cooldown: cooldown(c.Cooldown),
		})
	}
	return resp, nil
}

// pageSize is a listing's page size: 0 means 100 (the contract bounds it
// to 1000).
func pageSize(n int32) int {
	if n <= 0 {
		return 100
	}
	return int(n)
}

// AcquireLease implements leasev1.LeaseServiceServer.
func (s *Server) AcquireLease(ctx context.Context, req *leasev1.AcquireLeaseRequest) (resp *leasev1.AcquireLeaseResponse, err error) {
	defer s.observe("AcquireLease", time.Now(), &err)
	result := "error"
	defer func() { s.met.Acquires.WithLabelValues(result).Inc() }()
	client, err := clientID(ctx)
	if err != nil {
		return nil, err
	}
	target, err := targetHost(req.GetTargetHost())
	if err != nil {
		result = "invalid_argument"
		return nil, err
	}
	ttl, err := s.ttl(req.GetTtl())
	if err != nil {
		result = "invalid_argument"
		return nil, err
	}
	sel, err := selector(req.GetSelector())
	if err != nil {
		result = "invalid_argument"
		return nil, err
	}
	g, err := s.st.Acquire(ctx, store.AcquireRequest{
		ClientID: client, TargetHost: target, TTL: ttl, Selector: sel, SessionKey: req.GetSessionKey(),
	})
	var none *store.NoProxyError
	if errors.As(err, &none) {
		result = none.Reason()
		// The pool's demand: the publisher reports the refusal to the
		// pool's controller. Counting is best effort; the answer stands.
		if pool := sel.Pool; pool != "" || sel.Labels["pool"] != "" {
			if pool == "" {
				pool = sel.Labels["pool"]
			}
			if err := s.st.CountRefusal(ctx, pool); err != nil {
				s.log.Warn("counting a refused acquire for its pool failed", "pool", pool, "error", err)
			}
		}
		return nil, noProxyStatus(none)
	}
	if err != nil {
		return nil, s.internal(ctx, "AcquireLease", err)
	}
	creds, err := s.credentialsFor(ctx, g.Lease.ProxyUID)
	if err != nil {
		// Without its credentials the lease is of no use: give it back,
		// so that nothing is half done, and let the client retry.
		s.log.Warn("fetching the leased proxy's credentials from the orchestrator failed; releasing the lease",
			"proxy_name", g.Lease.ProxyName, "lease_id", g.Lease.ID, "error", err)
		if _, rerr := s.st.Release(ctx, client, g.Lease.ID); rerr != nil {
			s.log.Warn("releasing the lease failed; it expires at its ttl", "lease_id", g.Lease.ID, "error", rerr)
		}
		result = "credentials_unavailable"
		return nil, status.Error(codes.Unavailable, "the proxy's credentials could not be fetched from the orchestrator; retry")
	}
	result = "granted"
	resp = &leasev1.AcquireLeaseResponse{Lease: lease(g.Lease), Credentials: creds,
		ProxyUrl: proxyURL(g.Lease.Host, g.Lease.Port, creds)}
	switch g.Session {
	case store.NoSession:
	case store.SessionNew:
		s.met.Sessions.WithLabelValues("new").Inc()
	case store.SessionExisting:
		s.met.Sessions.WithLabelValues("existing").Inc()
	case store.SessionMoved:
		s.met.Sessions.WithLabelValues("moved").Inc()
		s.met.SessionMoves.WithLabelValues(string(g.Moved.Reason)).Inc()
	}
	if g.Session != store.NoSession {
		resp.Session = session(g)
	}
	return resp, nil
}

// RenewLease implements leasev1.LeaseServiceServer.
func (s *Server) RenewLease(ctx context.Context, req *leasev1.RenewLeaseRequest) (resp *leasev1.RenewLeaseResponse, err error) {
	defer s.observe("RenewLease", time.Now(), &err)
	client, err := clientID(ctx)
	if err != nil {
		return nil, err
	}
	id, err := leaseID(req.GetLeaseId())
	if err != nil {
		return nil, err
	}
	ttl, err := s.ttl(req.GetTtl())
	if err != nil {
		return nil, err
	}
	l, err := s.st.Renew(ctx, client, id, ttl)
	if err != nil {
		return nil, s.leaseError(ctx, "RenewLease", err)
	}
	return &leasev1.RenewLeaseResponse{Lease: lease(l)}, nil
}

// ReleaseLease implements leasev1.LeaseServiceServer.
func (s *Server) ReleaseLease(ctx context.Context, req *leasev1.ReleaseLeaseRequest) (resp *leasev1.ReleaseLeaseResponse, err error) {
	defer s.observe("ReleaseLease", time.Now(), &err)
	client, err := clientID(ctx)
	if err != nil {
		return nil, err
	}
	id, err := leaseID(req.GetLeaseId())
	if err != nil {
		return nil, err
	}
	released, err := s.st.Release(ctx, client, id)
	if err != nil {
		return nil, s.leaseError(ctx, "ReleaseLease", err)
	}
	if released {
		s.met.Releases.WithLabelValues("released").Inc()
	} else {
		s.met.Releases.WithLabelValues("already_ended").Inc()
	}
	return &leasev1.ReleaseLeaseResponse{Released: released}, nil
}

// ReportOutcome implements leasev1.LeaseServiceServer.
func (s *Server) ReportOutcome(ctx context.Context, req *leasev1.ReportOutcomeRequest) (resp *leasev1.ReportOutcomeResponse, err error) {
	defer s.observe("ReportOutcome", time.Now(), &err)
	client, err := clientID(ctx)
	if err != nil {
		return nil, err
	}
	id, err := leaseID(req.GetLeaseId())
	if err != nil {
		return nil, err
	}
	def, ok := s.cfg.Cooldowns[req.GetOutcome()]
	if !ok || req.GetOutcome() == leasev1.Outcome_OUTCOME_UNSPECIFIED {
		return nil, invalid("outcome", "must be one of OUTCOME_SUCCESS, OUTCOME_BLOCKED, OUTCOME_BANNED, OUTCOME_CAPTCHA, OUTCOME_TIMEOUT, OUTCOME_ERROR")
	}
	length := def.Duration
	if req.Cooldown != nil {
		if err := req.GetCooldown().CheckValid(); err != nil {
			return nil, invalid("cooldown", "is not a valid duration")
		}
		length = req.GetCooldown().AsDuration()
		if length < 0 || length > s.cfg.MaxCooldown {
			return nil, invalid("cooldown", "must be between 0s and "+s.cfg.MaxCooldown.String())
		}
	}
	global := def.Global
	switch req.GetScope() {
	case leasev1.CooldownScope_COOLDOWN_SCOPE_UNSPECIFIED:
	case leasev1.CooldownScope_COOLDOWN_SCOPE_TARGET:
		global = false
	case leasev1.CooldownScope_COOLDOWN_SCOPE_GLOBAL:
		global = true
	default:
		return nil, invalid("scope", "must be COOLDOWN_SCOPE_TARGET or COOLDOWN_SCOPE_GLOBAL")
	}
	reportTarget, err := targetHost(req.GetTargetHost())
	if err != nil {
		return nil, err
	}
	c, err := s.st.Report(ctx, store.ReportRequest{
		ClientID: client, LeaseID: id, Outcome: int16(req.GetOutcome()), Cooldown: length, Global: global, TargetHost: reportTarget,
	})
	if err != nil {
		return nil, s.leaseError(ctx, "ReportOutcome", err)
	}
	s.met.Reports.WithLabelValues(outcomeLabel(req.GetOutcome())).Inc()
	resp = &leasev1.ReportOutcomeResponse{}
	if c != nil {
		resp.Cooldown = cooldown(*c)
	}
	return resp, nil
}

func outcomeLabel(o leasev1.Outcome) string {
	switch o {
	case leasev1.Outcome_OUTCOME_SUCCESS:
		return "success"
	case leasev1.Outcome_OUTCOME_BLOCKED:
		return "blocked"
	case leasev1.Outcome_OUTCOME_BANNED:
		return "banned"
	case leasev1.Outcome_OUTCOME_CAPTCHA:
		return "captcha"
	case leasev1.Outcome_OUTCOME_TIMEOUT:
		return "timeout"
	default:
		return "error"
	}
}

func (s *Server) ttl(d *durationpb.Duration) (time.Duration, error) {
	if d == nil {
		return s.cfg.DefaultTTL, nil
	}
	if err := d.CheckValid(); err != nil {
		return 0, invalid("ttl", "is not a valid duration")
	}
	ttl := d.AsDuration()
	if ttl < s.cfg.MinTTL || ttl > s.cfg.MaxTTL {
		return 0, invalid("ttl", "must be between "+s.cfg.MinTTL.String()+" and "+s.cfg.MaxTTL.String())
	}
	return ttl, nil
}

// leaseError maps a store error of an operation on one lease.
func (s *Server) leaseError(ctx context.Context, method string, err error) error {
	switch {
	case errors.Is(err, store.ErrNotFound):
		return status.Error(codes.NotFound, "lease not found")
	case errors.Is(err, store.ErrEnded):
		return status.Error(codes.NotFound, "lease has expired or was released")
	case errors.Is(err, store.ErrNotOwner):
		return status.Error(codes.PermissionDenied, "the lease belongs to another client")
	case errors.Is(err, store.ErrProxyGone):
		return status.Error(codes.FailedPrecondition, "the leased proxy is no longer Ready and healthy; release the lease and acquire another")
	}
	return s.internal(ctx, method, err)
}

// internal maps an unexpected error: cancellation and deadlines keep their
// codes; anything else is logged and returned as UNAVAILABLE, a transient
// failure the client may retry.
func (s *Server) internal(ctx context.Context, method string, err error) error {
	switch {
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, "request canceled")
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, "deadline exceeded")
	}
	s.log.ErrorContext(ctx, "lease store failed", "method", method, "error", err)
	return status.Error(codes.Unavailable, "the lease database is unavailable; retry")
}

func noProxyStatus(e *store.NoProxyError) error {
	st := status.New(codes.ResourceExhausted, e.Error())
	d, err := st.WithDetails(&leasev1.NoProxyAvailable{
		Matching:          int32(e.Matching),
		Unhealthy:         int32(e.Unhealthy),
		AtCapacity:        int32(e.AtCapacity),
		CoolingDownTarget: int32(e.CoolingTarget),
		CoolingDownGlobal: int32(e.CoolingGlobal),
	})
	if err != nil {
		return st.Err()
	}
	return d.Err()
}

func address(host string, port uint32) *leasev1.ProxyAddress {
	return &leasev1.ProxyAddress{Host: host, Port: port, Scheme: "http"}
}

func lease(l store.Lease) *leasev1.Lease {
	return &leasev1.Lease{
		LeaseId:     l.ID,
		ClientId:    l.ClientID,
		ProxyUid:    l.ProxyUID,
		ProxyName:   l.ProxyName,
		Address:     address(l.Host, l.Port),
		TargetHost:  l.TargetHost,
		AcquireTime: timestamppb.New(l.AcquireTime),
		ExpireTime:  timestamppb.New(l.ExpireTime),
		Pool:        l.Pool,
		SessionKey:  l.SessionKey,
	}
}

var moveReasons = map[store.MoveReason]leasev1.SessionMoveReason{
	store.MoveDeleted:     leasev1.SessionMoveReason_SESSION_MOVE_REASON_PROXY_DELETED,
	store.MoveDraining:    leasev1.SessionMoveReason_SESSION_MOVE_REASON_PROXY_DRAINING,
	store.MoveUnhealthy:   leasev1.SessionMoveReason_SESSION_MOVE_REASON_PROXY_UNHEALTHY,
	store.MoveSelector:    leasev1.SessionMoveReason_SESSION_MOVE_REASON_SELECTOR_CHANGED,
	store.MoveCoolingDown: leasev1.SessionMoveReason_SESSION_MOVE_REASON_COOLING_DOWN,
}

func session(g store.Grant) *leasev1.Session {
	out := &leasev1.Session{}
	switch g.Session {
	case store.SessionNew:
		out.Result = leasev1.SessionResult_SESSION_RESULT_NEW
	case store.SessionExisting:
		out.Result = leasev1.SessionResult_SESSION_RESULT_EXISTING
	case store.SessionMoved:
		out.Result = leasev1.SessionResult_SESSION_RESULT_MOVED
		out.PreviousLeaseId = g.Moved.LeaseID
		out.PreviousProxyName = g.Moved.ProxyName
		out.MoveReason = moveReasons[g.Moved.Reason]
	}
	return out
}

func cooldown(c store.Cooldown) *leasev1.Cooldown {
	return &leasev1.Cooldown{
		TargetHost: c.TargetHost,
		ExpireTime: timestamppb.New(c.ExpireTime),
		Outcome:    leasev1.Outcome(c.Outcome),
	}
}
