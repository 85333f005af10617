package store_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store/storetest"
)

// TestPublishPending_concurrentPublishers runs two publishers (two
// replicas) over the same outbox: every transition goes out exactly once,
// and each proxy's in sequence order.
func TestPublishPending_concurrentPublishers(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const proxies, perProxy = 5, 12
	var wg sync.WaitGroup
	// Transitions recorded concurrently too: sequences must still be
	// unique and increasing.
	for p := range proxies {
		wg.Go(func() {
			for i := range perProxy {
				if _, err := st.RecordTransition(ctx, engine.Transition{UID: fmt.Sprint("u", p), Name: fmt.Sprint("p", p),
					Healthy: i%2 == 0, Reason: "r", Time: time.Now()}, nil, "replica"); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()

	var mu sync.Mutex
	sent := map[int64]int{}
	order := map[string][]int64{}
	publisher := func() {
		for {
			n, err := st.PublishPending(ctx, 7, func(tr *healthv1.HealthTransition) error {
				mu.Lock()
				defer mu.Unlock()
				sent[tr.GetSequence()]++
				order[tr.GetProxyUid()] = append(order[tr.GetProxyUid()], tr.GetSequence())
				return nil
			})
			if err != nil {
				t.Error(err)
				return
			}
			if n == 0 {
				// The other publisher may hold the rest; done when nothing
				// is pending at all.
				var pending int
				if err := st.Pool().QueryRow(ctx, "SELECT count(*) FROM health.transitions WHERE NOT published").Scan(&pending); err != nil || pending == 0 {
					return
				}
			}
		}
	}
	wg.Go(publisher)
	wg.Go(publisher)
	wg.Wait()

	if len(sent) != proxies*perProxy {
		t.Fatalf("%d transitions sent, want %d", len(sent), proxies*perProxy)
	}
	for seq, n := range sent {
		if n != 1 {
			t.Errorf("sequence %d sent %d times", seq, n)
		}
	}
	for uid, seqs := range order {
		for i := 1; i < len(seqs); i++ {
			if seqs[i] <= seqs[i-1] {
				t.Errorf("%s published out of order: %v", uid, seqs)
				break
			}
		}
	}
}
