package provisioner

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// Metrics are the runtime's Prometheus metrics. A nil *Metrics records
// nothing.
type Metrics struct {
	// Requests counts operations by provider, op, result (ok or error) and
	// class (the error class, "none" on success, "canceled" when the caller
	// or a shutdown gave up: a context error the backend did not classify).
	// A classified error keeps its class even when it wraps a context error
	// (a backend's own timeout it calls Transient), as its gRPC status does.
	Requests *prometheus.CounterVec
	// Duration times operations by provider, op and result.
	Duration *prometheus.HistogramVec
	// InFlight is the number of operations running by provider and op.
	InFlight *prometheus.GaugeVec
	// Commands counts NATS commands by provider and disposition: done,
	// expired (past the deadline, dropped), invalid (terminated), requeued
	// (handed back with a Nak), publish_failed.
	Commands *prometheus.CounterVec
}

// NewMetrics creates the metrics and registers them on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "egress", Subsystem: "provisioner", Name: "requests_total",
			Help: "Provisioner operations by provider, op, result and error class.",
		}, []string{"provider", "op", "result", "class"}),
		Duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "egress", Subsystem: "provisioner", Name: "request_duration_seconds",
			Help:    "Duration of provisioner operations.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600},
		}, []string{"provider", "op", "result"}),
		InFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "egress", Subsystem: "provisioner", Name: "in_flight",
			Help: "Provisioner operations running now.",
		}, []string{"provider", "op"}),
		Commands: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "egress", Subsystem: "provisioner", Name: "commands_total",
			Help: "NATS commands by provider and disposition (done, expired, invalid, requeued, publish_failed).",
		}, []string{"provider", "disposition"}),
	}
	if reg != nil {
		reg.MustRegister(m.Requests, m.Duration, m.InFlight, m.Commands)
	}
	return m
}

func resultOf(err error) (result, class string) {
	if err == nil {
		return "ok", "none"
	}
	var classified *errclass.Error
	if !errors.As(err, &classified) || classified.Class == provisionerv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return "error", "canceled"
		}
	}
	return "error", errclass.Of(err).String()
}

func (m *Metrics) observe(provider string, op Op, err error, d time.Duration) {
	if m == nil {
		return
	}
	result, class := resultOf(err)
	m.Requests.WithLabelValues(provider, string(op), result, class).Inc()
	m.Duration.WithLabelValues(provider, string(op), result).Observe(d.Seconds())
}

func (m *Metrics) inflight(provider string, op Op, delta float64) {
	if m == nil {
		return
	}
	m.InFlight.WithLabelValues(provider, string(op)).Add(delta)
}

func (m *Metrics) command(provider, disposition string) {
	if m == nil {
		return
	}
	m.Commands.WithLabelValues(provider, disposition).Inc()
}
