package transitions_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store/storetest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/transitions"
)

// lockCounter counts the statements that take the transitions lock, sent
// alone or in a batch.
type lockCounter struct{ n atomic.Int64 }

func (c *lockCounter) count(sql string) {
	if strings.Contains(sql, "pg_advisory_xact_lock") {
		c.n.Add(1)
	}
}

func (c *lockCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.count(d.SQL)
	return ctx
}
func (c *lockCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *lockCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (c *lockCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	c.count(d.SQL)
}
func (c *lockCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// runRecorder runs rec until the test ends.
func runRecorder(t *testing.T, rec *transitions.Recorder) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rec.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
}

// waitStored waits until want transitions are stored.
func waitStored(t *testing.T, st *store.Store, want int) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		ts, err := st.TransitionsAfter(context.Background(), 0, want+10)
		if err == nil && len(ts) >= want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d transitions stored (%v), want %d", len(ts), err, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRecorder_batches: what is queued is stored in one transaction per
// batch — one lock, one Stored call — not one per transition.
func TestRecorder_batches(t *testing.T) {
	t.Parallel()
	dsn, _ := storetest.New(t)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	locks := &lockCounter{}
	cfg.ConnConfig.Tracer = locks
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	st := store.New(pool)

	var storedCalls atomic.Int64
	rec := &transitions.Recorder{Store: st, Prober: "replica-a", Log: slog.New(slog.DiscardHandler),
		State: func(uid string) (engine.State, bool) {
			return engine.State{Spec: engine.Spec{UID: uid, Name: "p-" + uid, ProviderID: "vm-" + uid}, VerdictKnown: true, Healthy: true}, true
		},
		Stored: func() { storedCalls.Add(1) }}
	const n = 300 // two batches
	for i := range n {
		uid := fmt.Sprint("u", i)
		rec.Add(engine.Transition{UID: uid, Name: "p-" + uid, ProviderID: "vm-" + uid, Healthy: true, Reason: "ProbeSucceeded", Time: t0})
	}
	runRecorder(t, rec)
	waitStored(t, st, n)
	if got := locks.n.Load(); got > 2 {
		t.Errorf("%d transitions stored under %d locks (transactions), want at most 2", n, got)
	}
	if got := storedCalls.Load(); got > 2 {
		t.Errorf("Stored called %d times for %d transitions, want once a batch", got, n)
	}
	// Every state was written with its transition.
	var states int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM health.proxy_health").Scan(&states); err != nil || states != n {
		t.Errorf("%d states written (%v), want %d", states, err, n)
	}
}

// TestRecorder_refusedTransitionHoldsNoOtherBack: a transition PostgreSQL
// refuses (a NUL byte in its message) is dropped with a warning; the
// others of its batch and those queued after it are stored, in order.
func TestRecorder_refusedTransitionHoldsNoOtherBack(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	var logs syncBuffer
	rec := &transitions.Recorder{Store: st, Prober: "replica-a", Log: slog.New(slog.NewJSONHandler(&logs, nil))}
	for i, msg := range []string{"200 OK", "bad\x00reply", "200 OK", "200 OK"} {
		uid := fmt.Sprint("u", i)
		rec.Add(engine.Transition{UID: uid, Name: "p-" + uid, ProviderID: "vm-" + uid, Healthy: true, Message: msg, Time: t0})
	}
	runRecorder(t, rec)
	waitStored(t, st, 3)
	ts, err := st.TransitionsAfter(context.Background(), 0, 10)
	if err != nil {
		t.Fatal(err)
	}
	var uids []string
	for _, tr := range ts {
		uids = append(uids, tr.GetProxyUid())
	}
	if strings.Join(uids, " ") != "u0 u2 u3" {
		t.Errorf("stored %v, want u0 u2 u3 in order", uids)
	}
	if !strings.Contains(logs.String(), "refuses a health transition; it is dropped") || !strings.Contains(logs.String(), `"proxy_uid":"u1"`) {
		t.Errorf("no warning naming the dropped transition:\n%s", logs.String())
	}
	// Later transitions are stored as before.
	rec.Add(engine.Transition{UID: "u9", Name: "p-u9", ProviderID: "vm-u9", Healthy: true, Time: t0})
	waitStored(t, st, 4)
}

// TestPublisher_publishesAPageAtOnce: a sweep sends a page's events
// without waiting for each acknowledgement. The stand-in for JetStream
// here answers none until it holds every event of the page, or none came
// for a second: a publisher that waits for each ack before the next sends
// them one a second.
func TestPublisher_publishesAPageAtOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, st := storetest.New(t)
	srv := natstest.New(t)
	js := srv.JetStream(t)
	names := bus.Names{Prefix: fmt.Sprintf("inflight%d", time.Now().UnixNano())}
	const n = 50
	for i := range n {
		uid := fmt.Sprint("u", i)
		if _, err := st.RecordTransition(ctx, engine.Transition{UID: uid, Name: "p-" + uid, ProviderID: "vm-" + uid, Healthy: true, Time: t0}, nil, "r"); err != nil {
			t.Fatal(err)
		}
	}

	// No stream: this subscriber answers the publishes as JetStream would.
	nc := srv.Connect(t)
	var mu sync.Mutex
	var held []*nats.Msg
	var lastIn time.Time
	var firstAnswer int // how many were in flight when the first ack went out
	var seq uint64
	answer := func() {
		mu.Lock()
		defer mu.Unlock()
		if len(held) > 0 && firstAnswer == 0 {
			firstAnswer = len(held)
		}
		for _, m := range held {
			seq++
			ack, _ := json.Marshal(map[string]any{"stream": names.HealthEventStream(), "seq": seq})
			_ = m.Respond(ack)
		}
		held = nil
	}
	sub, err := nc.Subscribe(names.HealthEventSubjects(), func(m *nats.Msg) {
		mu.Lock()
		held = append(held, m)
		lastIn = time.Now()
		full := len(held) == n
		mu.Unlock()
		if full {
			answer()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	stop := make(chan struct{})
	tickDone := make(chan struct{})
	go func() {
		defer close(tickDone)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				mu.Lock()
				idle := time.Since(lastIn) >= time.Second
				mu.Unlock()
				if idle {
					answer()
				}
			}
		}
	}()
	defer func() { close(stop); <-tickDone }()

	pub := &transitions.Publisher{Store: st, JS: js, Names: names, Log: slog.New(slog.DiscardHandler)}
	if err := pub.Sweep(ctx); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if firstAnswer != n {
		t.Errorf("%d publishes in flight when the first was acknowledged, want all %d of the page", firstAnswer, n)
	}
	var pending int
	if err := st.Pool().QueryRow(ctx, "SELECT count(*) FROM health.transitions WHERE NOT published").Scan(&pending); err != nil || pending != 0 {
		t.Errorf("%d transitions left unpublished (%v)", pending, err)
	}
}

// TestPublisher_order: with a page's events sent together, each proxy's
// still reach JetStream in sequence order, each once, with its message id.
func TestPublisher_order(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, st := storetest.New(t)
	srv := natstest.New(t)
	js := srv.JetStream(t)
	names := bus.Names{Prefix: fmt.Sprintf("order%d", time.Now().UnixNano())}
	if err := bus.EnsureStreams(ctx, js, names); err != nil {
		t.Fatal(err)
	}
	const proxies, flips = 40, 5
	for f := range flips {
		for p := range proxies {
			uid := fmt.Sprint("u", p)
			if _, err := st.RecordTransition(ctx, engine.Transition{UID: uid, Name: "p-" + uid, ProviderID: "vm-" + uid,
				Healthy: f%2 == 0, Time: t0}, nil, "r"); err != nil {
				t.Fatal(err)
			}
		}
	}
	// What the stream takes, as a core subscriber sees it (the stream
	// keeps only each proxy's last).
	nc := srv.Connect(t)
	seen := make(chan *nats.Msg, proxies*flips*2)
	sub, err := nc.ChanSubscribe(names.HealthEventSubjects(), seen)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	pub := &transitions.Publisher{Store: st, JS: js, Names: names, Log: slog.New(slog.DiscardHandler)}
	if err := pub.Sweep(ctx); err != nil {
		t.Fatal(err)
	}
	last := map[string]int64{}
	ids := map[string]bool{}
	for range proxies * flips {
		var m *nats.Msg
		select {
		case m = <-seen:
		case <-ctx.Done():
			t.Fatalf("%d events seen, want %d", len(ids), proxies*flips)
		}
		var seqOf int64
		id := m.Header.Get("Nats-Msg-Id")
		if _, err := fmt.Sscanf(id, "health-transition-%d", &seqOf); err != nil || ids[id] {
			t.Fatalf("message id %q (duplicate: %v)", id, ids[id])
		}
		ids[id] = true
		if seqOf <= last[m.Subject] {
			t.Errorf("%s: sequence %d after %d", m.Subject, seqOf, last[m.Subject])
		}
		last[m.Subject] = seqOf
	}
	select {
	case m := <-seen:
		t.Errorf("an event sent twice: %s %s", m.Subject, m.Header.Get("Nats-Msg-Id"))
	case <-time.After(100 * time.Millisecond):
	}
}
