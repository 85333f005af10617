package store_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/egress-proxies/egress-proxies/services/lease/internal/leasetest"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/store"
)

// BenchmarkLoop runs the crawler loop (acquire → report → release) of 200
// concurrent callers straight on the store, without gRPC: what one replica
// commits against this PostgreSQL server. One iteration is one loop. With
// cooldowns, that many cooldowns are in force on targets the callers do
// not fetch (a ban wave elsewhere), which must not slow their acquires.
// With proxies, the pool holds that many instead of 1,000: the selection's
// cost must not grow with the pool (callers=200/rounds=1 at 1,000 against
// proxies=100000 is that comparison). The clock starts after the replica
// has read the pool once.
func BenchmarkLoop(b *testing.B) {
	for _, bc := range []struct{ callers, rounds, cooldowns, proxies int }{
		{1, 1, 0, 0}, {200, 1, 0, 0}, {200, 2, 0, 0}, {200, 3, 0, 0}, {200, 1, 5000, 0}, {200, 1, 0, 100000},
	} {
		callers := bc.callers
		name := fmt.Sprintf("callers=%d/rounds=%d", bc.callers, bc.rounds)
		if bc.cooldowns > 0 {
			name += fmt.Sprintf("/cooldowns=%d", bc.cooldowns)
		}
		size := 1000
		if bc.proxies > 0 {
			size = bc.proxies
			name += fmt.Sprintf("/proxies=%d", bc.proxies)
		}
		b.Run(name, func(b *testing.B) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			db, err := pgxpool.New(ctx, leasetest.Database(b))
			if err != nil {
				b.Fatal(err)
			}
			defer db.Close()
			var rounds, ops atomic.Int64
			st := store.New(db, store.Config{DefaultMaxLeases: 1, Rounds: bc.rounds, OnRound: func(n int, _ time.Duration) {
				rounds.Add(1)
				ops.Add(int64(n))
			}})
			pool := make([]store.ProxyState, size)
			for i := range pool {
				uid := fmt.Sprintf("10ad0000-0000-4000-8000-%012d", i)
				pool[i] = store.ProxyState{UID: uid, Name: fmt.Sprintf("p-%06d", i), Provider: "bench",
					Host: fmt.Sprintf("10.%d.%d.%d", i/62500, i/250%250, i%250+1), Port: 3128, ProviderID: "bench/" + uid, Ready: true, Healthy: true}
			}
			if _, _, err := st.ApplySnapshot(ctx, pool, []int64{1}); err != nil {
				b.Fatal(err)
			}
			if _, err := db.Exec(ctx, `INSERT INTO lease.cooldowns (proxy_uid, target_host, expire_time, outcome)
				SELECT uid, 'banned-' || g || '.example.com', now() + interval '1 hour', 3
				FROM lease.proxies, generate_series(1, $1::int / 1000) g`, bc.cooldowns); err != nil {
				b.Fatal(err)
			}
			if _, err := db.Exec(ctx, `ANALYZE lease.cooldowns, lease.proxies`); err != nil { // as autovacuum soon would
				b.Fatal(err)
			}
			done := make(chan struct{})
			go func() { defer close(done); _ = st.Run(ctx) }()
			defer func() { cancel(); <-done }()

			// One loop before the clock starts: the replica's first read of
			// the whole pool is its start, not the selection's cost.
			l, err := st.Acquire(ctx, store.AcquireRequest{ClientID: "warm-up", TTL: time.Minute})
			if err != nil {
				b.Fatal(err)
			}
			if _, err := st.Release(ctx, "warm-up", l.ID); err != nil {
				b.Fatal(err)
			}
			rounds.Store(0)
			ops.Store(0)

			var next atomic.Int64
			var wg sync.WaitGroup
			b.ResetTimer()
			for c := range callers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					client := fmt.Sprintf("client-%d", c)
					for i := next.Add(1); i <= int64(b.N); i = next.Add(1) {
						l, err := st.Acquire(ctx, store.AcquireRequest{ClientID: client, TargetHost: fmt.Sprintf("site-%d.example.com", i%50), TTL: time.Minute})
						if err != nil {
							b.Error(err)
							return
						}
						if _, err := st.Report(ctx, store.ReportRequest{ClientID: client, LeaseID: l.ID, Outcome: 1}); err != nil {
							b.Error(err)
							return
						}
						if ok, err := st.Release(ctx, client, l.ID); err != nil || !ok {
							b.Errorf("release: %v %v", ok, err)
							return
						}
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "loops/s")
			if r := rounds.Load(); r > 0 {
				b.ReportMetric(float64(ops.Load())/float64(r), "ops/round")
			}
		})
	}
}
