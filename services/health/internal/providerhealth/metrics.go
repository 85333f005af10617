package providerhealth

import (
	"github.com/prometheus/client_golang/prometheus"
)

var (
	descUp = prometheus.NewDesc("egress_provider_target_up",
		"1 when the provider target passed its last check, else 0.", []string{"provider", "target"}, nil)
	descDuration = prometheus.NewDesc("egress_provider_check_duration_seconds",
		"How long the last check of the provider target took.", []string{"provider", "target"}, nil)
	descTimestamp = prometheus.NewDesc("egress_provider_check_timestamp_seconds",
		"When the last check of the provider target finished, as a Unix time.", []string{"provider", "target"}, nil)
)

// Collector exports the monitor's latest results at scrape time. Only the
// replica running the checks has any; a target that is gone from the
// results has no series.
type Collector struct{ M *Monitor }

// Describe implements prometheus.Collector.
func (c Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descUp
	ch <- descDuration
	ch <- descTimestamp
}

// Collect implements prometheus.Collector.
func (c Collector) Collect(ch chan<- prometheus.Metric) {
	for _, r := range c.M.Snapshot() {
		for _, t := range r.Targets {
			up := 0.0
			if t.Ready {
				up = 1
			}
			ch <- prometheus.MustNewConstMetric(descUp, prometheus.GaugeValue, up, r.Provider, t.Name)
			ch <- prometheus.MustNewConstMetric(descDuration, prometheus.GaugeValue, t.Latency.Seconds(), r.Provider, t.Name)
			ch <- prometheus.MustNewConstMetric(descTimestamp, prometheus.GaugeValue, float64(r.CheckedAt.UnixNano())/1e9, r.Provider, t.Name)
		}
	}
}
