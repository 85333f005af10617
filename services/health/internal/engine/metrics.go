package engine

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/egress-proxies/egress-proxies/services/health/internal/probe"
)

// Metrics observe every probe: its duration, and failures, per proxy. A
// proxy's series go when it leaves the engine.
type Metrics struct {
	duration *prometheus.HistogramVec
	failures *prometheus.CounterVec
}

// NewMetrics registers the probe metrics on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "egress_health_probe_duration_seconds",
			Help:    "Duration of every health probe: connect, CONNECT, TLS handshake and request.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}, []string{"proxy"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_health_probe_failures_total",
			Help: "Failed health probes (including probes over the latency threshold).",
		}, []string{"proxy"}),
	}
	reg.MustRegister(m.duration, m.failures)
	return m
}

// Observe records one probe of s.
func (m *Metrics) Observe(s Spec, r probe.Result) {
	m.duration.WithLabelValues(s.Name).Observe(r.Latency.Seconds())
	c := m.failures.WithLabelValues(s.Name)
	if !r.OK || (s.LatencyThreshold > 0 && r.Latency > s.LatencyThreshold) {
		c.Inc()
	}
}

// Forget removes s's series.
func (m *Metrics) Forget(s Spec) {
	m.duration.DeleteLabelValues(s.Name)
	m.failures.DeleteLabelValues(s.Name)
}
