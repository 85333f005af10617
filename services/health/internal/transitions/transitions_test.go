package transitions_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/protobuf/proto"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store/storetest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/transitions"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

var t0 = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

// TestRecordAndPublish stores transitions through the Recorder and
// publishes them through the Publisher to real JetStream: a publish that
// fails leaves the rows pending, a later sweep sends them, in order, and
// nothing is sent twice.
func TestRecordAndPublish(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, st := storetest.New(t)
	js := natstest.New(t).JetStream(t)
	names := bus.Names{Prefix: "tr"}
	log := slog.New(slog.DiscardHandler)

	stored := make(chan struct{}, 10)
	state := engine.State{Spec: engine.Spec{UID: "u1", Name: "p1", ProviderID: "vm-1", Address: "10.0.0.1:3128"},
		VerdictKnown: true, Healthy: false, Reason: "ConnectFailed", ConsecutiveFailures: 1}
	rec := &transitions.Recorder{Store: st, Prober: "replica-a", Log: log,
		State:  func(uid string) (engine.State, bool) { return state, uid == "u1" },
		Stored: func() { stored <- struct{}{} }}
	rctx, stopRec := context.WithCancel(ctx)
	recDone := make(chan error, 1)
	go func() { recDone <- rec.Run(rctx) }()
	for i, tr := range []engine.Transition{
		{UID: "u1", Name: "p1", ProviderID: "vm-1", Healthy: false, Reason: "ConnectFailed", Time: t0},
		{UID: "u2", Name: "p2", ProviderID: "vm-2", Healthy: true, Reason: "ProbeSucceeded", Time: t0},
		{UID: "u1", Name: "p1", ProviderID: "vm-1", Healthy: true, Reason: "ProbeSucceeded", Latency: 5 * time.Millisecond, Time: t0.Add(time.Second)},
	} {
		rec.Add(tr)
		select {
		case <-stored:
		case <-ctx.Done():
			t.Fatalf("transition %d not stored", i)
		}
	}
	stopRec()
	if err := <-recDone; err != nil {
		t.Fatal(err)
	}
	// The state row was written with the transition.
	h, err := st.GetProxy(ctx, "p1")
	if err != nil || h.GetProber() != "replica-a" || h.GetReason() != "ConnectFailed" || h.GetAddress() != "10.0.0.1:3128" {
		t.Errorf("GetProxy(p1) = %v, %v", h, err)
	}

	pub := &transitions.Publisher{Store: st, JS: js, Names: names, Log: log}
	// No streams yet: publishing fails and nothing is marked.
	if err := pub.Sweep(ctx); err == nil {
		t.Fatal("Sweep succeeded without a stream to publish to")
	}
	if err := bus.EnsureStreams(ctx, js, names); err != nil {
		t.Fatal(err)
	}
	if err := pub.Sweep(ctx); err != nil {
		t.Fatal(err)
	}
	if n, _, err := st.PublishPending(ctx, 100, func([]*healthv1.HealthTransition) error { return nil }); err != nil || n != 0 {
		t.Errorf("after a sweep %d transitions still pending (%v)", n, err)
	}

	stream, err := js.Stream(ctx, names.HealthEventStream())
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Three events were published; the stream keeps the latest per proxy.
	if info.State.Msgs != 2 || info.State.LastSeq != 3 {
		t.Errorf("stream holds %d messages, last sequence %d; want 2 kept of 3 published", info.State.Msgs, info.State.LastSeq)
	}
	m, err := stream.GetLastMsgForSubject(ctx, names.HealthEventSubject("u1"))
	if err != nil {
		t.Fatal(err)
	}
	var ev busv1.HealthTransitionEvent
	if err := proto.Unmarshal(m.Data, &ev); err != nil {
		t.Fatal(err)
	}
	if tr := ev.GetTransition(); !tr.GetHealthy() || tr.GetSequence() != 3 || tr.GetLatency().AsDuration() != 5*time.Millisecond || tr.GetProviderId() != "vm-1" {
		t.Errorf("latest u1 event = %v, want the healthy flip with sequence 3", tr)
	}
	if m.Header.Get("Nats-Msg-Id") != "health-transition-3" {
		t.Errorf("message id = %q", m.Header.Get("Nats-Msg-Id"))
	}
}

// TestRecorder_retriesUntilStored: a transition the database refuses is
// retried, not dropped, and stored once the database takes it.
func TestRecorder_retriesUntilStored(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, st := storetest.New(t)
	if _, err := st.Pool().Exec(ctx, "ALTER TABLE health.transitions RENAME TO transitions_away"); err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	stored := make(chan struct{}, 1)
	rec := &transitions.Recorder{Store: st, Prober: "replica-a", Log: slog.New(slog.NewJSONHandler(&logs, nil)),
		Stored: func() { stored <- struct{}{} }}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- rec.Run(rctx) }()
	rec.Add(engine.Transition{UID: "u1", Name: "p1", ProviderID: "vm-1", Healthy: true, Reason: "ProbeSucceeded", Time: t0})

	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(logs.String(), "storing health transitions failed") {
		if time.Now().After(deadline) {
			t.Fatal("no failed attempt logged")
		}
		select {
		case <-stored:
			t.Fatal("stored while the table is away")
		case <-time.After(10 * time.Millisecond):
		}
	}
	if _, err := st.Pool().Exec(ctx, "ALTER TABLE health.transitions_away RENAME TO transitions"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-stored:
	case <-ctx.Done():
		t.Fatal("the transition was never stored after the database recovered")
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	ts, err := st.TransitionsAfter(ctx, 0, 10)
	if err != nil || len(ts) != 1 || ts[0].GetProxyUid() != "u1" {
		t.Fatalf("stored transitions = %v, %v; want exactly the one", ts, err)
	}
}

// syncBuffer collects output written from several goroutines.
type syncBuffer = logtest.Buffer
