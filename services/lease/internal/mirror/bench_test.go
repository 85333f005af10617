package mirror_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/proxysync/proxysynctest"
	lt "github.com/egress-proxies/egress-proxies/services/lease/internal/leasetest"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/metrics"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/mirror"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/store"
)

// BenchmarkResync: a full resync of the proxy mirror from an orchestrator
// holding N proxies (BENCH_RESYNC_SIZES, default "10000"; the orchestrator
// answers from memory, so this is the lease service's own part): the first
// into an empty mirror; one of the same listing revision (another
// replica's resync of the same state: nothing to write); and one at a
// newer revision with the same proxies (the periodic resync). Each proxy
// carries the revision of its last change (1 to N) as the orchestrator
// lists them, so that the periodic resync finds every proxy unchanged;
// with BENCH_RESYNC_NO_PROXY_REVISION set it does not, and every row takes
// the listing's revision. Reports seconds per resync and the Go
// heap the service holds after them, per proxy (the mirror itself is in
// PostgreSQL).
func BenchmarkResync(b *testing.B) {
	for _, n := range proxysynctest.BenchSizes(b) {
		b.Run(fmt.Sprintf("proxies=%d", n), func(b *testing.B) {
			ctx := context.Background()
			db := benchDB(b)
			proxies := make([]*proxyv1.Proxy, n)
			for i := range proxies {
				proxies[i] = lt.Proxy(fmt.Sprintf("%08x-0000-4000-8000-%012x", i, i), fmt.Sprintf("proxy-%06d", i))
				if os.Getenv("BENCH_RESYNC_NO_PROXY_REVISION") == "" {
					proxies[i].Revision = int64(i) + 1
				}
			}
			l, err := proxysynctest.NewListing(proxies, int64(n)+1)
			if err != nil {
				b.Fatal(err)
			}
			proxies = nil
			for i := 0; i < b.N; i++ {
				revision := int64(n) + 1
				l.SetRevision(revision)
				if _, err := db.Exec(ctx, `TRUNCATE lease.proxies CASCADE`); err != nil {
					b.Fatal(err)
				}
				st := store.New(db, store.Config{DefaultMaxLeases: 1})
				log := slog.New(slog.DiscardHandler)
				syncer := mirror.New(st, nil, mirror.Config{Lister: l, ResyncTimeout: 10 * time.Minute},
					metrics.New(prometheus.NewRegistry(), st, log), log)
				heapBefore := proxysynctest.HeapInUse()
				start := time.Now()
				if err := syncer.Resync(ctx); err != nil {
					b.Fatal(err)
				}
				first := time.Since(start)
				start = time.Now()
				if err := syncer.Resync(ctx); err != nil {
					b.Fatal(err)
				}
				again := time.Since(start)
				revision++
				l.SetRevision(revision)
				start = time.Now()
				if err := syncer.Resync(ctx); err != nil {
					b.Fatal(err)
				}
				newer := time.Since(start)
				var leasable int
				if err := db.QueryRow(ctx, `SELECT count(*) FROM lease.proxies WHERE leasable`).Scan(&leasable); err != nil || leasable != n {
					b.Fatalf("%d leasable proxies after the resync (%v), want %d", leasable, err, n)
				}
				heap := proxysynctest.HeapInUse() - heapBefore
				runtime.KeepAlive(syncer)
				b.ReportMetric(first.Seconds(), "s/first-resync")
				b.ReportMetric(again.Seconds(), "s/same-revision-resync")
				b.ReportMetric(newer.Seconds(), "s/newer-revision-resync")
				b.ReportMetric(float64(heap)/float64(n), "heap-B/proxy")
			}
		})
	}
}

// BenchmarkFollow: N proxies' creation events (BENCH_RESYNC_SIZES, default
// "10000"), already in the stream, applied by a syncer following it from
// the start, as a replica does after a converge of N proxies: reports the
// events applied per second.
func BenchmarkFollow(b *testing.B) {
	for _, n := range proxysynctest.BenchSizes(b) {
		b.Run(fmt.Sprintf("proxies=%d", n), func(b *testing.B) {
			ctx := context.Background()
			db := benchDB(b)
			for i := 0; i < b.N; i++ {
				nsrv := natstest.New(b)
				names := bus.Names{Prefix: "follow"}
				js := nsrv.JetStream(b)
				if err := bus.EnsureStreams(ctx, js, names); err != nil {
					b.Fatal(err)
				}
				for j := range n {
					uid := fmt.Sprintf("%08x-0000-4000-8000-%012x", j, j)
					msg, err := bus.Message(ctx, names.ProxyEventSubject(uid), &busv1.ProxyEvent{
						Revision: int64(j + 1), Type: proxyv1.ChangeType_CHANGE_TYPE_CREATED, Proxy: lt.Proxy(uid, fmt.Sprintf("proxy-%06d", j)),
					})
					if err != nil {
						b.Fatal(err)
					}
					if _, err := js.PublishMsgAsync(msg); err != nil {
						b.Fatal(err)
					}
					if j%1000 == 999 || j == n-1 {
						// At most a thousand unacknowledged: the client
						// refuses to run further ahead.
						select {
						case <-js.PublishAsyncComplete():
						case <-time.After(time.Minute):
							b.Fatal("publishing the events timed out")
						}
					}
				}
				if _, err := db.Exec(ctx, `TRUNCATE lease.proxies CASCADE`); err != nil {
					b.Fatal(err)
				}
				st := store.New(db, store.Config{DefaultMaxLeases: 1})
				log := slog.New(slog.DiscardHandler)
				syncer := mirror.New(st, js, mirror.Config{Names: names}, metrics.New(prometheus.NewRegistry(), st, log), log)
				rctx, cancel := context.WithCancel(ctx)
				done := make(chan struct{})
				start := time.Now()
				go func() { defer close(done); _ = syncer.Run(rctx) }()
				for {
					var leasable int
					if err := db.QueryRow(ctx, `SELECT count(*) FROM lease.proxies WHERE leasable`).Scan(&leasable); err != nil {
						b.Fatal(err)
					}
					if leasable == n {
						break
					}
					if time.Since(start) > 30*time.Minute {
						b.Fatalf("%d of %d proxies applied after 30 minutes", leasable, n)
					}
					time.Sleep(50 * time.Millisecond) // polling the mirror
				}
				took := time.Since(start)
				cancel()
				<-done
				nsrv.Stop()
				b.ReportMetric(float64(n)/took.Seconds(), "events/s")
				b.ReportMetric(took.Seconds(), "s/all-applied")
			}
		})
	}
}

// benchDB is a database of the benchmark's own, closed when it ends.
func benchDB(b *testing.B) *pgxpool.Pool {
	db, err := pgxpool.New(context.Background(), lt.Database(b))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(db.Close)
	return db
}
