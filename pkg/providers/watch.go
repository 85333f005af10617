package providers

import (
	"log/slog"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/egress-proxies/egress-proxies/pkg/reload"
)

// Source gives the providers config in effect. Every service reads the
// config through one, asking again at each use rather than keeping a
// *Config, so that a reloaded file takes effect without a restart.
type Source interface {
	Current() *Config
}

// Static is a Source that never changes (tests, and a service run
// without a providers file).
func Static(cfg *Config) Source { return static{cfg} }

type static struct{ cfg *Config }

func (s static) Current() *Config { return s.cfg }

// File is the providers file kept current with pkg/reload: it is re-read
// when it changes (looked at at most once per reload.Every), and a version
// that does not parse or validate keeps the one in effect, with an ERROR
// naming the file and the field (never the content: backend blocks can
// hold secrets) and one more in
// egress_config_reload_failures_total{file="providers"}.
type File struct {
	*reload.File[*Config]
}

var (
	failuresMu  sync.Mutex
	failuresFor = map[prometheus.Registerer]*prometheus.CounterVec{}
)

// failures is the reload-failure counter of reg, registered once per
// registry (every service has its own).
func failures(reg prometheus.Registerer) prometheus.Counter {
	failuresMu.Lock()
	defer failuresMu.Unlock()
	c, ok := failuresFor[reg]
	if !ok {
		c = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_config_reload_failures_total",
			Help: "Versions of a reloaded config file that were not taken (unreadable or invalid); the version before stays in effect.",
		}, []string{"file"})
		reg.MustRegister(c)
		failuresFor[reg] = c
	}
	return c.WithLabelValues("providers")
}

// Open reads and validates the providers file at path now, as LoadFile
// does (an error at start stops the service), and keeps it current after.
// reg may be nil (no metric).
func Open(path string, log *slog.Logger, reg prometheus.Registerer) (*File, error) {
	f, err := reload.Open(path, "the providers config", Parse, log)
	if err != nil {
		return nil, err
	}
	f.Error = true
	if reg != nil {
		c := failures(reg)
		c.Add(0)
		f.Rejected = func(error) { c.Inc() }
	}
	return &File{f}, nil
}

// RejectedCounter counts one more rejected providers config in reg's
// egress_config_reload_failures_total{file="providers"}, for a check a
// service makes beyond the file's own validation (a provisioner's backend
// that cannot be built from its new entry). reg may be nil.
func RejectedCounter(reg prometheus.Registerer) func() {
	if reg == nil {
		return func() {}
	}
	c := failures(reg)
	return c.Inc
}
