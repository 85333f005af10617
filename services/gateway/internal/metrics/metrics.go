// Package metrics holds the gateway's Prometheus metrics. Client ids come
// from the token file (a bounded set); pools and providers from the fleet.
package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the gateway's own metrics.
type Metrics struct {
	// Requests counts finished HTTP requests and tunnels by client, pool,
	// provider, kind (http, connect, socks5) and outcome (success, banned,
	// blocked, captcha, upstream_error, no_proxy, refused, bad_request).
	Requests *prometheus.CounterVec
	// Bytes counts bytes relayed by direction (up: client to target, down:
	// target to client), client, pool and provider.
	Bytes *prometheus.CounterVec
	// TunnelDuration observes how long tunnels lived, by kind.
	TunnelDuration *prometheus.HistogramVec
	// ActiveTunnels is the number of open tunnels, by kind.
	ActiveTunnels *prometheus.GaugeVec
	// AuthFailures counts refused credentials by listener (http, socks5)
	// and reason (missing, invalid, role, rate_limited, bad_option).
	AuthFailures *prometheus.CounterVec
	// Refusals counts requests refused by a limit, by limit
	// (tunnels_total, tunnels_per_client, header_bytes, tunnel_lifetime,
	// idle).
	Refusals *prometheus.CounterVec
	// Retries counts attempts moved to another proxy, by reason
	// (upstream_unreachable, connect_refused, ban_rule).
	Retries *prometheus.CounterVec
	// SessionMoves counts sessions moved to another proxy, by reason (the
	// lease service's move reason).
	SessionMoves *prometheus.CounterVec
	// Rules counts ban-rule matches by rule and outcome.
	Rules *prometheus.CounterVec
	// LeaseCalls observes the duration of each call to the lease service,
	// by call (acquire, renew, release, report): an acquire is on the
	// critical path of every request and tunnel.
	LeaseCalls *prometheus.HistogramVec
	// LeaseCache counts the requests and tunnels by how they got their
	// lease: hit (a reservoir lease or a session's cached one, no call),
	// miss (nothing cached qualified: acquired for the request) and
	// fallback (the fleet view is not trusted: acquired for the request).
	LeaseCache *prometheus.CounterVec
	// ReservoirLeases is the leases the reservoir holds, idle and in use.
	ReservoirLeases prometheus.Gauge
}

// New creates the metrics and registers them on reg.
func New(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_gateway_requests_total",
			Help: "HTTP requests and tunnels handled, by client, pool, provider, kind and outcome.",
		}, []string{"client", "pool", "provider", "kind", "outcome"}),
		Bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_gateway_bytes_total",
			Help: "Bytes relayed, by direction (up: client to target, down: target to client), client, pool and provider.",
		}, []string{"direction", "client", "pool", "provider"}),
		TunnelDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "egress_gateway_tunnel_duration_seconds",
			Help:    "How long tunnels (CONNECT and SOCKS5) lived.",
			Buckets: []float64{.01, .05, .1, .5, 1, 5, 10, 30, 60, 300, 900, 3600},
		}, []string{"kind"}),
		ActiveTunnels: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "egress_gateway_active_tunnels",
			Help: "Tunnels open now, by kind.",
		}, []string{"kind"}),
		AuthFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_gateway_auth_failures_total",
			Help: "Refused proxy credentials, by listener and reason.",
		}, []string{"listener", "reason"}),
		Refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_gateway_limit_refusals_total",
			Help: "Requests and tunnels refused or ended by a limit, by limit.",
		}, []string{"limit"}),
		Retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_gateway_retries_total",
			Help: "Attempts moved to another proxy, by reason.",
		}, []string{"reason"}),
		SessionMoves: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_gateway_session_moves_total",
			Help: "Sessions moved to another proxy, by the lease service's reason.",
		}, []string{"reason"}),
		Rules: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_gateway_rule_matches_total",
			Help: "Responses classified by a ban rule, by rule and outcome.",
		}, []string{"rule", "outcome"}),
		LeaseCalls: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "egress_gateway_lease_call_seconds",
			Help:    "Duration of calls to the lease service, by call (acquire, renew, release, report).",
			Buckets: []float64{.0005, .001, .002, .004, .008, .016, .032, .064, .128, .256, .512, 1, 2.5, 5},
		}, []string{"call"}),
		LeaseCache: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_gateway_lease_cache_total",
			Help: "Leases of requests and tunnels, by result: hit (from the reservoir or the session cache, no lease call), miss (acquired for the request), fallback (acquired for the request: the fleet view is not trusted).",
		}, []string{"result"}),
		ReservoirLeases: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "egress_gateway_lease_reservoir_leases",
			Help: "Leases the reservoir holds ahead, idle and in use.",
		}),
	}
	reg.MustRegister(m.Requests, m.Bytes, m.TunnelDuration, m.ActiveTunnels, m.AuthFailures, m.Refusals, m.Retries, m.SessionMoves, m.Rules, m.LeaseCalls,
		m.LeaseCache, m.ReservoirLeases)
	for _, r := range []string{"hit", "miss", "fallback"} {
		m.LeaseCache.WithLabelValues(r)
	}
	for _, k := range []string{"connect", "socks5"} {
		m.ActiveTunnels.WithLabelValues(k)
	}
	return m
}
