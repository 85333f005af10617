package dispatch

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/trace"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	"github.com/egress-proxies/egress-proxies/pkg/telemetry"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
)

// NewCommand is a new proxy's first command, decided in the transaction
// that created the proxy, with the trace of the call that created it.
type NewCommand struct {
	Command     *busv1.Command
	TraceParent string
}

// DecideNew decides a proxy that the calling transaction creates, as the
// claim that would otherwise take it at once decides it
// (lifecycle.Machine.Decide): the caller stores p as decided, as the
// change after its creation, and hands the command to PublishNew once the
// transaction committed. It returns nil when p is not due (an EXTERNAL
// proxy has nothing to provision) or Decide issued nothing.
func (d *Dispatcher) DecideNew(p *lifecycle.Proxy, now time.Time) *busv1.Command {
	if p.NextAttemptTime == nil || p.NextAttemptTime.After(now) {
		return nil
	}
	dec := d.Machine.Decide(p, now)
	lifecycle.EndSettledTrace(p)
	if dec.Command == nil {
		// A new proxy is never released; a wait is stored as decided.
		d.Metrics.reconciled("wait")
		return nil
	}
	d.Metrics.reconciled(dec.Command.GetOperation().String())
	return dec.Command
}

// PublishNew publishes the commands DecideNew returned once their
// transaction committed (started at start), each under a reconcile.claim
// span that is a child of the call that created its proxy, as a claim
// publishes its commands. A command JetStream did not store is taken back
// (lifecycle.Machine.Unsent); one that never reached publish (the process
// stopped after the commit) is issued again with a new id at its
// deadline, when a claim finds it unanswered.
func (d *Dispatcher) PublishNew(ctx context.Context, start time.Time, cmds []NewCommand) {
	out := make([]outgoing, len(cmds))
	for i, c := range cmds {
		sctx, span := tracer.Start(telemetry.WithTraceParent(ctx, c.TraceParent), "reconcile.claim",
			trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(start), trace.WithAttributes(commandAttrs(c.Command)...))
		out[i] = outgoing{ctx: sctx, cmd: c.Command, span: span}
	}
	d.publish(ctx, out)
}
