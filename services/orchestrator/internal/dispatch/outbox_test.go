package dispatch_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

// Every change is published as a ProxyEvent, in revision order, without
// cloud-init.
func TestProxyEventsPublished(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	h.StartCloud("fake")
	h.StartReplica()
	req := orchtest.Managed("p1")
	req.Spec.CloudInit = "#cloud-config\npassword: hunter2\n"
	p := h.Create(req)
	h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	cons, err := h.JS.OrderedConsumer(context.Background(), h.Names.ProxyEventStream(), jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	m, err := cons.Next(jetstream.FetchMaxWait(10 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ev := &busv1.ProxyEvent{}
	if _, err := bus.Decode(context.Background(), m, ev); err != nil {
		t.Fatal(err)
	}
	if ev.GetProxy().GetUid() != p.GetUid() || ev.GetRevision() == 0 {
		t.Errorf("event %v", ev)
	}
	if strings.Contains(string(m.Data()), "hunter2") || ev.GetProxy().GetSpec().GetCloudInit() != "" {
		t.Error("cloud-init leaked into a ProxyEvent")
	}
}

// A proxy whose last event left the stream (unchanged for longer than the
// stream keeps messages; here purged) is published again with its current
// state and revision.
func TestEventsRefreshedBeforeTheyAgeOut(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	h.EventRefresh = 300 * time.Millisecond
	h.StartCloud("fake")
	h.StartReplica()
	req := orchtest.Managed("p1")
	req.Spec.CloudInit = "#cloud-config\npassword: hunter2\n"
	p := h.Create(req)
	row := h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := h.JS.Stream(ctx, h.Names.ProxyEventStream())
	if err != nil {
		t.Fatal(err)
	}
	subject := h.Names.ProxyEventSubject(p.GetUid())
	// last returns the stream's event for p1, nil when it has none.
	last := func() (*busv1.ProxyEvent, string) {
		m, err := stream.GetLastMsgForSubject(ctx, subject)
		if err != nil {
			return nil, ""
		}
		ev := &busv1.ProxyEvent{}
		if err := proto.Unmarshal(m.Data, ev); err != nil {
			t.Fatal(err)
		}
		return ev, string(m.Data)
	}
	waitEvent := func(what string) *busv1.ProxyEvent {
		var ev *busv1.ProxyEvent
		waittest.For(t, orchtest.Wait, fmt.Sprintf("an event at revision %d %s", row.Revision, what), func() bool {
			var raw string
			ev, raw = last()
			if ev == nil || ev.GetRevision() != row.Revision {
				return false
			}
			if strings.Contains(raw, "hunter2") {
				t.Error("cloud-init leaked into a ProxyEvent")
			}
			return true
		})
		return ev
	}
	waitEvent("after the proxy became Running")
	if err := stream.Purge(ctx, jetstream.WithPurgeSubject(subject)); err != nil {
		t.Fatal(err)
	}
	ev := waitEvent("after the stream lost it")
	if ev.GetType() != proxyv1.ChangeType_CHANGE_TYPE_UPDATED || ev.GetProxy().GetUid() != p.GetUid() ||
		ev.GetProxy().GetStatus().GetPhase() != proxyv1.ProxyPhase_PROXY_PHASE_RUNNING {
		t.Errorf("refreshed event = %v, want p1's current state as UPDATED", ev)
	}
}
