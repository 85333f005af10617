package web

import (
	"context"
	"fmt"
	"html/template"
	"net/http"
	"sort"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

var funcs = template.FuncMap{
	"phase":     phaseName,
	"time":      fmtTime,
	"ago":       ago,
	"dur":       fmtDur,
	"readiness": readinessName,
	"outcome":   outcomeName,
	"cond":      func(s proxyv1.ConditionStatus) string { return strings.TrimPrefix(s.String(), "CONDITION_STATUS_") },
	"labels":    labelString,
	"pct": func(n, of int) string {
		if of == 0 {
			return "–"
		}
		return fmt.Sprintf("%.0f%%", 100*float64(n)/float64(of))
	},
	"rate": fmtRate,
	"phases": func() []string {
		out := make([]string, len(phaseOrder))
		for i, p := range phaseOrder {
			out[i] = phaseName(p)
		}
		return out
	},
}

func phaseName(p proxyv1.ProxyPhase) string {
	s := strings.TrimPrefix(p.String(), "PROXY_PHASE_")
	if s == "" || s == "UNSPECIFIED" {
		return "Unknown"
	}
	return s[:1] + strings.ToLower(s[1:])
}

func readinessName(r healthv1.ProviderReadiness) string {
	switch r {
	case healthv1.ProviderReadiness_PROVIDER_READINESS_READY:
		return "Ready"
	case healthv1.ProviderReadiness_PROVIDER_READINESS_NOT_READY:
		return "NotReady"
	case healthv1.ProviderReadiness_PROVIDER_READINESS_UNKNOWN:
		return "Unknown"
	}
	return "Unchecked"
}

func outcomeName(o leasev1.Outcome) string {
	s := strings.TrimPrefix(o.String(), "OUTCOME_")
	return strings.ToLower(s)
}

func fmtTime(ts *timestamppb.Timestamp) string {
	if ts == nil {
		return "–"
	}
	return ts.AsTime().UTC().Format("2006-01-02 15:04:05Z")
}

func ago(ts *timestamppb.Timestamp) string {
	if ts == nil {
		return "–"
	}
	d := time.Since(ts.AsTime())
	switch {
	case d < 0:
		return "in " + (-d).Round(time.Second).String()
	case d < time.Minute:
		return fmt.Sprintf("%ds ago", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm ago", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh ago", int(d.Hours()))
	}
	return fmt.Sprintf("%dd ago", int(d.Hours()/24))
}

func fmtDur(d *durationpb.Duration) string {
	if d == nil {
		return "–"
	}
	v := d.AsDuration()
	if v < time.Second {
		return v.Round(10 * time.Microsecond).String()
	}
	return v.Round(time.Millisecond).String()
}

func labelString(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + m[k]
	}
	return strings.Join(parts, ", ")
}

// count is one bar of a breakdown.
type count struct {
	Name  string
	N     int
	Ready int
}

func counts(m map[string]*count) []*count {
	out := make([]*count, 0, len(m))
	for _, c := range m {
		out = append(out, c)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].N != out[j].N {
			return out[i].N > out[j].N
		}
		return out[i].Name < out[j].Name
	})
	return out
}

func bump(m map[string]*count, name string, ready bool) {
	c := m[name]
	if c == nil {
		c = &count{Name: name}
		m[name] = c
	}
	c.N++
	if ready {
		c.Ready++
	}
}

// overviewData is the Overview page.
type overviewData struct {
	Total, Healthy, Ready, Draining int
	ByPhase, ByProvider, ByPool     []*count
	Leases                          int
	ByClient                        []*count
	Providers                       []*healthv1.ProviderHealth
	Pools                           int
	Gateway                         *GatewayRates
	Problems                        []string
}

var phaseOrder = []proxyv1.ProxyPhase{
	proxyv1.ProxyPhase_PROXY_PHASE_READY, proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING,
	proxyv1.ProxyPhase_PROXY_PHASE_PENDING, proxyv1.ProxyPhase_PROXY_PHASE_FAILED, proxyv1.ProxyPhase_PROXY_PHASE_DELETING,
}

func (f *fleet) overview() overviewData {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := overviewData{Total: len(f.proxies), Leases: len(f.leases), Providers: f.providers, Pools: len(f.pools), Gateway: f.gateway}
	phases := map[proxyv1.ProxyPhase]int{}
	byProvider, byPool, byClient := map[string]*count{}, map[string]*count{}, map[string]*count{}
	for _, p := range f.proxies {
		st := p.GetStatus()
		ready := st.GetPhase() == proxyv1.ProxyPhase_PROXY_PHASE_READY
		phases[st.GetPhase()]++
		if st.GetHealthy() {
			d.Healthy++
		}
		if ready {
			d.Ready++
		}
		if p.GetDraining() {
			d.Draining++
		}
		provider := p.GetSpec().GetProvider()
		if provider == "" {
			provider = "(external)"
		}
		bump(byProvider, provider, ready)
		pool := p.GetPool()
		if pool == "" {
			pool = "(none)"
		}
		bump(byPool, pool, ready)
	}
	for _, ph := range phaseOrder {
		d.ByPhase = append(d.ByPhase, &count{Name: phaseName(ph), N: phases[ph]})
	}
	for _, l := range f.leases {
		bump(byClient, l.GetClientId(), false)
	}
	d.ByProvider, d.ByPool, d.ByClient = counts(byProvider), counts(byPool), counts(byClient)
	d.Problems = f.problemList()
	return d
}

func (s *Server) overview(ctx context.Context, _ *http.Request, sess *session) (string, any, error) {
	f, err := s.load(ctx, sess, overviewNeed)
	if err != nil {
		return "", nil, err
	}
	return "Overview", f.overview(), nil
}

var overviewNeed = need{proxies: true, pools: true, leases: true, providers: true, gateway: true}

// proxiesData is the Proxies page: the table fills itself from the event
// stream; the forms need the providers.
type proxiesData struct {
	Providers []*proxyv1.Provider
}

func (s *Server) proxies(ctx context.Context, _ *http.Request, sess *session) (string, any, error) {
	resp, err := s.api.Proxies.ListProviders(ctx, &proxyv1.ListProvidersRequest{}, as(sess))
	if err != nil {
		return "", nil, fromAPI("the orchestrator", err)
	}
	return "Proxies", proxiesData{Providers: resp.GetProviders()}, nil
}

// step is one entry of a proxy's timeline: a change of its phase, health,
// reason or draining.
type step struct {
	Time    *timestamppb.Timestamp
	Phase   string
	Healthy bool
	Reason  string
	Message string
	What    string
}

// proxyData is a proxy's page.
type proxyData struct {
	Proxy     *proxyv1.Proxy
	CloudInit string
	Admin     bool
	Timeline  []step
	Leases    []*leasev1.Lease
	Cooldowns []*leasev1.ProxyCooldown
	Gone      bool
	Problems  []string
}

func (f *fleet) proxyPage(name string, admin bool) proxyData {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := proxyData{Proxy: f.proxies[name], Admin: admin}
	if d.Proxy == nil {
		d.Gone = true
	}
	d.CloudInit = f.cloudInit
	d.Timeline = timeline(f.timeline)
	for _, l := range f.leases {
		if l.GetProxyName() == name || (d.Proxy != nil && l.GetProxyUid() == d.Proxy.GetUid()) {
			d.Leases = append(d.Leases, l)
		}
	}
	sort.Slice(d.Leases, func(i, j int) bool { return d.Leases[i].GetLeaseId() < d.Leases[j].GetLeaseId() })
	now := time.Now()
	for _, c := range f.cooldowns {
		if c.GetCooldown().GetExpireTime().AsTime().After(now) {
			d.Cooldowns = append(d.Cooldowns, c)
		}
	}
	d.Problems = f.problemList()
	return d
}

// timeline keeps, from a proxy's changes (newest first), those where its
// phase, health, reason or draining changed; newest first.
func timeline(changes []*proxyv1.WatchProxiesResponse) []step {
	var out []step
	var prev *proxyv1.Proxy
	for i := len(changes) - 1; i >= 0; i-- {
		c := changes[i]
		p := c.GetProxy()
		st := p.GetStatus()
		var what []string
		switch {
		case c.GetType() == proxyv1.ChangeType_CHANGE_TYPE_CREATED || prev == nil:
			what = append(what, "created")
		case c.GetType() == proxyv1.ChangeType_CHANGE_TYPE_DELETED:
			what = append(what, "deleted")
		default:
			if st.GetPhase() != prev.GetStatus().GetPhase() {
				what = append(what, phaseName(prev.GetStatus().GetPhase())+" → "+phaseName(st.GetPhase()))
			}
			if st.GetHealthy() != prev.GetStatus().GetHealthy() {
				what = append(what, map[bool]string{true: "healthy", false: "unhealthy"}[st.GetHealthy()])
			}
			if p.GetDraining() != prev.GetDraining() {
				what = append(what, map[bool]string{true: "draining", false: "draining cancelled"}[p.GetDraining()])
			}
			if st.GetReason() != prev.GetStatus().GetReason() && len(what) == 0 {
				what = append(what, "reason "+st.GetReason())
			}
		}
		prev = p
		if len(what) == 0 {
			continue
		}
		out = append(out, step{Time: c.GetChangeTime(), Phase: phaseName(st.GetPhase()), Healthy: st.GetHealthy(),
			Reason: st.GetReason(), Message: st.GetMessage(), What: strings.Join(what, ", ")})
	}
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	return out
}

func proxyNeed(name string) need { return need{proxy: name, leases: true, cooldowns: true} }

func (s *Server) proxy(ctx context.Context, r *http.Request, sess *session) (string, any, error) {
	name := r.PathValue("name")
	f, err := s.load(ctx, sess, proxyNeed(name))
	if err != nil {
		return "", nil, err
	}
	return "Proxy " + name, f.proxyPage(name, sess.has("admin")), nil
}

// poolsData is the Pools page.
type poolsData struct {
	Pools     []*proxyv1.ProxyPool
	Providers []*proxyv1.Provider
	Problems  []string
}

func (f *fleet) poolsPage() poolsData {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := poolsData{Providers: f.configured}
	for _, p := range f.pools {
		d.Pools = append(d.Pools, p)
	}
	sort.Slice(d.Pools, func(i, j int) bool { return d.Pools[i].GetName() < d.Pools[j].GetName() })
	d.Problems = f.problemList()
	return d
}

func (s *Server) pools(ctx context.Context, _ *http.Request, sess *session) (string, any, error) {
	f, err := s.load(ctx, sess, need{pools: true})
	if err != nil {
		return "", nil, err
	}
	resp, err := s.api.Proxies.ListProviders(ctx, &proxyv1.ListProvidersRequest{}, as(sess))
	if err != nil {
		return "", nil, fromAPI("the orchestrator", err)
	}
	f.configured = resp.GetProviders()
	return "Pools", f.poolsPage(), nil
}

// poolData is one pool's page.
type poolData struct {
	Pool     *proxyv1.ProxyPool
	Name     string
	Proxies  []*proxyv1.Proxy
	Problems []string
}

func (f *fleet) poolPage(name string) poolData {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := poolData{Pool: f.pools[name], Name: name}
	for _, p := range f.sortedProxies() {
		if p.GetPool() == name {
			d.Proxies = append(d.Proxies, p)
		}
	}
	d.Problems = f.problemList()
	return d
}

func (s *Server) pool(ctx context.Context, r *http.Request, sess *session) (string, any, error) {
	name := r.PathValue("name")
	if _, err := s.api.Pools.GetProxyPool(ctx, &proxyv1.GetProxyPoolRequest{Name: name}, as(sess)); err != nil {
		return "", nil, fromAPI("the orchestrator", err)
	}
	f, err := s.load(ctx, sess, need{pool: name})
	if err != nil {
		return "", nil, err
	}
	return "Pool " + name, f.poolPage(name), nil
}

// leasesData is the Leases page.
type leasesData struct {
	Leases                     []*leasev1.Lease
	ByClient, ByPool, ByTarget []*count
	Cooldowns                  []*leasev1.ProxyCooldown
	Problems                   []string
}

func (f *fleet) leasesPage() leasesData {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := leasesData{Leases: f.sortedLeases()}
	byClient, byPool, byTarget := map[string]*count{}, map[string]*count{}, map[string]*count{}
	for _, l := range d.Leases {
		bump(byClient, l.GetClientId(), false)
		pool := l.GetPool()
		if pool == "" {
			pool = "(none)"
		}
		bump(byPool, pool, false)
		target := l.GetTargetHost()
		if target == "" {
			target = "(any)"
		}
		bump(byTarget, target, false)
	}
	d.ByClient, d.ByPool, d.ByTarget = counts(byClient), counts(byPool), counts(byTarget)
	now := time.Now()
	for _, c := range f.cooldowns {
		if c.GetCooldown().GetExpireTime().AsTime().After(now) {
			d.Cooldowns = append(d.Cooldowns, c)
		}
	}
	d.Problems = f.problemList()
	return d
}

var leasesNeed = need{leases: true, cooldowns: true}

func (s *Server) leases(ctx context.Context, _ *http.Request, sess *session) (string, any, error) {
	f, err := s.load(ctx, sess, leasesNeed)
	if err != nil {
		return "", nil, err
	}
	return "Leases", f.leasesPage(), nil
}

// providersData is the Providers page: every configured provider with its
// latest backend check.
type providersData struct {
	Providers []providerRow
	Problems  []string
}

type providerRow struct {
	Name, Type string
	Health     *healthv1.ProviderHealth
}

func (f *fleet) providersPage() providersData {
	f.mu.Lock()
	defer f.mu.Unlock()
	var d providersData
	byName := map[string]*healthv1.ProviderHealth{}
	for _, h := range f.providers {
		byName[h.GetProvider()] = h
	}
	for _, p := range f.configured {
		d.Providers = append(d.Providers, providerRow{Name: p.GetName(), Type: p.GetType(), Health: byName[p.GetName()]})
	}
	d.Problems = f.problemList()
	return d
}

func (s *Server) providers(ctx context.Context, _ *http.Request, sess *session) (string, any, error) {
	f, err := s.load(ctx, sess, need{providers: true})
	if err != nil {
		return "", nil, err
	}
	return "Providers", f.providersPage(), nil
}
