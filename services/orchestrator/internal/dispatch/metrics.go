package dispatch

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
)

// Metrics are the dispatcher's Prometheus series.
type Metrics struct {
	Reconciles        *prometheus.CounterVec
	ReconcileDuration prometheus.Histogram
	Results           *prometheus.CounterVec
	RoundTrip         *prometheus.HistogramVec
	EventsPublished   prometheus.Counter
}

// NewMetrics registers the series on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Reconciles: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_orchestrator_reconciles_total",
			Help: "Reconciles of claimed proxies, by outcome (the operation dispatched, wait, release).",
		}, []string{"outcome"}),
		ReconcileDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "egress_orchestrator_reconcile_duration_seconds",
			Help:    "Time to claim, decide and store one proxy, averaged over its claim batch.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16),
		}),
		Results: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_orchestrator_results_total",
			Help: "Provisioner results received, by how they were handled.",
		}, []string{"handling"}),
		RoundTrip: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "egress_orchestrator_command_round_trip_seconds",
			Help:    "From issuing a command to applying its result, by provider, operation and result class.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 14),
		}, []string{"provider", "operation", "result"}),
		EventsPublished: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "egress_orchestrator_proxy_events_published_total",
			Help: "ProxyEvents published by this replica's outbox.",
		}),
	}
	reg.MustRegister(m.Reconciles, m.ReconcileDuration, m.Results, m.RoundTrip, m.EventsPublished)
	return m
}

func (m *Metrics) reconciled(outcome string) { m.Reconciles.WithLabelValues(outcome).Inc() }

func (m *Metrics) observeResult(res *busv1.CommandResult, issued *time.Time, now time.Time) {
	m.Results.WithLabelValues("applied").Inc()
	if issued == nil {
		return
	}
	result := "ok"
	if e := res.GetError(); e != nil {
		result = e.GetReason().String()
	}
	m.RoundTrip.WithLabelValues(res.GetProvider(), res.GetOperation().String(), result).Observe(now.Sub(*issued).Seconds())
}
