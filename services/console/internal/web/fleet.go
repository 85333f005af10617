package web

import (
	"context"
	"sort"
	"sync"
	"time"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// need says which parts of the fleet a page shows.
type need struct {
	proxies   bool
	proxy     string // one proxy (its page): that proxy, its leases, cooldowns and timeline
	pool      string // one pool's proxies only
	pools     bool
	leases    bool
	cooldowns bool
	providers bool
	gateway   bool
}

// fleet is what one page shows, as the services last told it. A page
// load fills it with listings; an open page's event stream keeps it up to
// date with the watch streams and renders it again on every change.
type fleet struct {
	mu         sync.Mutex
	proxies    map[string]*proxyv1.Proxy // by name
	pools      map[string]*proxyv1.ProxyPool
	leases     map[string]*leasev1.Lease // by id
	cooldowns  []*leasev1.ProxyCooldown
	providers  []*healthv1.ProviderHealth
	configured []*proxyv1.Provider
	timeline   []*proxyv1.WatchProxiesResponse // newest first
	cloudInit  string                          // of the one proxy of a proxy's page, for an admin
	gateway    *GatewayRates
	problems   map[string]string // feed → what is wrong with it now
	now        time.Time
}

func newFleet() *fleet {
	return &fleet{proxies: map[string]*proxyv1.Proxy{}, pools: map[string]*proxyv1.ProxyPool{},
		leases: map[string]*leasev1.Lease{}, problems: map[string]string{}}
}

func (f *fleet) resetProxies(ps []*proxyv1.Proxy) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.proxies = make(map[string]*proxyv1.Proxy, len(ps))
	for _, p := range ps {
		f.proxies[p.GetName()] = p
	}
}

func (f *fleet) applyProxy(c *proxyv1.WatchProxiesResponse, only func(*proxyv1.Proxy) bool) bool {
	p := c.GetProxy()
	if only != nil && !only(p) {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if c.GetType() == proxyv1.ChangeType_CHANGE_TYPE_DELETED {
		if cur := f.proxies[p.GetName()]; cur != nil && cur.GetUid() == p.GetUid() {
			delete(f.proxies, p.GetName())
		}
	} else {
		f.proxies[p.GetName()] = p
	}
	return true
}

func (f *fleet) resetPools(ps []*proxyv1.ProxyPool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.pools = make(map[string]*proxyv1.ProxyPool, len(ps))
	for _, p := range ps {
		f.pools[p.GetName()] = p
	}
}

func (f *fleet) applyPool(c *proxyv1.WatchProxyPoolsResponse) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if c.GetType() == proxyv1.ChangeType_CHANGE_TYPE_DELETED {
		delete(f.pools, c.GetPool().GetName())
		return
	}
	f.pools[c.GetPool().GetName()] = c.GetPool()
}

func (f *fleet) resetLeases(ls []*leasev1.Lease) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.leases = make(map[string]*leasev1.Lease, len(ls))
	for _, l := range ls {
		f.leases[l.GetLeaseId()] = l
	}
}

// applyLease applies one lease change; it reports whether the change
// started a cooldown (the caller then reads the cooldowns again).
func (f *fleet) applyLease(c *leasev1.WatchLeasesResponse, only func(*leasev1.Lease) bool) (changed, cooled bool) {
	l := c.GetLease()
	f.mu.Lock()
	defer f.mu.Unlock()
	switch c.GetType() {
	case leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_ACQUIRED, leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RENEWED:
		if only != nil && !only(l) {
			return false, false
		}
		f.leases[l.GetLeaseId()] = l
		return true, false
	case leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RELEASED, leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_EXPIRED:
		_, had := f.leases[l.GetLeaseId()]
		delete(f.leases, l.GetLeaseId())
		return had, false
	case leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_REPORTED:
		return c.GetCooldown() != nil, c.GetCooldown() != nil
	}
	return false, false
}

func (f *fleet) setProblem(feed string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err == nil {
		delete(f.problems, feed)
		return
	}
	f.problems[feed] = err.Error()
}

// problemList says what is wrong with the feeds now, sorted (the caller
// holds mu).
func (f *fleet) problemList() []string {
	out := make([]string, 0, len(f.problems))
	for feed, p := range f.problems {
		out = append(out, feed+": "+p)
	}
	sort.Strings(out)
	return out
}

// load fills the fleet with one listing of each part a page needs.
func (s *Server) load(ctx context.Context, sess *session, n need) (*fleet, error) {
	f := newFleet()
	if n.proxies || n.pool != "" {
		req := &proxyv1.ListProxiesRequest{}
		if n.pool != "" {
			req.Labels = map[string]string{"pool": n.pool}
		}
		ps, _, err := s.listProxies(ctx, sess, req)
		if err != nil {
			return nil, err
		}
		f.resetProxies(ps)
	}
	if n.proxy != "" {
		resp, err := s.api.Proxies.GetProxy(ctx, s.proxyRequest(sess, n.proxy), as(sess))
		if err != nil {
			return nil, fromAPI("the orchestrator", err)
		}
		f.resetProxies([]*proxyv1.Proxy{resp.GetProxy()})
		f.cloudInit = resp.GetProxy().GetSpec().GetCloudInit()
		if err := s.loadTimeline(ctx, sess, f, n.proxy); err != nil {
			return nil, err
		}
	}
	if n.pools || n.pool != "" {
		ps, _, err := s.listPools(ctx, sess)
		if err != nil {
			return nil, err
		}
		f.resetPools(ps)
	}
	if n.leases {
		ls, err := s.listLeases(ctx, sess, &leasev1.ListLeasesRequest{ProxyName: n.proxy})
		if err != nil {
			return nil, err
		}
		f.resetLeases(ls)
	}
	if n.cooldowns {
		if err := s.loadCooldowns(ctx, sess, f, n.proxy); err != nil {
			return nil, err
		}
	}
	if n.providers {
		if err := s.loadProviders(ctx, sess, f); err != nil {
			return nil, err
		}
	}
	if n.gateway && s.cfg.Gateway != nil {
		f.gateway = s.cfg.Gateway.Rates(ctx)
	}
	return f, nil
}

// proxyRequest reads one proxy: with its cloud-init for an admin (the
// FULL view, which the orchestrator refuses anyone else), without for
// everyone else.
func (s *Server) proxyRequest(sess *session, name string) *proxyv1.GetProxyRequest {
	req := &proxyv1.GetProxyRequest{Name: name}
	if sess.has("admin") {
		req.View = proxyv1.ProxyView_PROXY_VIEW_FULL
	}
	return req
}

func (s *Server) loadTimeline(ctx context.Context, sess *session, f *fleet, name string) error {
	resp, err := s.api.Proxies.ListProxyChanges(ctx, &proxyv1.ListProxyChangesRequest{Name: name, PageSize: 200}, as(sess))
	if err != nil {
		return fromAPI("the orchestrator", err)
	}
	f.mu.Lock()
	f.timeline = resp.GetChanges()
	f.mu.Unlock()
	return nil
}

func (s *Server) loadCooldowns(ctx context.Context, sess *session, f *fleet, proxy string) error {
	cs, err := s.listCooldowns(ctx, sess, &leasev1.ListCooldownsRequest{ProxyName: proxy})
	if err != nil {
		return err
	}
	f.mu.Lock()
	f.cooldowns = cs
	f.mu.Unlock()
	return nil
}

func (s *Server) loadProviders(ctx context.Context, sess *session, f *fleet) error {
	conf, err := s.api.Proxies.ListProviders(ctx, &proxyv1.ListProvidersRequest{}, as(sess))
	if err != nil {
		return fromAPI("the orchestrator", err)
	}
	ph, err := s.listProviderHealth(ctx, sess)
	if err != nil {
		return err
	}
	f.mu.Lock()
	f.configured, f.providers = conf.GetProviders(), ph
	f.mu.Unlock()
	return nil
}

// sortedProxies returns the fleet's proxies by name (the caller holds mu).
func (f *fleet) sortedProxies() []*proxyv1.Proxy {
	out := make([]*proxyv1.Proxy, 0, len(f.proxies))
	for _, p := range f.proxies {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].GetName() < out[j].GetName() })
	return out
}

func (f *fleet) sortedLeases() []*leasev1.Lease {
	out := make([]*leasev1.Lease, 0, len(f.leases))
	for _, l := range f.leases {
		out = append(out, l)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].GetLeaseId() < out[j].GetLeaseId() })
	return out
}
