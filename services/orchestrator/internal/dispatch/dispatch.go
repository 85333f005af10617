// Package dispatch connects the reconcile engine to PostgreSQL and NATS
// JetStream: workers claim due proxies and publish their commands, the
// results consumer applies provisioner results, the health consumer applies
// verdicts, and the outbox publishes every stored change as a ProxyEvent.
// Every loop is safe with any number of orchestrator replicas.
package dispatch

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/telemetry"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/gc"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/reconcile"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// Dispatcher runs the loops.
type Dispatcher struct {
	Store   *store.Store
	Engine  *reconcile.Engine
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
	// Now is the clock (time.Now by default).
	Now func() time.Time
	// GC handles the results of orphan GC's list and delete commands.
	GC *gc.Collector
}

func (d *Dispatcher) now() time.Time {
	if d.Now != nil {
		return d.Now()
	}
	return time.Now()
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

// RunClaims claims due proxies, decides and dispatches, until ctx ends.
func (d *Dispatcher) RunClaims(ctx context.Context) error {
	batch := d.ClaimBatch
	if batch <= 0 {
		batch = 64
	}
	for ctx.Err() == nil {
		wake := d.Work.Wait()
		n, err := d.claimOnce(ctx, batch)
		if err != nil && ctx.Err() == nil {
			d.Log.Warn("claiming work failed", "error", err)
		}
		if n == batch {
			continue // more may be due
		}
		select {
		case <-ctx.Done():
		case <-wake:
		case <-time.After(d.poll()):
		}
	}
	return nil
}

// claimed is a command decided by a claim, with the trace its proxy's
// last API change started.
type claimed struct {
	cmd         *busv1.Command
	traceParent string
}

func (d *Dispatcher) claimOnce(ctx context.Context, batch int) (int, error) {
	var cmds []claimed
	var n int
	start := time.Now()
	err := d.Store.Write(ctx, func(tx *store.Tx) error {
		cmds, n = nil, 0
		rows, err := tx.ClaimDue(ctx, batch)
		if err != nil {
			return err
		}
		n = len(rows)
		for _, r := range rows {
			dec := d.Engine.Decide(r, tx.Now())
			if dec.Release {
				tx.Delete(r)
				d.Metrics.reconciled("release")
				continue
			}
			if dec.Command != nil {
				cmds = append(cmds, claimed{dec.Command, r.TraceParent})
				d.Metrics.reconciled(dec.Command.GetOperation().String())
			} else {
				d.Metrics.reconciled("wait")
				if r.CommandID == "" {
					r.TraceParent = "" // settled: the change's trace ends here
				}
			}
			tx.Update(r)
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	if n > 0 {
		d.Metrics.ReconcileDuration.Observe(time.Since(start).Seconds() / float64(n))
	}
	out := make([]outgoing, len(cmds))
	for i, c := range cmds {
		// A child of the API call that set the proxy in motion (a new
		// trace for a periodic resync); the command carries it to the
		// provisioner in its headers.
		sctx, span := tracer.Start(telemetry.WithTraceParent(ctx, c.traceParent), "reconcile.claim",
			trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(start), trace.WithAttributes(commandAttrs(c.cmd)...))
		out[i] = outgoing{ctx: sctx, cmd: c.cmd, span: span}
	}
	d.publish(ctx, out)
	return n, nil
}

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
// that JetStream did not store is taken back (Engine.Unsent), so that it
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
			d.Log.Warn("publishing a command failed", "command", c.GetCommandId(), "proxyUID", c.GetProxyUid(), "error", err)
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
			d.Log.Warn("a command was not stored by JetStream", "command", p.out.cmd.GetCommandId(), "proxyUID", p.out.cmd.GetProxyUid(), "error", err)
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
			d.Engine.Unsent(r, tx.Now())
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

// RunResults applies provisioner results from the shared durable consumer
// until ctx ends, waiting for NATS whenever it is unreachable.
func (d *Dispatcher) RunResults(ctx context.Context) error {
	bus.KeepConsuming(ctx, d.Log, "provisioner results", d.consumeResults)
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
	}, jetstream.PullMaxMessages(max))
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
		if res.GetPurpose() == busv1.CommandPurpose_COMMAND_PURPOSE_ORPHAN_GC {
			// Orphan GC's own commands answer no proxy.
			if d.GC != nil {
				if res.GetOperation() == busv1.Operation_OPERATION_LIST {
					d.GC.HandleList(rctx, res)
				} else {
					d.GC.HandleDelete(res)
				}
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
	// Lock rows in UID order so concurrent batches cannot deadlock.
	slices.SortFunc(items, func(a, b decoded) int {
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
		rows := map[string]*store.Row{}
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
				var err error
				r, err = tx.Lock(ctx, uid)
				if errors.Is(err, store.ErrNotFound) {
					d.Log.Debug("result for a proxy that no longer exists", "proxyUID", uid, "command", res.GetCommandId())
					continue
				}
				if err != nil {
					return err
				}
				rows[uid] = r
			}
			issued := r.CommandIssueTime
			switch d.Engine.Apply(r, res, tx.Now()) {
			case reconcile.Stale:
				d.Metrics.Results.WithLabelValues("stale").Inc()
				it.span.SetAttributes(attribute.Bool("result.stale", true))
				continue
			case reconcile.Released:
				tx.Delete(r)
				delete(rows, uid)
				released[uid] = true
			case reconcile.Applied:
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
				dec := d.Engine.Decide(r, tx.Now())
				if dec.Release {
					tx.Delete(r)
					continue
				}
				if dec.Command != nil {
					cmds = append(cmds, outgoing{ctx: traced[uid], cmd: dec.Command})
				}
			}
			if r.CommandID == "" && !r.Deleting() && settled(r.Phase) {
				r.TraceParent = "" // the change's trace ends with this result
			}
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

// settled reports a phase in which the reconciler waits for nothing but
// the next resync (or a spec change).
func settled(p proxyv1.ProxyPhase) bool {
	return p == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING || p == proxyv1.ProxyPhase_PROXY_PHASE_READY ||
		p == proxyv1.ProxyPhase_PROXY_PHASE_FAILED
}

// RunHealth applies health transitions (Running <-> Ready) until ctx ends,
// waiting for NATS whenever it is unreachable.
func (d *Dispatcher) RunHealth(ctx context.Context) error {
	bus.KeepConsuming(ctx, d.Log, "health transitions", d.consumeHealth)
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
		rows := map[string]*store.Row{}
		changed := map[string]bool{}
		for _, it := range items {
			uid := it.tr.GetProxyUid()
			r, ok := rows[uid]
			if !ok {
				var err error
				r, err = tx.Lock(ctx, uid)
				if errors.Is(err, store.ErrNotFound) {
					continue
				}
				if err != nil {
					return err
				}
				rows[uid] = r
			}
			if d.Engine.ApplyHealth(r, it.tr, tx.Now()) {
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

// outboxLockKey is the advisory lock the ProxyEvent publisher holds.
const outboxLockKey = 0x65677265_73730001

// RunOutbox publishes stored changes as ProxyEvents, in revision order, from
// one replica at a time (a postgres.Singleton), resuming from the stored
// cursor.
func (d *Dispatcher) RunOutbox(ctx context.Context) error {
	s := &postgres.Singleton{Pool: d.Store.Pool(), Key: outboxLockKey, Name: "ProxyEvent outbox", Log: d.Log, Retry: d.poll()}
	return s.Run(ctx, d.outbox)
}

func (d *Dispatcher) outbox(ctx context.Context) error {
	conn := d.Store.Pool()
	var cursor int64
	var refreshed time.Time
	if err := conn.QueryRow(ctx, "SELECT revision, refresh_time FROM orchestrator.event_cursor").Scan(&cursor, &refreshed); err != nil {
		return err
	}
	for ctx.Err() == nil {
		wake := d.Changes.Wait()
		changes, err := d.Store.Changes(ctx, cursor, 1000)
		if errors.Is(err, store.ErrCompacted) {
			d.Log.Warn("event outbox fell behind the change log; consumers resync from their own lists", "cursor", cursor)
			rev, rerr := d.Store.Revision(ctx)
			if rerr != nil {
				return rerr
			}
			cursor = rev
			continue
		}
		if err != nil {
			return err
		}
		if len(changes) > 0 {
			evs := make([]*busv1.ProxyEvent, len(changes))
			for i, c := range changes {
				evs[i] = &busv1.ProxyEvent{Revision: c.Revision, Type: c.Type, Proxy: c.Proxy, ChangeTime: timestamppb.New(c.Time)}
			}
			if err := d.publishEvents(ctx, evs); err != nil {
				return err
			}
			cursor = changes[len(changes)-1].Revision
			if _, err := conn.Exec(ctx, "UPDATE orchestrator.event_cursor SET revision = $1", cursor); err != nil {
				return err
			}
			d.Metrics.EventsPublished.Add(float64(len(changes)))
			if len(changes) == 1000 {
				continue
			}
		}
		if time.Since(refreshed) >= d.eventRefresh() {
			if err := d.refreshEvents(ctx, cursor); err != nil {
				return err
			}
			refreshed = time.Now()
			if _, err := conn.Exec(ctx, "UPDATE orchestrator.event_cursor SET refresh_time = $1", refreshed); err != nil {
				return err
			}
		}
		select {
		case <-ctx.Done():
		case <-wake:
		case <-time.After(d.poll()):
		}
	}
	return nil
}

// publishEvents publishes evs in order, each on its proxy's subject, and
// waits until JetStream has stored them all.
func (d *Dispatcher) publishEvents(ctx context.Context, evs []*busv1.ProxyEvent) error {
	futures := make([]jetstream.PubAckFuture, 0, len(evs))
	for _, ev := range evs {
		m, err := bus.Message(ctx, d.Names.ProxyEventSubject(ev.GetProxy().GetUid()), ev)
		if err != nil {
			return err
		}
		f, err := d.JS.PublishMsgAsync(m)
		if err != nil {
			return err
		}
		futures = append(futures, f)
	}
	for _, f := range futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			return err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// refreshEvents publishes again the current state of every proxy whose
// latest change is at cursor or older (already published). The streams
// keep a proxy's last event for bus.EventRetention only, and a proxy can
// go unchanged for longer; a consumer starting afterwards (a health or
// lease replica) would never learn of it. The events carry the revision of
// the proxy's latest change, so consumers that have it ignore them. Only
// the outbox calls this, between two batches: no newer event of a proxy
// can have been sent before its refreshed one.
func (d *Dispatcher) refreshEvents(ctx context.Context, cursor int64) error {
	const page = 500
	after, n := "", 0
	for {
		rows, err := d.Store.Published(ctx, after, cursor, page)
		if err != nil {
			return err
		}
		evs := make([]*busv1.ProxyEvent, len(rows))
		for i, r := range rows {
			evs[i] = &busv1.ProxyEvent{Revision: r.Revision, Type: proxyv1.ChangeType_CHANGE_TYPE_UPDATED, Proxy: r.Proto(false), ChangeTime: timestamppb.New(r.UpdateTime)}
		}
		if err := d.publishEvents(ctx, evs); err != nil {
			return err
		}
		n += len(rows)
		if len(rows) < page {
			d.Log.Info("republished the current state of every proxy on the event stream", "proxies", n, "revision", cursor)
			return nil
		}
		after = rows[len(rows)-1].UID
	}
}

// Metrics are the dispatcher's Prometheus series.
type Metrics struct {
	Reconciles        *prometheus.CounterVec
	ReconcileDuration prometheus.Histogram
	Results           *prometheus.CounterVec
	RoundTrip         *prometheus.HistogramVec
	EventsPublished   prometheus.Counter
}

// NewMetrics registers the series on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Reconciles: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_orchestrator_reconciles_total",
			Help: "Reconciles of claimed proxies, by outcome (the operation dispatched, wait, release).",
		}, []string{"outcome"}),
		ReconcileDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "egress_orchestrator_reconcile_duration_seconds",
			Help:    "Time to claim, decide and store one proxy, averaged over its claim batch.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16),
		}),
		Results: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_orchestrator_results_total",
			Help: "Provisioner results received, by how they were handled.",
		}, []string{"handling"}),
		RoundTrip: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "egress_orchestrator_command_round_trip_seconds",
			Help:    "From issuing a command to applying its result, by provider, operation and result class.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 14),
		}, []string{"provider", "operation", "result"}),
		EventsPublished: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "egress_orchestrator_proxy_events_published_total",
			Help: "ProxyEvents published by this replica's outbox.",
		}),
	}
	reg.MustRegister(m.Reconciles, m.ReconcileDuration, m.Results, m.RoundTrip, m.EventsPublished)
	return m
}

func (m *Metrics) reconciled(outcome string) { m.Reconciles.WithLabelValues(outcome).Inc() }

func (m *Metrics) observeResult(res *busv1.CommandResult, issued *time.Time, now time.Time) {
	m.Results.WithLabelValues("applied").Inc()
	if issued == nil {
		return
	}
	result := "ok"
	if e := res.GetError(); e != nil {
		result = e.GetReason().String()
	}
	m.RoundTrip.WithLabelValues(res.GetProvider(), res.GetOperation().String(), result).Observe(now.Sub(*issued).Seconds())
}
