// Package dispatch runs the orchestrator's loops between PostgreSQL, NATS
// JetStream and the lifecycle rules, one file each:
//
//   - claims.go: claim due proxies, decide (lifecycle.Machine.Decide), store,
//     and publish their commands after commit;
//   - results.go: apply provisioner results (lifecycle.Machine.Apply) in
//     batches, and hand the results of other purposes (orphan GC's) to the
//     ResultHandler registered for them;
//   - health.go: apply health transitions (lifecycle.ApplyHealth);
//   - outbox.go: publish every stored change as a ProxyEvent, from one
//     replica at a time.
//
// publish.go holds what claims and results share: publishing commands and
// taking back those JetStream did not store. Every loop is safe with any
// number of orchestrator replicas. The loops decide nothing themselves.
package dispatch

import (
	"context"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// Dispatcher runs the loops.
type Dispatcher struct {
	Store   *store.Store
	Machine *lifecycle.Machine
	JS      jetstream.JetStream
	Names   bus.Names
	Log     *slog.Logger
	Work    *store.Signal
	Changes *store.Signal
	Metrics *Metrics
	// ClaimBatch is how many proxies one claim takes.
	ClaimBatch int
	// Poll bounds how long a loop sleeps without a notification.
	Poll time.Duration
	// EventRefresh is how often the ProxyEvent publisher sends every
	// proxy's current state again (default a seventh of the streams'
	// retention), so that no proxy's last event ages out of the stream.
	EventRefresh time.Duration
	// Handlers take the results of commands of other purposes than
	// COMMAND_PURPOSE_RECONCILE (orphan GC's), which answer no proxy's
	// command; a result of a purpose without a handler is dropped.
	Handlers map[busv1.CommandPurpose]ResultHandler
}

// A ResultHandler takes the results of the commands a component issues
// for a purpose of its own; the results loop routes them by their
// purpose, which provisioners copy from the command.
type ResultHandler interface {
	// HandleResult handles one result; ctx carries the trace of the
	// provisioner's span.
	HandleResult(ctx context.Context, res *busv1.CommandResult)
}

func (d *Dispatcher) eventRefresh() time.Duration {
	if d.EventRefresh > 0 {
		return d.EventRefresh
	}
	return bus.EventRetention / 7
}

func (d *Dispatcher) poll() time.Duration {
	if d.Poll > 0 {
		return d.Poll
	}
	return time.Second
}

// consumeBatches delivers the consumer's messages to handle in batches:
// whatever has arrived (up to max) as soon as one message is there, so a
// lone message is handled at once and a burst shares one transaction.
func consumeBatches(ctx context.Context, cons jetstream.Consumer, max int, handle func([]jetstream.Msg)) error {
	ch := make(chan jetstream.Msg, 2*max)
	cc, err := cons.Consume(func(m jetstream.Msg) {
		select {
		case ch <- m:
		case <-ctx.Done(): // unacked: redelivered to another replica
		}
	}, bus.ConsumeOpts(jetstream.PullMaxMessages(max))...)
	if err != nil {
		return err
	}
	defer cc.Stop()
	for {
		var batch []jetstream.Msg
		select {
		case <-ctx.Done():
			return nil
		case m := <-ch:
			batch = append(batch, m)
		}
	drain:
		for len(batch) < max {
			select {
			case m := <-ch:
				batch = append(batch, m)
			default:
				break drain
			}
		}
		handle(batch)
	}
}
