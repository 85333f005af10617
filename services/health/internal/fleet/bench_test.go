package fleet_test

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"testing"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/proxysync/proxysynctest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/fleet"
	"github.com/egress-proxies/egress-proxies/services/health/internal/probe"
)

// BenchmarkResync: a replica's full resync of the probed proxies from an
// orchestrator holding N proxies (BENCH_RESYNC_SIZES, default "10000"; the
// orchestrator answers from memory, so this is the health service's own
// part), with the engine the service runs (probes answer at once, every
// hour, so that few run meanwhile): the first into an empty fleet, then one
// at a newer revision with the same proxies (the periodic resync). Reports
// seconds per resync and the Go heap the fleet and engine hold, per proxy.
func BenchmarkResync(b *testing.B) {
	for _, n := range proxysynctest.BenchSizes(b) {
		b.Run(fmt.Sprintf("proxies=%d", n), func(b *testing.B) {
			proxies := make([]*proxyv1.Proxy, n)
			for i := range proxies {
				proxies[i] = proxy(fmt.Sprintf("%08x-0000-4000-8000-%012x", i, i), running, fmt.Sprintf("10.%d.%d.%d", i>>16&0xff, i>>8&0xff, i&0xff))
			}
			l, err := proxysynctest.NewListing(proxies, int64(n)+1)
			if err != nil {
				b.Fatal(err)
			}
			proxies = nil
			for i := 0; i < b.N; i++ {
				l.SetRevision(int64(n) + 1)
				heapBefore := proxysynctest.HeapInUse()
				eng := engine.New(engine.Config{
					Probe: func(context.Context, engine.Spec) probe.Result {
						return probe.Result{OK: true, Reason: probe.ReasonSucceeded}
					},
					MaxConcurrent: 64,
				})
				f := &fleet.Fleet{Engine: eng, Log: slog.New(slog.DiscardHandler),
					Defaults: engine.Defaults{Interval: time.Hour, Timeout: 10 * time.Second, SuccessThreshold: 2, FailureThreshold: 3}}
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan struct{})
				go func() { defer close(done); _ = eng.Run(ctx) }()
				start := time.Now()
				listed, changed, _, err := f.Resync(ctx, l)
				first := time.Since(start)
				if err != nil || listed != n || changed != n {
					b.Fatalf("first resync: %d listed, %d changed, %v; want %d", listed, changed, err, n)
				}
				l.SetRevision(int64(n) + 2)
				start = time.Now()
				if _, _, _, err := f.Resync(ctx, l); err != nil {
					b.Fatal(err)
				}
				newer := time.Since(start)
				heap := proxysynctest.HeapInUse() - heapBefore
				cancel()
				<-done
				runtime.KeepAlive(f)
				b.ReportMetric(first.Seconds(), "s/first-resync")
				b.ReportMetric(newer.Seconds(), "s/newer-revision-resync")
				b.ReportMetric(float64(heap)/float64(n), "heap-B/proxy")
			}
		})
	}
}
