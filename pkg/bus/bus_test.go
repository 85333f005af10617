package bus_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
)

func init() {
	otel.SetTextMapPropagator(propagation.TraceContext{})
}

func TestNames(t *testing.T) {
	t.Parallel()
	n := bus.Names{Prefix: "test-1.a"}
	if got := n.CommandStream(); got != "TEST_1_A_COMMANDS" {
		t.Errorf("CommandStream = %q", got)
	}
	if got := n.CommandSubject("pve"); got != "test-1.a.cmd.pve" {
		t.Errorf("CommandSubject = %q", got)
	}
	if got := (bus.Names{}).ProxyEventSubject("u1"); got != "egress.proxy.u1" {
		t.Errorf("default prefix subject = %q", got)
	}
}

// withStreams is a JetStream of a test server of its own holding the
// streams of n, and a context that bounds the test.
func withStreams(t *testing.T, n bus.Names) (context.Context, jetstream.JetStream) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	js := natstest.New(t).JetStream(t)
	if err := bus.EnsureStreams(ctx, js, n); err != nil {
		t.Fatal(err)
	}
	return ctx, js
}

func TestPublishDecodeCarriesTraceContext(t *testing.T) {
	t.Parallel()
	n := bus.Names{}
	ctx, js := withStreams(t, n)
	if err := bus.EnsureStreams(ctx, js, n); err != nil {
		t.Fatalf("EnsureStreams is not idempotent: %v", err)
	}

	tid, _ := trace.TraceIDFromHex("0af7651916cd43dd8448eb211c80319c")
	sid, _ := trace.SpanIDFromHex("b7ad6b7169203331")
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true})
	pubCtx := trace.ContextWithSpanContext(ctx, sc)
	cmd := &busv1.Command{CommandId: "c-1", ProxyUid: "u-1", Provider: "pve", Operation: busv1.Operation_OPERATION_GET}
	if _, err := bus.Publish(pubCtx, js, n.CommandSubject("pve"), cmd, jetstream.WithMsgID(cmd.GetCommandId())); err != nil {
		t.Fatal(err)
	}
	// A duplicate publish of the same command id is dropped by the stream.
	if ack, err := bus.Publish(pubCtx, js, n.CommandSubject("pve"), cmd, jetstream.WithMsgID(cmd.GetCommandId())); err != nil || !ack.Duplicate {
		t.Fatalf("duplicate publish: ack %+v, err %v", ack, err)
	}

	cons, err := js.CreateOrUpdateConsumer(ctx, n.CommandStream(), jetstream.ConsumerConfig{
		Durable: n.ProvisionerConsumer("pve"), FilterSubject: n.CommandSubject("pve"), AckPolicy: jetstream.AckExplicitPolicy,
	})
	if err != nil {
		t.Fatal(err)
	}
	m, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var got busv1.Command
	msgCtx, err := bus.Decode(context.Background(), m, &got)
	if err != nil {
		t.Fatal(err)
	}
	if got.GetCommandId() != "c-1" || got.GetOperation() != busv1.Operation_OPERATION_GET {
		t.Errorf("decoded %v", &got)
	}
	if m.Headers().Get("Content-Type") != bus.ContentType {
		t.Errorf("content type %q", m.Headers().Get("Content-Type"))
	}
	if gotSC := trace.SpanContextFromContext(msgCtx); gotSC.TraceID() != tid || gotSC.SpanID() != sid {
		t.Errorf("trace context not carried: %v", gotSC)
	}
	_ = m.Ack()

	// A payload that is not the message fails with ErrBadPayload.
	if _, err := js.Publish(ctx, n.CommandSubject("pve"), []byte{0xff, 0xff, 0xff}); err != nil {
		t.Fatal(err)
	}
	bad, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bus.Decode(ctx, bad, &got); !errors.Is(err, bus.ErrBadPayload) {
		t.Errorf("bad payload: %v", err)
	}
}

// The event streams keep exactly the latest event of each proxy, so a
// consumer starting with DeliverLastPerSubject reads the current state.
func TestEventStreamsKeepLatestPerProxy(t *testing.T) {
	t.Parallel()
	n := bus.Names{Prefix: "t"}
	ctx, js := withStreams(t, n)
	for rev := int64(1); rev <= 6; rev++ {
		uid := fmt.Sprintf("u%d", rev%2)
		ev := &busv1.ProxyEvent{Revision: rev, Type: proxyv1.ChangeType_CHANGE_TYPE_UPDATED, Proxy: &proxyv1.Proxy{Uid: uid}}
		if _, err := bus.Publish(ctx, js, n.ProxyEventSubject(uid), ev); err != nil {
			t.Fatal(err)
		}
	}
	cons, err := js.OrderedConsumer(ctx, n.ProxyEventStream(), jetstream.OrderedConsumerConfig{
		DeliverPolicy: jetstream.DeliverLastPerSubjectPolicy,
	})
	if err != nil {
		t.Fatal(err)
	}
	latest := map[string]int64{}
	for range 2 {
		m, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
		if err != nil {
			t.Fatal(err)
		}
		var ev busv1.ProxyEvent
		if _, err := bus.Decode(ctx, m, &ev); err != nil {
			t.Fatal(err)
		}
		latest[ev.GetProxy().GetUid()] = ev.GetRevision()
	}
	if latest["u0"] != 6 || latest["u1"] != 5 {
		t.Errorf("latest revisions = %v, want u0:6 u1:5", latest)
	}
}

// With three replicas on a cluster of three, every stream is stored on each
// server and keeps taking messages with one of them down; a single server
// refuses the count, so a misconfiguration is loud.
func TestStreamsReplicatedOnACluster(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cluster := natstest.NewCluster(t, 3)
	n := bus.Names{Prefix: "replicated"}
	nc, js, err := bus.Connect(ctx, bus.ConnectOptions{URL: cluster.URL(), Name: t.Name(), Names: n, StreamReplicas: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	for _, cfg := range n.StreamConfigs() {
		s, err := js.Stream(ctx, cfg.Name)
		if err != nil {
			t.Fatalf("stream %s: %v", cfg.Name, err)
		}
		info, err := s.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.Config.Replicas != 3 {
			t.Errorf("stream %s has %d replicas, want 3", cfg.Name, info.Config.Replicas)
		}
		if info.Cluster == nil || len(info.Cluster.Replicas)+1 != 3 {
			t.Errorf("stream %s is placed on %+v, want a leader and two replicas", cfg.Name, info.Cluster)
		}
	}

	// Stop a server that is not the commands stream's leader's only copy:
	// any one of three leaves a quorum.
	cluster.Servers[2].Stop()
	cmd := &busv1.Command{CommandId: "c-1", ProxyUid: "u-1", Provider: "pve", Operation: busv1.Operation_OPERATION_GET}
	for {
		_, err := bus.Publish(ctx, js, n.CommandSubject("pve"), cmd, jetstream.WithMsgID(cmd.GetCommandId()))
		if err == nil {
			break
		}
		// A stream whose leader was on the stopped server elects another.
		if ctx.Err() != nil {
			t.Fatalf("publishing with one server of three down: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}

	single := natstest.New(t).JetStream(t)
	err = bus.EnsureStreams(ctx, single, n, bus.Replicas(3))
	if err == nil || !strings.Contains(err.Error(), "replicas") {
		t.Errorf("a single server took three replicas: err = %v", err)
	}
}

// WaitAcks returns once every publish is stored, and names the subject of
// one no stream took.
func TestWaitAcks(t *testing.T) {
	t.Parallel()
	n := bus.Names{Prefix: "t"}
	ctx, js := withStreams(t, n)
	publish := func(subject string) jetstream.PubAckFuture {
		m, err := bus.Message(ctx, subject, &busv1.ProxyEvent{Revision: 1})
		if err != nil {
			t.Fatal(err)
		}
		f, err := js.PublishMsgAsync(m)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	stored := []jetstream.PubAckFuture{publish(n.ProxyEventSubject("a")), publish(n.ProxyEventSubject("b"))}
	if err := bus.WaitAcks(ctx, stored); err != nil {
		t.Fatalf("two publishes the stream takes: %v", err)
	}
	info, err := js.Stream(ctx, n.ProxyEventStream())
	if err != nil {
		t.Fatal(err)
	}
	if got := info.CachedInfo().State.Msgs; got != 2 {
		t.Fatalf("the stream holds %d messages after WaitAcks, want 2", got)
	}
	err = bus.WaitAcks(ctx, []jetstream.PubAckFuture{publish(n.ProxyEventSubject("c")), publish("nowhere.stored")})
	if err == nil || !strings.Contains(err.Error(), "nowhere.stored") {
		t.Fatalf("a publish no stream takes: %v, want an error naming its subject", err)
	}
}
