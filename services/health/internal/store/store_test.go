package store_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store"
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
			n, _, err := st.PublishPending(ctx, 7, func(page []*healthv1.HealthTransition) error {
				mu.Lock()
				defer mu.Unlock()
				for _, tr := range page {
					sent[tr.GetSequence()]++
					order[tr.GetProxyUid()] = append(order[tr.GetProxyUid()], tr.GetSequence())
				}
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

func TestRecordTransition_repeatIsNotAFlip(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	ctx := context.Background()
	record := func(provider string, creds time.Time, healthy bool) *healthv1.HealthTransition {
		t.Helper()
		tr, err := st.RecordTransition(ctx, engine.Transition{UID: "u1", Name: "p1", ProviderID: provider, CredentialsTime: creds,
			Healthy: healthy, Time: time.Now()}, nil, "r")
		if err != nil {
			t.Fatal(err)
		}
		return tr
	}
	c1 := time.Date(2026, 12, 5, 12, 0, 0, 123456000, time.UTC)
	c2 := c1.Add(time.Hour)
	steps := []struct {
		provider string
		creds    time.Time
		healthy  bool
		stored   bool
	}{
		{"vm-1", time.Time{}, true, true},
		{"vm-1", time.Time{}, true, false}, // another replica's first verdict, the same
		{"vm-1", time.Time{}, false, true},
		{"vm-1", time.Time{}, false, false},
		{"vm-2", time.Time{}, false, true}, // a new instance's first verdict is news
		{"vm-2", time.Time{}, true, true},
		{"vm-2", c1, true, true}, // the same provider ID, new credentials: a new instance
		{"vm-2", c1, true, false},
		{"vm-2", c2, true, true},
	}
	for i, s := range steps {
		if got := record(s.provider, s.creds, s.healthy); (got != nil) != s.stored {
			t.Errorf("step %d (%s %v healthy=%v): stored=%v, want %v", i, s.provider, s.creds, s.healthy, got != nil, s.stored)
		}
	}
	ts, err := st.TransitionsAfter(ctx, 0, 100)
	if err != nil || len(ts) != 6 {
		t.Fatalf("%d transitions stored (%v), want 6", len(ts), err)
	}
}

func TestSaveStates_neverRegresses(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	ctx := context.Background()
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	state := func(provider string, known bool, at time.Time) engine.State {
		return engine.State{Spec: engine.Spec{UID: "u1", Name: "p1", ProviderID: provider, Address: "10.0.0.1:3128"},
			VerdictKnown: known, Healthy: known, LastProbe: at}
	}
	save := func(s engine.State) {
		t.Helper()
		if err := st.SaveStates(ctx, []engine.State{s}, "r"); err != nil {
			t.Fatal(err)
		}
	}
	known := func() bool {
		t.Helper()
		h, err := st.GetProxy(ctx, "p1")
		if err != nil {
			t.Fatal(err)
		}
		return h.GetVerdictKnown()
	}
	save(state("vm-1", true, t0.Add(2*time.Second)))
	save(state("vm-1", false, t0.Add(time.Second))) // a batch taken before the transition
	if !known() {
		t.Error("an older state overwrote a newer one")
	}
	save(state("vm-1", true, time.Time{})) // a new owner that has not probed yet
	if h, _ := st.GetProxy(ctx, "p1"); !h.GetLastProbeTime().AsTime().Equal(t0.Add(2 * time.Second)) {
		t.Errorf("a state without a probe replaced one with: %v", h)
	}
	save(state("vm-2", false, t0)) // a new instance replaces whatever was
	if known() {
		t.Error("a new instance's state was not written")
	}
}

// DeleteProxy removes what was stored for the snapshots up to the given
// revision, never a state written for a later one.
func TestDeleteProxy_throughRevision(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	ctx := context.Background()
	s := engine.State{Spec: engine.Spec{UID: "u1", Name: "p1", ProviderID: "vm-1", Address: "10.0.0.1:3128", Revision: 5},
		VerdictKnown: true, Healthy: true, LastProbe: time.Now()}
	if err := st.SaveStates(ctx, []engine.State{s}, "r"); err != nil {
		t.Fatal(err)
	}
	if err := st.DeleteProxy(ctx, "u1", 4); err != nil {
		t.Fatal(err)
	}
	if _, err := st.GetProxy(ctx, "p1"); err != nil {
		t.Fatalf("a deletion as of revision 4 removed the state of revision 5: %v", err)
	}
	if err := st.DeleteProxy(ctx, "u1", 5); err != nil {
		t.Fatal(err)
	}
	if h, err := st.GetProxy(ctx, "p1"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("after a deletion as of revision 5: %v, %v; want not found", h, err)
	}
}

// RecordTransitions applies the repeat rule within a batch as across
// batches, and gives the stored ones increasing sequences in the order
// given, a proxy's several transitions included.
func TestRecordTransitions_batch(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	ctx := context.Background()
	c1 := time.Date(2026, 12, 5, 12, 0, 0, 123456000, time.UTC)
	tr := func(uid, provider string, creds time.Time, healthy bool) store.Record {
		return store.Record{Transition: engine.Transition{UID: uid, Name: "p-" + uid, ProviderID: provider, CredentialsTime: creds,
			Healthy: healthy, Reason: fmt.Sprint(healthy), Time: time.Now()}}
	}
	// Stored before the batch: u1 healthy on vm-1, u3 unhealthy on vm-3.
	for _, r := range []store.Record{tr("u1", "vm-1", time.Time{}, true), tr("u3", "vm-3", c1, false)} {
		if _, err := st.RecordTransition(ctx, r.Transition, nil, "r"); err != nil {
			t.Fatal(err)
		}
	}
	state := engine.State{Spec: engine.Spec{UID: "u2", Name: "p-u2", ProviderID: "vm-2", Address: "10.0.0.2:3128"},
		VerdictKnown: true, Healthy: true, Reason: "true", LastProbe: time.Now()}
	withState := tr("u2", "vm-2", time.Time{}, false)
	withState.State = &state
	batch := []struct {
		rec    store.Record
		stored bool
	}{
		{tr("u1", "vm-1", time.Time{}, true), false}, // repeats the stored one
		{tr("u1", "vm-1", time.Time{}, false), true},
		{tr("u2", "vm-2", time.Time{}, true), true},
		{tr("u1", "vm-1", time.Time{}, false), false}, // repeats the one just before in the batch
		{tr("u3", "vm-3", c1, false), false},
		{tr("u1", "vm-1", time.Time{}, true), true},
		{tr("u3", "vm-3", c1.Add(time.Hour), false), true}, // a new instance's first verdict is news
		{withState, true},
		{tr("u2", "vm-9", time.Time{}, false), true}, // another instance
	}
	recs := make([]store.Record, len(batch))
	for i, b := range batch {
		recs[i] = b.rec
	}
	got, err := st.RecordTransitions(ctx, recs, "r")
	if err != nil || len(got) != len(recs) {
		t.Fatalf("RecordTransitions = %d results, %v", len(got), err)
	}
	var seqs []int64
	for i, b := range batch {
		if (got[i] != nil) != b.stored {
			t.Errorf("item %d (%s %s healthy=%v): stored=%v, want %v", i, b.rec.Transition.UID, b.rec.Transition.ProviderID,
				b.rec.Transition.Healthy, got[i] != nil, b.stored)
			continue
		}
		if got[i] != nil {
			if got[i].GetProxyUid() != b.rec.Transition.UID || got[i].GetHealthy() != b.rec.Transition.Healthy {
				t.Errorf("item %d returned %v", i, got[i])
			}
			seqs = append(seqs, got[i].GetSequence())
		}
	}
	// The table holds them in batch order after the two stored before.
	ts, err := st.TransitionsAfter(ctx, 2, 100)
	if err != nil || len(ts) != len(seqs) {
		t.Fatalf("%d transitions stored after the first two (%v), want %d", len(ts), err, len(seqs))
	}
	var storedItems []store.Record
	for i, b := range batch {
		if b.stored {
			storedItems = append(storedItems, recs[i])
		}
	}
	for i, s := range ts {
		want := storedItems[i].Transition
		if s.GetSequence() != seqs[i] || s.GetProxyUid() != want.UID || s.GetHealthy() != want.Healthy || s.GetProviderId() != want.ProviderID {
			t.Errorf("row %d: sequence %d %s %s healthy=%v; want sequence %d %s %s healthy=%v (the batch order)", i, s.GetSequence(),
				s.GetProxyUid(), s.GetProviderId(), s.GetHealthy(), seqs[i], want.UID, want.ProviderID, want.Healthy)
		}
	}
	if h, err := st.GetProxy(ctx, "p-u2"); err != nil || h.GetAddress() != "10.0.0.2:3128" {
		t.Errorf("the state given with a transition: %v, %v", h, err)
	}
	// Across batches: the last of each proxy is what a repeat is checked
	// against.
	again, err := st.RecordTransitions(ctx, []store.Record{tr("u1", "vm-1", time.Time{}, true), tr("u2", "vm-9", time.Time{}, false),
		tr("u2", "vm-9", time.Time{}, true)}, "r")
	if err != nil || again[0] != nil || again[1] != nil || again[2] == nil {
		t.Errorf("second batch = %v, %v; want only the flip of u2 stored", again, err)
	}
}

// A batch PostgreSQL refuses is refused whole, marked store.ErrRejected:
// neither its other transitions nor its states are half written.
func TestRecordTransitions_rejectedWritesNothing(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	ctx := context.Background()
	state := engine.State{Spec: engine.Spec{UID: "u1", Name: "p1", ProviderID: "vm-1", Address: "10.0.0.1:3128"},
		VerdictKnown: true, Healthy: true, LastProbe: time.Now()}
	_, err := st.RecordTransitions(ctx, []store.Record{
		{Transition: engine.Transition{UID: "u1", Name: "p1", ProviderID: "vm-1", Healthy: true, Time: time.Now()}, State: &state},
		// PostgreSQL text holds no NUL byte.
		{Transition: engine.Transition{UID: "u2", Name: "p2", ProviderID: "vm-2", Healthy: true, Message: "bad\x00reply", Time: time.Now()}},
	}, "r")
	if !errors.Is(err, store.ErrRejected) {
		t.Fatalf("RecordTransitions = %v, want ErrRejected", err)
	}
	if ts, err := st.TransitionsAfter(ctx, 0, 10); err != nil || len(ts) != 0 {
		t.Errorf("transitions after a refused batch: %v, %v", ts, err)
	}
	if h, err := st.GetProxy(ctx, "p1"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("state after a refused batch: %v, %v", h, err)
	}
}

// PublishPending says when another call may find more: a full page, or a
// proxy of the page with a later transition pending.
func TestPublishPending_more(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	ctx := context.Background()
	record := func(uids ...string) {
		t.Helper()
		for _, uid := range uids {
			if _, err := st.RecordTransition(ctx, engine.Transition{UID: uid, Name: "p-" + uid, Healthy: uid == "u1", Time: time.Now()}, nil, "r"); err != nil {
				t.Fatal(err)
			}
			if uid == "u1" { // a second, unhealthy, transition of u1
				if _, err := st.RecordTransition(ctx, engine.Transition{UID: uid, Name: "p-" + uid, Time: time.Now()}, nil, "r"); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	none := func([]*healthv1.HealthTransition) error { return nil }
	check := func(step string, wantN int, wantMore bool) {
		t.Helper()
		n, more, err := st.PublishPending(ctx, 3, none)
		if err != nil || n != wantN || more != wantMore {
			t.Errorf("%s: PublishPending = %d, %v, %v; want %d, %v", step, n, more, err, wantN, wantMore)
		}
	}
	record("u1", "u2")
	check("u1 and u2, u1's second pending", 2, true)
	check("u1's second", 1, false)
	check("nothing", 0, false)
	record("u3", "u4", "u5")
	check("a full page", 3, true)
	check("nothing", 0, false)
}
