// Package metrics holds the lease service's Prometheus metrics: counters
// fed by the API and the proxy mirror, and gauges read from the database at scrape
// time (so every replica reports the shared truth, and no gauge drifts).
package metrics

import (
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/egress-proxies/egress-proxies/services/lease/internal/store"
)

// Metrics are the service's own metrics.
type Metrics struct {
	// Acquires counts AcquireLease calls by result: granted, one of the
	// unavailability reasons (no_matching_proxy, unhealthy, at_capacity,
	// cooling_down_target, cooling_down_global), invalid_argument or error.
	Acquires *prometheus.CounterVec
	// Reports counts ReportOutcome calls by outcome.
	Reports *prometheus.CounterVec
	// Releases counts ReleaseLease calls by result: released, already_ended.
	Releases *prometheus.CounterVec
	// Sessions counts granted session acquires by result (new, existing,
	// moved); SessionMoves the moves by reason.
	Sessions     *prometheus.CounterVec
	SessionMoves *prometheus.CounterVec
	// Duration observes the latency of each API method as the service
	// handles it (database included), by method and gRPC code.
	Duration *prometheus.HistogramVec
	// Expired counts leases ended by the expiry sweep.
	Expired prometheus.Counter
	// Events counts events applied from NATS by kind (proxy, health) and
	// result (applied, stale, invalid, error).
	Events *prometheus.CounterVec
	// Resyncs counts full resyncs from the orchestrator by result.
	Resyncs *prometheus.CounterVec
	// Skipped counts proxies (and events) skipped because they cannot be
	// applied, by source (event, resync).
	Skipped *prometheus.CounterVec
	// RoundOps and RoundDuration observe the committer's rounds: how many
	// acquires, reports and releases shared one transaction, and how long
	// it took (selection included).
	RoundOps      prometheus.Histogram
	RoundDuration prometheus.Histogram
}

// ObserveRound records one committed round.
func (m *Metrics) ObserveRound(ops int, d time.Duration) {
	m.RoundOps.Observe(float64(ops))
	m.RoundDuration.Observe(d.Seconds())
}

// New creates the metrics and registers them, with the scrape-time gauges
// reading st, on reg.
func New(reg prometheus.Registerer, st *store.Store, log *slog.Logger) *Metrics {
	m := &Metrics{
		Acquires: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "egress", Subsystem: "lease", Name: "acquires_total",
			Help: "AcquireLease calls by result: granted, the main reason no proxy was available, invalid_argument or error.",
		}, []string{"result"}),
		Reports: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "egress", Subsystem: "lease", Name: "reports_total",
			Help: "Outcomes reported through ReportOutcome.",
		}, []string{"outcome"}),
		Releases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "egress", Subsystem: "lease", Name: "releases_total",
			Help: "ReleaseLease calls by result: released or already_ended.",
		}, []string{"result"}),
		Sessions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "egress", Subsystem: "lease", Name: "session_acquires_total",
			Help: "Granted AcquireLease calls with a session key, by result: new, existing or moved.",
		}, []string{"result"}),
		SessionMoves: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "egress", Subsystem: "lease", Name: "session_moves_total",
			Help: "Sessions moved off their proxy, by reason: deleted, draining, unhealthy, selector, cooling_down.",
		}, []string{"reason"}),
		Duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "egress", Subsystem: "lease", Name: "request_duration_seconds",
			Help:    "Latency of the lease API methods as handled by the service, by method and code.",
			Buckets: []float64{.0005, .001, .002, .005, .01, .025, .05, .1, .25, .5, 1, 2.5},
		}, []string{"method", "code"}),
		Expired: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "egress", Subsystem: "lease", Name: "expired_total",
			Help: "Leases ended by the expiry sweep of this replica.",
		}),
		Events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "egress", Subsystem: "lease", Name: "events_total",
			Help: "Events received from NATS by kind (proxy, health) and result (applied, stale, invalid, skipped, error).",
		}, []string{"kind", "result"}),
		Resyncs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "egress", Subsystem: "lease", Name: "resyncs_total",
			Help: "Full resyncs of the proxy mirror from the orchestrator by result (ok, error).",
		}, []string{"result"}),
		Skipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "egress", Subsystem: "lease", Name: "skipped_total",
			Help: "Proxy snapshots and events that cannot be applied and were skipped (each logged as a WARNING), by source (event, resync).",
		}, []string{"source"}),
	}
	m.RoundOps = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: "egress", Subsystem: "lease", Name: "commit_round_operations",
		Help:    "Acquires, reports and releases committed together in one transaction by this replica.",
		Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128, 256, 512},
	})
	m.RoundDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: "egress", Subsystem: "lease", Name: "commit_round_duration_seconds",
		Help:    "Time of one commit round of this replica: choosing proxies and the transaction.",
		Buckets: []float64{.0005, .001, .002, .005, .01, .025, .05, .1, .25, .5, 1},
	})
	for _, r := range []string{"granted", "no_matching_proxy", "unhealthy", "at_capacity", "cooling_down_target", "cooling_down_global", "invalid_argument", "error"} {
		m.Acquires.WithLabelValues(r)
	}
	for _, r := range []string{"new", "existing", "moved"} {
		m.Sessions.WithLabelValues(r)
	}
	queued := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "egress", Subsystem: "lease", Name: "commit_queued_operations",
		Help: "Acquires, reports and releases of this replica waiting for a commit round.",
	}, func() float64 { return float64(st.Queued()) })
	reg.MustRegister(m.Acquires, m.Reports, m.Releases, m.Sessions, m.SessionMoves, m.Duration, m.Expired, m.Events, m.Resyncs, m.Skipped, m.RoundOps, m.RoundDuration, queued,
		&collector{st: st, log: log})
	return m
}

var (
	activeLeasesDesc = prometheus.NewDesc("egress_lease_active_leases",
		"Leases active now, across all replicas.", nil, nil)
	cooldownsDesc = prometheus.NewDesc("egress_lease_active_cooldowns",
		"Cooldowns in force now, by scope (global, target).", []string{"scope"}, nil)
	proxiesDesc = prometheus.NewDesc("egress_lease_proxies",
		"Proxies known to the lease service (not deleted), by state: leasable (Ready and healthy) or unavailable.", []string{"state"}, nil)
	scrapeErrorDesc = prometheus.NewDesc("egress_lease_stats_scrape_error",
		"1 when the database could not be read for the gauges at this scrape.", nil, nil)
)

// collector reads the gauges from the database at scrape time.
type collector struct {
	st  *store.Store
	log *slog.Logger
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- activeLeasesDesc
	ch <- cooldownsDesc
	ch <- proxiesDesc
	ch <- scrapeErrorDesc
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	st, err := c.st.Stats(ctx)
	if err != nil {
		c.log.Warn("reading lease gauges failed", "error", err)
		ch <- prometheus.MustNewConstMetric(scrapeErrorDesc, prometheus.GaugeValue, 1)
		return
	}
	ch <- prometheus.MustNewConstMetric(scrapeErrorDesc, prometheus.GaugeValue, 0)
	ch <- prometheus.MustNewConstMetric(activeLeasesDesc, prometheus.GaugeValue, float64(st.ActiveLeases))
	ch <- prometheus.MustNewConstMetric(cooldownsDesc, prometheus.GaugeValue, float64(st.GlobalCooldowns), "global")
	ch <- prometheus.MustNewConstMetric(cooldownsDesc, prometheus.GaugeValue, float64(st.TargetCooldowns), "target")
	ch <- prometheus.MustNewConstMetric(proxiesDesc, prometheus.GaugeValue, float64(st.LeasableProxies), "leasable")
	ch <- prometheus.MustNewConstMetric(proxiesDesc, prometheus.GaugeValue, float64(st.KnownProxies-st.LeasableProxies), "unavailable")
}
