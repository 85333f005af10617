package orchtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// Wait is how long the waits of the harness wait.
const Wait = 20 * time.Second

// WaitFor waits until the stored proxy name satisfies cond and returns it;
// the failure names what was awaited and the proxy's last state.
func (h *Harness) WaitFor(name, what string, cond func(*lifecycle.Proxy) bool) *lifecycle.Proxy {
	h.t.Helper()
	var last *lifecycle.Proxy
	waittest.ForErr(h.t, Wait, name+" "+what, func() error {
		p, err := h.Store.Get(context.Background(), name)
		if err != nil {
			return err
		}
		last = p
		if !cond(p) {
			return fmt.Errorf("last: phase %v reason %q message %q command %q step %v",
				p.Phase, p.Reason, p.Message, p.CommandID, p.CommandStep)
		}
		return nil
	})
	return last
}

// Phase is a WaitFor condition: the proxy is in phase.
func Phase(phase proxyv1.ProxyPhase) func(*lifecycle.Proxy) bool {
	return func(p *lifecycle.Proxy) bool { return p.Phase == phase }
}

// WaitGone waits until the proxy name no longer exists.
func (h *Harness) WaitGone(name string) {
	h.t.Helper()
	waittest.ForErr(h.t, Wait, name+" gone", func() error {
		p, err := h.Store.Get(context.Background(), name)
		switch {
		case errors.Is(err, store.ErrNotFound):
			return nil
		case err != nil:
			return err
		}
		return fmt.Errorf("still there: phase %v reason %q message %q", p.Phase, p.Reason, p.Message)
	})
}

// WaitLog waits until a replica logged a line containing s.
func (h *Harness) WaitLog(s string) {
	h.t.Helper()
	waittest.For(h.t, Wait, fmt.Sprintf("the log line %q", s), func() bool { return strings.Contains(h.Logs.String(), s) })
}

// WaitResultsDrained waits until the replicas' results consumer has
// nothing pending or unacknowledged: every result published so far was
// applied (or ignored).
func (h *Harness) WaitResultsDrained() {
	h.t.Helper()
	waittest.ForErr(h.t, Wait, "the results consumer drained", func() error {
		cons, err := h.JS.Consumer(context.Background(), h.Names.ResultStream(), h.Names.OrchestratorConsumer())
		if err != nil {
			return err
		}
		ci, err := cons.Info(context.Background())
		if err != nil {
			return err
		}
		if ci.NumPending != 0 || ci.NumAckPending != 0 {
			return fmt.Errorf("%d pending, %d unacknowledged", ci.NumPending, ci.NumAckPending)
		}
		return nil
	})
}

// PublishHealth publishes a health transition as the health service does.
func (h *Harness) PublishHealth(uid, providerID string, seq int64, healthy bool) {
	h.t.Helper()
	if err := h.publishHealth(context.Background(), uid, providerID, seq, healthy); err != nil {
		h.t.Fatal(err)
	}
}

func (h *Harness) publishHealth(ctx context.Context, uid, providerID string, seq int64, healthy bool) error {
	ev := &busv1.HealthTransitionEvent{Transition: &healthv1.HealthTransition{
		Sequence: seq, ProxyUid: uid, ProviderId: providerID, Healthy: healthy, TransitionTime: timestamppb.Now(),
	}}
	_, err := bus.Publish(ctx, h.JS, h.Names.HealthEventSubject(uid), ev)
	return err
}

// PublishVerdicts publishes a healthy verdict for each of proxies as the
// health service's publisher does: the whole transition (sequences from
// first on, in the order given), on the proxy's subject, with the message id
// health-transition-<sequence>. It does not wait for one acknowledgement
// before sending the next (the service does): it returns once JetStream
// acknowledged every verdict, so what it measures is the consumer.
func (h *Harness) PublishVerdicts(ctx context.Context, proxies []*proxyv1.Proxy, first int64) error {
	// A window of acknowledgements outstanding, below the client's limit
	// of pending asynchronous publishes.
	const window = 1000
	futures := make([]jetstream.PubAckFuture, 0, window)
	for i := 0; i < len(proxies); i += window {
		futures = futures[:0]
		for j, p := range proxies[i:min(i+window, len(proxies))] {
			seq := first + int64(i+j)
			m, err := bus.Message(ctx, h.Names.HealthEventSubject(p.GetUid()), &busv1.HealthTransitionEvent{Transition: &healthv1.HealthTransition{
				Sequence: seq, ProxyUid: p.GetUid(), ProxyName: p.GetName(), ProviderId: p.GetStatus().GetProviderId(), Healthy: true,
				Reason: "ProbeSucceeded", Message: "200 OK", Latency: durationpb.New(40 * time.Millisecond), TransitionTime: timestamppb.Now(),
			}})
			if err != nil {
				return err
			}
			f, err := h.JS.PublishMsgAsync(m, jetstream.WithMsgID(fmt.Sprintf("health-transition-%d", seq)))
			if err != nil {
				return err
			}
			futures = append(futures, f)
		}
		if err := bus.WaitAcks(ctx, futures); err != nil {
			return err
		}
	}
	return nil
}

// AutoHealth marks every RUNNING proxy healthy once, as the health service
// would once its probes pass, until the test ends.
func (h *Harness) AutoHealth() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	h.t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		sent := map[string]bool{}
		for ctx.Err() == nil {
			rows, _, err := h.Store.List(ctx, store.Filter{Limit: 10000})
			if err == nil {
				for _, r := range rows {
					if r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING && !sent[r.UID] {
						// Sent again next round when publishing failed.
						sent[r.UID] = h.publishHealth(ctx, r.UID, r.ProviderID, 1, true) == nil
					}
				}
			}
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
}

// PublishDemand publishes a pool's demand report as the lease service
// does: the active leases per proxy UID.
func (h *Harness) PublishDemand(pool string, leases map[string]int32) {
	h.t.Helper()
	var active int64
	for _, n := range leases {
		active += int64(n)
	}
	ev := &busv1.PoolDemandEvent{Pool: pool, Demand: &proxyv1.PoolDemand{ActiveLeases: active, ObserveTime: timestamppb.Now()}, LeasesByProxy: leases}
	if _, err := bus.Publish(context.Background(), h.JS, h.Names.DemandSubject(pool), ev); err != nil {
		h.t.Fatal(err)
	}
}
