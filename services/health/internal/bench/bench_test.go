// Package bench measures the cost of a health probe: the real prober, and
// the real engine driving it, against Go CONNECT proxies and a TLS target
// running in a separate process (internal/bench/farm), so that the CPU
// measured is the prober's alone. Every figure is measured beside its
// baseline in the same run, alternating: the probe as it was before the
// probe path was made lean (baseline_test.go) against the current one.
//
//	go test -run '^$' -bench ProbeCPU -benchtime 20x -cpu 1 ./internal/bench/
//	go test -run '^$' -bench ProbeAt1Hz -benchtime 20x -cpu 1 ./internal/bench/
//
// -cpu 1 gives the prober one core (GOMAXPROCS=1). An iteration of
// BenchmarkProbeAt1Hz is one second of probing.
package bench

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/probe"
)

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func mallocs() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.Mallocs
}

// farm is the load process: proxies and a TLS target.
type farm struct {
	proc    *proctest.Process
	target  string
	roots   *x509.CertPool
	proxies []string
}

func startFarm(b *testing.B, proxies int) *farm {
	b.Helper()
	bin := proctest.Build(b, "farm")
	p := proctest.Start(b, bin, []string{fmt.Sprintf("-proxies=%d", proxies)})
	ready := p.WaitLog(b, time.Minute, proctest.Msg("farm ready"))
	f := &farm{proc: p, target: ready["target"].(string), roots: x509.NewCertPool()}
	if !f.roots.AppendCertsFromPEM([]byte(ready["ca"].(string))) {
		b.Fatal("farm CA")
	}
	for _, a := range ready["proxies"].([]any) {
		f.proxies = append(f.proxies, a.(string))
	}
	return f
}

// cpu is the farm's own CPU so far, from its latest report.
func (f *farm) cpu() float64 {
	logs := f.proc.Logs()
	for i := len(logs) - 1; i >= 0; i-- {
		if v, ok := logs[i]["cpu_seconds"].(float64); ok {
			return v
		}
	}
	return 0
}

type prober interface {
	Probe(ctx context.Context, addr string) probe.Result
}

// paths are the probe paths measured side by side: the baseline, the lean
// path with TLS 1.3 allowed (what the lean path saves besides the TLS
// version), and the lean path as the service runs it.
func (f *farm) paths(b *testing.B) []path {
	b.Helper()
	cfg := &tls.Config{RootCAs: f.roots, MinVersion: tls.VersionTLS12}
	baseline, err := newBaseline(baselineOptions{Target: f.target, TLSConfig: cfg})
	if err != nil {
		b.Fatal(err)
	}
	cfg13 := cfg.Clone()
	cfg13.MaxVersion = tls.VersionTLS13
	lean13, err := probe.New(probe.Options{Target: f.target, TLSConfig: cfg13})
	if err != nil {
		b.Fatal(err)
	}
	lean, err := probe.New(probe.Options{Target: f.target, TLSConfig: cfg})
	if err != nil {
		b.Fatal(err)
	}
	return []path{{name: "baseline", p: baseline}, {name: "lean-tls13", p: lean13}, {name: "lean", p: lean}}
}

type path struct {
	name string
	p    prober
	// Totals over the run.
	probes, failures, allocs int64
	cpu                      time.Duration
	slowest                  time.Duration
	seconds                  int
}

func (p *path) report(b *testing.B, base *path) {
	if p.probes == 0 {
		return
	}
	perProbe := float64(p.cpu.Microseconds()) / float64(p.probes)
	b.ReportMetric(perProbe, p.name+"-cpu-µs/probe")
	b.ReportMetric(float64(p.failures), p.name+"-failures")
	if base != nil && base != p && base.probes > 0 {
		b.ReportMetric(perProbe/(float64(base.cpu.Microseconds())/float64(base.probes)), p.name+"/baseline")
	}
}

// BenchmarkProbeCPU measures the CPU and the allocations of one probe,
// closed loop (16 probes in flight over 64 proxies, no deadline pressure),
// for each probe path in turn within every iteration, so that the
// machine's noise falls on all of them alike.
func BenchmarkProbeCPU(b *testing.B) {
	f := startFarm(b, 64)
	paths := f.paths(b)
	const batch, inFlight = 256, 16
	run := func(p *path) {
		var wg sync.WaitGroup
		var next, failed atomic.Int64
		m0, c0 := mallocs(), cpuTime()
		for range inFlight {
			wg.Go(func() {
				for i := next.Add(1); i <= batch; i = next.Add(1) {
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					if r := p.p.Probe(ctx, f.proxies[int(i)%len(f.proxies)]); !r.OK {
						failed.Add(1)
					}
					cancel()
				}
			})
		}
		wg.Wait()
		p.cpu += cpuTime() - c0
		p.allocs += int64(mallocs() - m0)
		p.probes += batch
		p.failures += failed.Load()
	}
	for i := range paths { // warm the session caches
		run(&paths[i])
		paths[i] = path{name: paths[i].name, p: paths[i].p}
	}
	b.ResetTimer()
	round := 0
	for b.Loop() {
		// Each path in turn, the order rotating every round.
		for k := range paths {
			run(&paths[(round+k)%len(paths)])
		}
		round++
	}
	for i := range paths {
		paths[i].report(b, &paths[0])
		b.ReportMetric(float64(paths[i].allocs)/float64(paths[i].probes), paths[i].name+"-allocs/probe")
	}
}

// BenchmarkProbeAt1Hz runs the engine over n proxies at 1 Hz each (the
// service's default interval), one second per iteration, switching every
// iteration between the baseline — the old probe path on an engine that
// wakes for every probe, as it did — and the lean path on the engine as
// the service runs it (probe starts batched by its tick). Per path: the
// prober's CPU per probe, failures (the bench's own load must cause
// none), and the slowest probe.
func BenchmarkProbeAt1Hz(b *testing.B) {
	for _, n := range []int{500, 1000} {
		b.Run(fmt.Sprintf("proxies=%d", n), func(b *testing.B) {
			f := startFarm(b, n)
			all := f.paths(b)
			type counts struct{ probes, failures, slowest atomic.Int64 }
			var cur atomic.Pointer[counts]
			cur.Store(&counts{})
			onResult := func(_ engine.Spec, r probe.Result) {
				c := cur.Load()
				c.probes.Add(1)
				if !r.OK {
					c.failures.Add(1)
				}
				for s := c.slowest.Load(); int64(r.Latency) > s && !c.slowest.CompareAndSwap(s, int64(r.Latency)); s = c.slowest.Load() {
				}
			}
			type run struct {
				p   *path
				eng *engine.Engine
			}
			runs := []*run{
				{p: &all[0], eng: engine.New(engine.Config{Probe: probeAt(all[0].p), OnResult: onResult, Tick: time.Nanosecond})},
				{p: &all[2], eng: engine.New(engine.Config{Probe: probeAt(all[2].p), OnResult: onResult})},
			}
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			for _, r := range runs {
				wg.Go(func() { _ = r.eng.Run(ctx) })
			}
			defer func() { cancel(); wg.Wait() }()
			// Only the active engine holds the proxies; handed over, they
			// start with their first round spread over a second, as in
			// the service.
			activate := func(r *run) {
				for _, o := range runs {
					for i := range f.proxies {
						o.eng.Remove(fmt.Sprint(i))
					}
				}
				for i, a := range f.proxies {
					r.eng.Upsert(engine.Spec{UID: fmt.Sprint(i), Name: fmt.Sprint("p", i), Address: a,
						Interval: time.Second, Timeout: time.Second, SuccessThreshold: 2, FailureThreshold: 3})
				}
			}
			// Warm up: a second of each, for the session caches.
			for _, r := range runs {
				activate(r)
				second()
			}

			fc0, wall := f.cpu(), time.Now()
			b.ResetTimer()
			i := 0
			for b.Loop() {
				r := runs[i%len(runs)]
				i++
				activate(r)
				c := &counts{}
				cur.Store(c)
				c0 := cpuTime()
				second()
				r.p.cpu += cpuTime() - c0
				r.p.seconds++
				r.p.probes += c.probes.Load()
				r.p.failures += c.failures.Load()
				r.p.slowest = max(r.p.slowest, time.Duration(c.slowest.Load()))
			}
			b.StopTimer()
			elapsed := time.Since(wall)
			fc := f.cpu() - fc0

			for _, r := range runs {
				r.p.report(b, runs[0].p)
				b.ReportMetric(float64(r.p.slowest.Milliseconds()), r.p.name+"-max-ms")
				if r.p.seconds > 0 {
					b.ReportMetric(float64(r.p.probes)/float64(r.p.seconds)/float64(n), r.p.name+"-Hz/proxy")
				}
			}
			b.ReportMetric(fc/elapsed.Seconds(), "load-cores")
		})
	}
}

// second is the unit of BenchmarkProbeAt1Hz: one second of probing.
func second() {
	t := time.NewTimer(time.Second)
	<-t.C
}

// probeAt probes a spec's address without credentials.
func probeAt(p prober) engine.ProbeFunc {
	return func(ctx context.Context, s engine.Spec) probe.Result { return p.Probe(ctx, s.Address) }
}
