package dispatch

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// RunHealth applies health transitions (Running <-> Ready) until ctx ends,
// waiting for NATS whenever it is unreachable.
func (d *Dispatcher) RunHealth(ctx context.Context) error {
	bus.KeepConsuming(ctx, d.JS, d.Log, "health transitions", d.consumeHealth)
	return nil
}

func (d *Dispatcher) consumeHealth(ctx context.Context) error {
	cons, err := d.JS.CreateOrUpdateConsumer(ctx, d.Names.HealthEventStream(), jetstream.ConsumerConfig{
		Durable:       "orchestrator-health",
		FilterSubject: d.Names.HealthEventSubjects(),
		AckPolicy:     jetstream.AckExplicitPolicy,
		DeliverPolicy: jetstream.DeliverLastPerSubjectPolicy,
		AckWait:       30 * time.Second,
	})
	if err != nil {
		return err
	}
	return consumeBatches(ctx, cons, 256, func(msgs []jetstream.Msg) { d.applyHealth(ctx, msgs) })
}

// applyHealth applies a batch of health transitions in one transaction,
// locking proxies in UID order so concurrent batches cannot deadlock.
func (d *Dispatcher) applyHealth(ctx context.Context, msgs []jetstream.Msg) {
	type item struct {
		msg jetstream.Msg
		tr  *healthv1.HealthTransition
	}
	var items []item
	for _, m := range msgs {
		ev := &busv1.HealthTransitionEvent{}
		if _, err := bus.Decode(ctx, m, ev); err != nil {
			d.Log.Error("dropping an undecodable health event", "error", err)
			_ = m.Term()
			continue
		}
		items = append(items, item{m, ev.GetTransition()})
	}
	slices.SortStableFunc(items, func(a, b item) int { return strings.Compare(a.tr.GetProxyUid(), b.tr.GetProxyUid()) })
	err := d.Store.Write(ctx, func(tx *store.Tx) error {
		uids := make([]string, len(items))
		for i, it := range items {
			uids[i] = it.tr.GetProxyUid()
		}
		rows, err := tx.LockMany(ctx, uids)
		if err != nil {
			return err
		}
		changed := map[string]bool{}
		for _, it := range items {
			uid := it.tr.GetProxyUid()
			r, ok := rows[uid]
			if !ok {
				continue
			}
			if lifecycle.ApplyHealth(r, it.tr, tx.Now()) {
				changed[uid] = true
			}
		}
		for uid := range changed {
			tx.Update(rows[uid])
		}
		return nil
	})
	for _, it := range items {
		if err != nil {
			_ = it.msg.Nak()
		} else {
			_ = it.msg.Ack()
		}
	}
	if err != nil {
		d.Log.Warn("applying health transitions failed; they will be redelivered", "error", err)
	}
}
