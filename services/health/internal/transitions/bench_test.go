package transitions_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store/storetest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/transitions"
)

// benchTransitions is how many transitions the recorder and publisher
// benchmarks move (BENCH_TRANSITIONS, default 10000).
func benchTransitions(b *testing.B) int {
	n := 10000
	if v := os.Getenv("BENCH_TRANSITIONS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n <= 0 {
			b.Fatalf("BENCH_TRANSITIONS: %q is not a count", v)
		}
	}
	return n
}

// BenchmarkRecorder: the time the Recorder takes to store a backlog of
// first verdicts of distinct proxies (each with its state), as after a
// resync of a big fleet; reports transitions stored a second.
//
//	go test -run '^$' -bench BenchmarkRecorder -benchtime 1x ./internal/transitions
func BenchmarkRecorder(b *testing.B) {
	n := benchTransitions(b)
	for range b.N {
		b.StopTimer()
		_, st := storetest.New(b)
		rec := &transitions.Recorder{Store: st, Prober: "replica-a", Log: slog.New(slog.DiscardHandler),
			State: func(uid string) (engine.State, bool) {
				return engine.State{Spec: engine.Spec{UID: uid, Name: "p-" + uid, ProviderID: "vm-" + uid, Address: "10.0.0.1:3128"},
					VerdictKnown: true, Healthy: true, Reason: "ProbeSucceeded", ConsecutiveSuccesses: 1, LastProbe: time.Now()}, true
			}}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		b.StartTimer()
		start := time.Now()
		go func() { done <- rec.Run(ctx) }()
		for i := range n {
			uid := fmt.Sprintf("%08x-0000-4000-8000-%012x", i, i)
			rec.Add(engine.Transition{UID: uid, Name: "p-" + uid, ProviderID: "vm-" + uid, Healthy: true, Reason: "ProbeSucceeded",
				Message: "200 OK", Latency: 40 * time.Millisecond, Time: time.Now()})
		}
		// Polled every 10ms, so the benchmark's own queries stay few.
		tick := time.NewTicker(10 * time.Millisecond)
		for {
			<-tick.C
			last, err := st.LastSequence(ctx)
			if err != nil {
				b.Fatal(err)
			}
			if last >= int64(n) {
				break
			}
		}
		b.ReportMetric(float64(n)/time.Since(start).Seconds(), "transitions/s")
		b.StopTimer()
		tick.Stop()
		cancel()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPublisher: the time a sweep takes to publish a backlog of
// stored transitions of distinct proxies to JetStream (an in-process
// server, file storage); reports events published a second.
//
//	go test -run '^$' -bench BenchmarkPublisher -benchtime 1x ./internal/transitions
func BenchmarkPublisher(b *testing.B) {
	n := benchTransitions(b)
	for range b.N {
		b.StopTimer()
		ctx := context.Background()
		_, st := storetest.New(b)
		if _, err := st.Pool().Exec(ctx, `INSERT INTO health.transitions
			(proxy_uid, proxy_name, provider_id, healthy, reason, message, latency_us, transition_time, prober)
			SELECT 'u' || i, 'p-' || i, 'vm-' || i, true, 'ProbeSucceeded', '200 OK', 40000, now(), 'replica-a'
			FROM generate_series(1, $1) i`, n); err != nil {
			b.Fatal(err)
		}
		js := natstest.New(b).JetStream(b)
		names := bus.Names{Prefix: "bench"}
		if err := bus.EnsureStreams(ctx, js, names); err != nil {
			b.Fatal(err)
		}
		pub := &transitions.Publisher{Store: st, JS: js, Names: names, Log: slog.New(slog.DiscardHandler)}
		b.StartTimer()
		start := time.Now()
		if err := pub.Sweep(ctx); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(n)/time.Since(start).Seconds(), "events/s")
		b.StopTimer()
		var pending int
		if err := st.Pool().QueryRow(ctx, "SELECT count(*) FROM health.transitions WHERE NOT published").Scan(&pending); err != nil || pending != 0 {
			b.Fatalf("%d left pending (%v)", pending, err)
		}
	}
}
