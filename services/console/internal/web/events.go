package web

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"time"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// sse writes one server-sent event stream.
type sse struct {
	mu sync.Mutex
	w  http.ResponseWriter
	rc *http.ResponseController
}

func startSSE(w http.ResponseWriter) *sse {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no") // proxies in front must not hold events back
	w.WriteHeader(http.StatusOK)
	e := &sse{w: w, rc: http.NewResponseController(w)}
	_ = e.rc.Flush()
	return e
}

// send writes one event; data is JSON, on one line.
func (e *sse) send(event string, data any) error {
	b, err := json.Marshal(data)
	if err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, err := fmt.Fprintf(e.w, "event: %s\ndata: %s\n\n", event, b); err != nil {
		return err
	}
	return e.rc.Flush()
}

func (e *sse) comment() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, err := e.w.Write([]byte(": keep-alive\n\n")); err != nil {
		return err
	}
	return e.rc.Flush()
}

// row is a proxy as the proxies table shows it.
type row struct {
	Name     string `json:"n"`
	Phase    string `json:"ph"`
	Provider string `json:"pr"`
	Pool     string `json:"po"`
	Address  string `json:"a"`
	Healthy  bool   `json:"h"`
	Reason   string `json:"r"`
	Draining bool   `json:"d,omitempty"`
	Labels   string `json:"l"`
	Created  int64  `json:"c"`
	Changed  int64  `json:"t"`
}

func toRow(p *proxyv1.Proxy) row {
	st := p.GetStatus()
	r := row{Name: p.GetName(), Phase: phaseName(st.GetPhase()), Provider: p.GetSpec().GetProvider(), Pool: p.GetPool(),
		Healthy: st.GetHealthy(), Reason: st.GetReason(), Draining: p.GetDraining(), Labels: labelString(p.GetLabels()),
		Created: p.GetCreateTime().GetSeconds(), Changed: st.GetPhaseTransitionTime().GetSeconds()}
	if st.GetIp() != "" {
		r.Address = fmt.Sprintf("%s:%d", st.GetIp(), st.GetPort())
	}
	return r
}

// proxyEvents streams the proxies table: every proxy, a page of the
// listing per event (the first says to start over, the last that the
// listing is whole), then each change as the orchestrator's watch
// delivers it (batched for a tenth of a second), and the listing again
// after the watch had to start over.
func (s *Server) proxyEvents(w http.ResponseWriter, r *http.Request, sess *session) {
	ctx := r.Context()
	e := startSSE(w)
	type change struct {
		Deleted bool `json:"x,omitempty"`
		Row     row  `json:"row"`
	}
	var mu sync.Mutex
	var pending []change
	wake := make(chan struct{}, 1)
	go retry(ctx, func(err error) { _ = e.send("problem", map[string]string{"error": err.Error()}) }, func(ctx context.Context) error {
		first := true
		return s.watchProxyPages(ctx, sess, &proxyv1.ListProxiesRequest{}, func(ps []*proxyv1.Proxy, last bool) {
			// Each page goes out as it arrives, so the browser reads one
			// while the console lists the next.
			rows := make([]row, len(ps))
			for i, p := range ps {
				rows[i] = toRow(p)
			}
			if first {
				mu.Lock()
				pending = nil
				mu.Unlock()
			}
			_ = e.send("rows", map[string]any{"first": first, "last": last, "rows": rows})
			first = false
		}, func(c *proxyv1.WatchProxiesResponse) {
			mu.Lock()
			pending = append(pending, change{Deleted: c.GetType() == proxyv1.ChangeType_CHANGE_TYPE_DELETED, Row: toRow(c.GetProxy())})
			mu.Unlock()
			select {
			case wake <- struct{}{}:
			default:
			}
		})
	})
	keepAlive := time.NewTicker(20 * time.Second)
	defer keepAlive.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-keepAlive.C:
			if e.comment() != nil {
				return
			}
		case <-wake:
			select {
			case <-ctx.Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
			mu.Lock()
			batch := pending
			pending = nil
			mu.Unlock()
			if len(batch) > 0 && e.send("changes", batch) != nil {
				return
			}
		}
	}
}

// A live view is a page part that the server renders again whenever what
// it shows changes, and sends as HTML over the event stream: one
// rendering path (the page's own templates) for the first load and every
// update.
type liveView struct {
	fragment string
	need     need
	data     func(f *fleet) any
}

func (s *Server) liveView(r *http.Request, sess *session) (*liveView, error) {
	name := r.URL.Query().Get("name")
	switch r.URL.Query().Get("v") {
	case "overview":
		return &liveView{"overview-body", overviewNeed, func(f *fleet) any { return f.overview() }}, nil
	case "pools":
		return &liveView{"pools-body", need{pools: true}, func(f *fleet) any { return f.poolsPage() }}, nil
	case "pool":
		return &liveView{"pool-body", need{pool: name}, func(f *fleet) any { return f.poolPage(name) }}, nil
	case "leases":
		return &liveView{"leases-body", leasesNeed, func(f *fleet) any { return f.leasesPage() }}, nil
	case "providers":
		return &liveView{"providers-body", need{providers: true}, func(f *fleet) any { return f.providersPage() }}, nil
	case "proxy":
		admin := sess.has("admin")
		return &liveView{"proxy-body", proxyNeed(name), func(f *fleet) any { return f.proxyPage(name, admin) }}, nil
	}
	return nil, fmt.Errorf("unknown view")
}

// pollEvery is how often a view re-reads what no service streams:
// provider health (checked every few seconds by the health service) and
// the gateway's counters. It also refreshes relative times.
const pollEvery = 5 * time.Second

// viewEvents streams one live view's HTML.
func (s *Server) viewEvents(w http.ResponseWriter, r *http.Request, sess *session) {
	lv, err := s.liveView(r, sess)
	if err != nil {
		http.Error(w, "unknown view", http.StatusBadRequest)
		return
	}
	ctx := r.Context()
	f := newFleet()
	e := startSSE(w)
	dirty := make(chan struct{}, 1)
	changed := func() {
		select {
		case dirty <- struct{}{}:
		default:
		}
	}
	problem := func(feed string) func(error) {
		return func(err error) { f.setProblem(feed, err); changed() }
	}
	s.follow(ctx, sess, lv.need, f, changed, problem)

	render := func() error {
		v := view{Admin: sess.has("admin"), CSRF: sess.CSRF, Data: lv.data(f), Gateway: s.cfg.Gateway != nil}
		var buf bytes.Buffer
		if err := s.pages["layout-fragments"].ExecuteTemplate(&buf, lv.fragment, v); err != nil {
			s.log.Error("rendering a live view failed", "fragment", lv.fragment, "error", err)
			return nil
		}
		return e.send("html", map[string]string{"id": lv.fragment, "html": buf.String()})
	}
	tick := time.NewTicker(pollEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			if render() != nil {
				return
			}
		case <-dirty:
			// Coalesce bursts: one render a quarter second at most.
			select {
			case <-ctx.Done():
				return
			case <-time.After(250 * time.Millisecond):
			}
			select {
			case <-dirty:
			default:
			}
			if render() != nil {
				return
			}
		}
	}
}

// follow starts, for the life of ctx, the feeds that keep f up to date
// for n.
func (s *Server) follow(ctx context.Context, sess *session, n need, f *fleet, changed func(), problem func(string) func(error)) {
	ok := func(feed string, err error) {
		if err == nil {
			f.setProblem(feed, nil)
		}
	}
	if n.proxies || n.pool != "" || n.proxy != "" {
		req := &proxyv1.ListProxiesRequest{}
		var only func(*proxyv1.Proxy) bool
		if n.pool != "" {
			req.Labels = map[string]string{"pool": n.pool}
			only = func(p *proxyv1.Proxy) bool { return p.GetPool() == n.pool }
		}
		if n.proxy != "" {
			only = func(p *proxyv1.Proxy) bool { return p.GetName() == n.proxy }
		}
		go retry(ctx, problem("proxies"), func(ctx context.Context) error {
			return s.watchProxies(ctx, sess, req, func(ps []*proxyv1.Proxy) {
				if n.proxy != "" {
					var keep []*proxyv1.Proxy
					for _, p := range ps {
						if only(p) {
							keep = append(keep, p)
						}
					}
					ps = keep
					// The full view for an admin (the listing is BASIC).
					if resp, err := s.api.Proxies.GetProxy(ctx, s.proxyRequest(sess, n.proxy), as(sess)); err == nil {
						f.mu.Lock()
						f.cloudInit = resp.GetProxy().GetSpec().GetCloudInit()
						f.mu.Unlock()
					}
					_ = s.loadTimeline(ctx, sess, f, n.proxy)
				}
				f.resetProxies(ps)
				ok("proxies", nil)
				changed()
			}, func(c *proxyv1.WatchProxiesResponse) {
				if !f.applyProxy(c, only) {
					return
				}
				if n.proxy != "" {
					f.mu.Lock()
					f.timeline = append([]*proxyv1.WatchProxiesResponse{c}, f.timeline...)
					f.mu.Unlock()
				}
				changed()
			})
		})
	}
	if n.pools || n.pool != "" {
		go retry(ctx, problem("pools"), func(ctx context.Context) error {
			return s.watchPools(ctx, sess, func(ps []*proxyv1.ProxyPool) {
				f.resetPools(ps)
				ok("pools", nil)
				changed()
			}, func(c *proxyv1.WatchProxyPoolsResponse) {
				f.applyPool(c)
				changed()
			})
		})
		if n.pools {
			go func() {
				if resp, err := s.api.Proxies.ListProviders(ctx, &proxyv1.ListProvidersRequest{}, as(sess)); err == nil {
					f.mu.Lock()
					f.configured = resp.GetProviders()
					f.mu.Unlock()
					changed()
				}
			}()
		}
	}
	if n.leases {
		req := &leasev1.ListLeasesRequest{ProxyName: n.proxy}
		var only func(*leasev1.Lease) bool
		if n.proxy != "" {
			only = func(l *leasev1.Lease) bool { return l.GetProxyName() == n.proxy }
		}
		go retry(ctx, problem("leases"), func(ctx context.Context) error {
			return s.watchLeases(ctx, sess, req, func(ls []*leasev1.Lease) {
				f.resetLeases(ls)
				ok("leases", nil)
				if n.cooldowns {
					if err := s.loadCooldowns(ctx, sess, f, n.proxy); err != nil {
						f.setProblem("cooldowns", err)
					}
				}
				changed()
			}, func(c *leasev1.WatchLeasesResponse) {
				did, cooled := f.applyLease(c, only)
				if cooled && n.cooldowns {
					if err := s.loadCooldowns(ctx, sess, f, n.proxy); err != nil {
						f.setProblem("cooldowns", err)
					}
				}
				if did || cooled {
					changed()
				}
			})
		})
	}
	if n.providers || n.gateway {
		go func() {
			t := time.NewTicker(pollEvery)
			defer t.Stop()
			for {
				if n.providers {
					err := s.loadProviders(ctx, sess, f)
					f.setProblem("providers", err)
				}
				if n.gateway && s.cfg.Gateway != nil {
					g := s.cfg.Gateway.Rates(ctx)
					f.mu.Lock()
					f.gateway = g
					f.mu.Unlock()
				}
				changed()
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
			}
		}()
	}
}
