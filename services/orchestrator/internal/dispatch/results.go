package dispatch

import (
	"context"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// RunResults applies provisioner results from the shared durable consumer
// until ctx ends, waiting for NATS whenever it is unreachable.
func (d *Dispatcher) RunResults(ctx context.Context) error {
	bus.KeepConsuming(ctx, d.JS, d.Log, "provisioner results", d.consumeResults)
	return nil
}

func (d *Dispatcher) consumeResults(ctx context.Context) error {
	cons, err := d.JS.CreateOrUpdateConsumer(ctx, d.Names.ResultStream(), jetstream.ConsumerConfig{
		Durable:       d.Names.OrchestratorConsumer(),
		FilterSubject: d.Names.ResultSubjects(),
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       30 * time.Second,
		MaxAckPending: 4096,
	})
	if err != nil {
		return err
	}
	return consumeBatches(ctx, cons, 256, func(msgs []jetstream.Msg) { d.applyResults(ctx, msgs) })
}

type decoded struct {
	msg jetstream.Msg
	res *busv1.CommandResult
	// ctx is the span applying the result, a child of the provisioner's.
	ctx  context.Context
	span trace.Span
}

func (d *Dispatcher) applyResults(ctx context.Context, msgs []jetstream.Msg) {
	var items []decoded
	for _, m := range msgs {
		res := &busv1.CommandResult{}
		rctx, err := bus.Decode(ctx, m, res)
		if err != nil {
			d.Log.Error("dropping an undecodable result", "error", err)
			_ = m.Term()
			continue
		}
		if p := res.GetPurpose(); p != busv1.CommandPurpose_COMMAND_PURPOSE_RECONCILE && p != busv1.CommandPurpose_COMMAND_PURPOSE_UNSPECIFIED {
			// Another component's own command, answering no proxy.
			if h := d.Handlers[p]; h != nil {
				h.HandleResult(rctx, res)
			} else {
				d.Log.Warn("dropping a result of a purpose nobody handles", "purpose", p.String(), "command", res.GetCommandId())
			}
			_ = m.Ack()
			continue
		}
		sctx, span := tracer.Start(rctx, "reconcile.apply_result", trace.WithSpanKind(trace.SpanKindConsumer),
			trace.WithAttributes(attribute.String("proxy.uid", res.GetProxyUid()), attribute.String("provider", res.GetProvider()),
				attribute.String("command.id", res.GetCommandId()), attribute.String("command.operation", res.GetOperation().String())))
		items = append(items, decoded{msg: m, res: res, ctx: sctx, span: span})
	}
	defer func() {
		for _, it := range items {
			it.span.End()
		}
	}()
	// Apply a proxy's results in UID order (LockMany locks in that order
	// too), the order of the messages kept among one proxy's results.
	slices.SortStableFunc(items, func(a, b decoded) int {
		switch {
		case a.res.GetProxyUid() < b.res.GetProxyUid():
			return -1
		case a.res.GetProxyUid() > b.res.GetProxyUid():
			return 1
		}
		return 0
	})
	var cmds []outgoing
	err := d.Store.Write(ctx, func(tx *store.Tx) error {
		cmds = nil
		uids := make([]string, len(items))
		for i, it := range items {
			uids[i] = it.res.GetProxyUid()
		}
		rows, err := tx.LockMany(ctx, uids)
		if err != nil {
			return err
		}
		traced := map[string]context.Context{} // each proxy's last applied result's span
		changed := map[string]bool{}
		released := map[string]bool{}
		for _, it := range items {
			res := it.res
			uid := res.GetProxyUid()
			if released[uid] {
				continue
			}
			r, ok := rows[uid]
			if !ok {
				d.Log.Debug("result for a proxy that no longer exists", "proxy_uid", uid, "command", res.GetCommandId())
				continue
			}
			issued := r.CommandIssueTime
			switch d.Machine.Apply(r, res, tx.Now()) {
			case lifecycle.Stale:
				d.Metrics.Results.WithLabelValues("stale").Inc()
				it.span.SetAttributes(attribute.Bool("result.stale", true))
				continue
			case lifecycle.Released:
				tx.Delete(r)
				delete(rows, uid)
				released[uid] = true
			case lifecycle.Applied:
				changed[uid] = true
				traced[uid] = it.ctx
			}
			d.Metrics.observeResult(res, issued, tx.Now())
		}
		for uid, r := range rows {
			if !changed[uid] {
				continue
			}
			if r.NextAttemptTime != nil && !r.NextAttemptTime.After(tx.Now()) {
				dec := d.Machine.Decide(r, tx.Now())
				if dec.Release {
					tx.Delete(r)
					continue
				}
				if dec.Command != nil {
					cmds = append(cmds, outgoing{ctx: traced[uid], cmd: dec.Command})
				}
			}
			lifecycle.EndSettledTrace(r)
			tx.Update(r)
		}
		return nil
	})
	if err != nil {
		for _, it := range items {
			it.span.RecordError(err)
			it.span.SetStatus(codes.Error, "applying results failed")
		}
		d.Log.Warn("applying results failed; they will be redelivered", "error", err)
		for _, it := range items {
			_ = it.msg.Nak()
		}
		return
	}
	d.publish(ctx, cmds)
	for _, it := range items {
		_ = it.msg.Ack()
	}
}
