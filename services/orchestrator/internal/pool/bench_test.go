package pool_test

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

// cpuTime is the process's user+system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkPool1000 runs a pool of 1,000 proxies on an instant backend
// (a provisioner that answers every command at once, health verdicts
// published as soon as a proxy runs), one orchestrator replica:
//
//	go test -run '^$' -bench BenchmarkPool1000 -benchtime 1x ./services/orchestrator/internal/pool/
//
// It reports the time from creating the pool to 1,000 Ready, the time of a
// full rotation after a template change (max_surge 100), and the CPU time
// of one controller sync of the settled pool, read, decide and write
// (measured over 50 syncs in this process).
func BenchmarkPool1000(b *testing.B) {
	const n = 1000
	for range b.N {
		h := orchtest.New(b)
		cloud := orchtest.NewCloud()
		h.StartProvisioner("fake", cloud.Answer)
		h.StartProvisioner("other", cloud.Answer)
		stopReplica := h.StartReplica()
		h.AutoHealth()
		ctx := context.Background()
		spec := orchtest.PoolSpec(n)
		spec.MaxSurge = 100
		start := time.Now()
		resp, err := h.Pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "big", Spec: spec})
		if err != nil {
			b.Fatal(err)
		}
		waitPoolFor(b, h, "big", "as wanted", 10*time.Minute, func(live, ready, _ []*lifecycle.Proxy) bool { return len(live) == n && len(ready) == n })
		up := time.Since(start)

		spec.Template.Spec.Placement.MachineType = "large"
		start = time.Now()
		if _, err := h.Pools.UpdateProxyPool(ctx, &proxyv1.UpdateProxyPoolRequest{Name: "big", Spec: spec, Generation: resp.GetPool().GetGeneration()}); err != nil {
			b.Fatal(err)
		}
		waitPoolFor(b, h, "big", "as wanted", 10*time.Minute, func(live, ready, draining []*lifecycle.Proxy) bool {
			if len(live) != n || len(ready) != n || len(draining) != 0 {
				return false
			}
			for _, r := range live {
				if r.Spec.GetPlacement().GetMachineType() != "large" {
					return false
				}
			}
			return true
		})
		rotate := time.Since(start)

		// The controller's own cost on the settled pool: syncs in this
		// process, by its CPU time, with the replica stopped so that only
		// these syncs run (and none is skipped for a pool the replica
		// holds).
		stopReplica()
		ctrl := h.Controller()
		if err := ctrl.Sync(ctx, "big"); err != nil {
			b.Fatal(err)
		}

		const syncs = 50
		cpu0, wall0 := cpuTime(), time.Now()
		for range syncs {
			if err := ctrl.Sync(ctx, "big"); err != nil {
				b.Fatal(err)
			}
		}
		cpu := (cpuTime() - cpu0) / syncs
		wall := time.Since(wall0) / syncs
		if got := testutil.ToFloat64(ctrl.Metrics.Claimed); got != syncs+1 {
			b.Fatalf("%v syncs claimed the pool, want %d", got, syncs+1)
		}

		b.ReportMetric(up.Seconds(), "s-0-to-1000-ready")
		b.ReportMetric(rotate.Seconds(), "s-full-rotation")
		b.ReportMetric(float64(cpu.Microseconds())/1000, "cpu-ms/sync-of-1000")
		b.ReportMetric(float64(wall.Microseconds())/1000, "ms/sync-of-1000")
	}
}
