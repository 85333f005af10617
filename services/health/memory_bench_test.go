package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/proxysync/proxysynctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/proxytest"
)

// BenchmarkProcessMemory: the health service as a process, one replica,
// probing N proxies (BENCH_RESYNC_SIZES, default "10000") that it learns
// from its resync at start, from an orchestrator's ListProxies served over
// gRPC from memory (proxysynctest.Server, pages of 1,000 as the
// orchestrator pages them). The proxies are 16 real CONNECT proxies in
// this process, each behind N/16 proxies of the listing, in front of a
// real TLS target; the service probes each every 10 minutes (first probe
// at a random point of that, no fast re-probes, a verdict on the first
// success), some 170 probes a second at 100,000, so probing does not
// saturate the machine. Reports the service's VmRSS and RssAnon (from
// /proc/<pid>/status) once the first resync has logged, and again after
// BENCH_STEADY_SECONDS (default 60) of probing, whole and per proxy, with
// the service's CPU over those seconds as a share of one core and the
// transitions it recorded and published a second over them. ns/op is
// the time from starting the process to the end of its first resync.
//
//	BENCH_RESYNC_SIZES="10000 100000" go test -run '^$' -bench BenchmarkProcessMemory -benchtime 1x .
func BenchmarkProcessMemory(b *testing.B) {
	steady := 60 * time.Second
	if v := os.Getenv("BENCH_STEADY_SECONDS"); v != "" {
		s, err := strconv.Atoi(v)
		if err != nil || s < 0 {
			b.Fatalf("BENCH_STEADY_SECONDS: %q is not a number of seconds", v)
		}
		steady = time.Duration(s) * time.Second
	}
	for _, n := range proxysynctest.BenchSizes(b) {
		b.Run(fmt.Sprintf("proxies=%d", n), func(b *testing.B) {
			for range b.N {
				processMemory(b, n, steady)
			}
		})
	}
}

func processMemory(b *testing.B, n int, steady time.Duration) {
	e := newEnv(b)
	farm := make([]*proxytest.Proxy, 16)
	for i := range farm {
		farm[i] = proxytest.StartProxy(b, proxytest.Behaviour{})
	}
	proxies := make([]*proxyv1.Proxy, n)
	for i := range proxies {
		proxies[i] = external(b, fmt.Sprintf("%08x-0000-4000-8000-%012x", i, i), fmt.Sprintf("p-%d", i), farm[i%len(farm)].Addr())
	}
	listing, err := proxysynctest.NewListing(proxies, int64(n)+1)
	if err != nil {
		b.Fatal(err)
	}
	proxies = nil
	gs := grpc.NewServer()
	proxyv1.RegisterProxyServiceServer(gs, proxysynctest.Server{Listing: listing})
	orchAddr := grpctest.Serve(b, gs)

	proctest.Build(b, ".") // not timed: servicetest.Start finds it built
	b.ResetTimer()
	p, _ := servicetest.Start(b, ".", e.args("replica-a",
		"--orchestrator-addr="+orchAddr, "--resync-interval=1h",
		"--probe-interval=10m", "--probe-timeout=10s", "--probe-fast-interval=0",
		"--success-threshold=1", "--failure-threshold=2", "--state-flush-interval=2s",
		"--log-level=info"))
	resynced := p.WaitLog(b, 5*time.Minute, func(l map[string]any) bool {
		return l["msg"] == "probed proxies resynced from the orchestrator" && l["proxies"] == float64(n)
	})
	b.StopTimer()
	pid := p.PID()
	report := func(when string) {
		rss, anon := proctest.StatusBytes(b, pid, "VmRSS"), proctest.StatusBytes(b, pid, "RssAnon")
		b.ReportMetric(float64(rss)/(1<<20), "rss-MiB-"+when)
		b.ReportMetric(float64(anon)/(1<<20), "anon-MiB-"+when)
		b.ReportMetric(float64(rss)/float64(n), "rss-B/proxy-"+when)
		b.ReportMetric(float64(anon)/float64(n), "anon-B/proxy-"+when)
	}
	report("resync")
	if d, ok := resynced["duration"].(float64); ok {
		b.ReportMetric(time.Duration(d).Seconds(), "s-resync")
	}

	db, err := pgx.Connect(context.Background(), e.dsn)
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close(context.Background())
	// The transitions stored and published so far (only the benchmark's
	// connection reads them, once at each end of the steady period).
	counts := func() (recorded, published float64) {
		if err := db.QueryRow(context.Background(),
			"SELECT count(*), count(*) FILTER (WHERE published) FROM health.transitions").Scan(&recorded, &published); err != nil {
			b.Fatal(err)
		}
		return recorded, published
	}
	r0, p0 := counts()
	c0, w0 := proctest.CPUTime(b, pid), time.Now()
	t := time.NewTimer(steady)
	<-t.C
	cpu, wall := proctest.CPUTime(b, pid)-c0, time.Since(w0)
	b.ReportMetric(100*float64(cpu)/float64(wall), "steady-cpu-%")
	r1, p1 := counts()
	b.ReportMetric((r1-r0)/wall.Seconds(), "recorded/s")
	b.ReportMetric((p1-p0)/wall.Seconds(), "published/s")
	report("steady")
	b.ReportMetric(float64(proctest.StatusBytes(b, pid, "VmHWM"))/(1<<20), "hwm-MiB")
	var probes int64
	for _, f := range farm {
		probes += f.Requests()
	}
	b.ReportMetric(float64(probes), "probes")
}
