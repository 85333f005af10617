package dispatch

import (
	"context"
	"errors"
	"slices"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

var tracer = otel.Tracer("github.com/egress-proxies/egress-proxies/services/orchestrator")

func commandAttrs(c *busv1.Command) []attribute.KeyValue {
	return []attribute.KeyValue{
		attribute.String("proxy.uid", c.GetProxyUid()),
		attribute.String("provider", c.GetProvider()),
		attribute.String("command.id", c.GetCommandId()),
		attribute.String("command.operation", c.GetOperation().String()),
	}
}

// outgoing is a command to publish under ctx's trace; span, when set,
// ends once JetStream has answered.
type outgoing struct {
	ctx  context.Context
	cmd  *busv1.Command
	span trace.Span
}

// publish sends commands after their rows committed. A proxy's command
// that JetStream did not store is taken back (lifecycle.Machine.Unsent), so that it
// is issued again after a short backoff rather than at its deadline.
func (d *Dispatcher) publish(ctx context.Context, cmds []outgoing) {
	if len(cmds) == 0 {
		return
	}
	type sent struct {
		out outgoing
		f   jetstream.PubAckFuture
	}
	var pending []sent
	var unsent []*busv1.Command
	fail := func(o outgoing, err error) {
		if o.span != nil {
			o.span.RecordError(err)
			o.span.SetStatus(codes.Error, "command not stored by JetStream")
			o.span.End()
		}
	}
	for _, o := range cmds {
		c := o.cmd
		m, err := bus.Message(o.ctx, d.Names.CommandSubject(c.GetProvider()), c)
		if err != nil {
			d.Log.Error("encoding command", "error", err)
			fail(o, err)
			continue
		}
		f, err := d.JS.PublishMsgAsync(m, jetstream.WithMsgID(c.GetCommandId()))
		if err != nil {
			d.Log.Warn("publishing a command failed", "command", c.GetCommandId(), "proxy_uid", c.GetProxyUid(), "error", err)
			fail(o, err)
			unsent = append(unsent, c)
			continue
		}
		pending = append(pending, sent{o, f})
	}
	for i, p := range pending {
		select {
		case <-p.f.Ok():
			if p.out.span != nil {
				p.out.span.End()
			}
		case err := <-p.f.Err():
			d.Log.Warn("a command was not stored by JetStream", "command", p.out.cmd.GetCommandId(), "proxy_uid", p.out.cmd.GetProxyUid(), "error", err)
			fail(p.out, err)
			unsent = append(unsent, p.out.cmd)
		case <-ctx.Done():
			for _, q := range pending[i:] {
				fail(q.out, ctx.Err())
			}
			return
		}
	}
	d.takeBack(ctx, unsent)
}

// takeBack returns unsent proxy commands to the queue (orphan GC's
// commands have no proxy: GC issues them again on its own schedule). A
// proxy whose command changed meanwhile is left alone.
func (d *Dispatcher) takeBack(ctx context.Context, unsent []*busv1.Command) {
	unsent = slices.DeleteFunc(unsent, func(c *busv1.Command) bool { return c.GetProxyUid() == "" })
	if len(unsent) == 0 {
		return
	}
	slices.SortFunc(unsent, func(a, b *busv1.Command) int { return strings.Compare(a.GetProxyUid(), b.GetProxyUid()) })
	err := d.Store.Write(ctx, func(tx *store.Tx) error {
		for _, c := range unsent {
			r, err := tx.Lock(ctx, c.GetProxyUid())
			if errors.Is(err, store.ErrNotFound) {
				continue
			}
			if err != nil {
				return err
			}
			if r.CommandID != c.GetCommandId() {
				continue
			}
			d.Machine.Unsent(r, tx.Now())
			tx.Update(r)
		}
		return nil
	})
	if err != nil {
		d.Log.Warn("taking back unsent commands failed; they are issued again after their deadline", "commands", len(unsent), "error", err)
		return
	}
	d.Log.Warn("commands not stored by JetStream are issued again after a backoff", "commands", len(unsent))
}
