// Package bench measures how many proxies one health instance probes at
// 1 Hz: the real engine and prober against Go CONNECT proxies and a TLS
// target running in a separate process (internal/bench/farm), so that the
// CPU measured is the prober's alone. Run with
//
//	go test -run '^$' -bench . -benchtime 20x -cpu 1 ./internal/bench/
//
// Each iteration is one second of wall time; -cpu 1 gives the prober one
// core.
package bench

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
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

func BenchmarkProbeAt1Hz(b *testing.B) {
	bin := proctest.Build(b, "farm")
	for _, n := range []int{500, 1000} {
		b.Run(fmt.Sprintf("proxies=%d", n), func(b *testing.B) {
			farm := proctest.Start(b, bin, []string{fmt.Sprintf("-proxies=%d", n)})
			ready := farm.WaitLog(b, time.Minute, proctest.Msg("farm ready"))
			roots := x509.NewCertPool()
			if !roots.AppendCertsFromPEM([]byte(ready["ca"].(string))) {
				b.Fatal("farm CA")
			}
			prober, err := probe.New(probe.Options{Target: ready["target"].(string), TLSConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}})
			if err != nil {
				b.Fatal(err)
			}
			var probes, failures, slowest atomic.Int64
			eng := engine.New(engine.Config{
				Probe: prober.Probe,
				OnResult: func(_ engine.Spec, r probe.Result) {
					probes.Add(1)
					if !r.OK {
						failures.Add(1)
					}
					for {
						s := slowest.Load()
						if int64(r.Latency) <= s || slowest.CompareAndSwap(s, int64(r.Latency)) {
							break
						}
					}
				},
			})
			for i, a := range ready["proxies"].([]any) {
				eng.Upsert(engine.Spec{UID: fmt.Sprint(i), Name: fmt.Sprint("p", i), Address: a.(string),
					Interval: time.Second, Timeout: time.Second, SuccessThreshold: 2, FailureThreshold: 3})
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- eng.Run(ctx) }()
			// Warm up one interval: the jittered first round, the TLS
			// session cache.
			warm := time.NewTimer(2 * time.Second)
			<-warm.C

			farmCPU := func() float64 {
				logs := farm.Logs()
				for i := len(logs) - 1; i >= 0; i-- {
					if v, ok := logs[i]["cpu_seconds"].(float64); ok {
						return v
					}
				}
				return 0
			}
			fc0 := farmCPU()
			p0, f0, c0, t0 := probes.Load(), failures.Load(), cpuTime(), time.Now()
			slowest.Store(0)
			b.ResetTimer()
			for b.Loop() {
				tick := time.NewTimer(time.Second)
				<-tick.C
			}
			b.StopTimer()
			elapsed, cpu, fc1 := time.Since(t0), cpuTime()-c0, farmCPU()
			got, failed := probes.Load()-p0, failures.Load()-f0
			cancel()
			<-done

			b.ReportMetric(float64(got)/elapsed.Seconds(), "probes/s")
			b.ReportMetric(float64(got)/elapsed.Seconds()/float64(n), "Hz/proxy")
			if got > 0 {
				b.ReportMetric(float64(cpu.Microseconds())/float64(got), "cpu-µs/probe")
			}
			b.ReportMetric(cpu.Seconds()/elapsed.Seconds(), "cores")
			b.ReportMetric((fc1-fc0)/elapsed.Seconds(), "load-cores")
			b.ReportMetric(float64(failed), "failures")
			b.ReportMetric(float64(time.Duration(slowest.Load()).Milliseconds()), "max-ms")
		})
	}
}
