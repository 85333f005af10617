// Package mirror keeps the lease service's proxy mirror — its copy of every
// proxy, the table lease.proxies — in step with the orchestrator and the
// health service. It follows the ProxyEvent and
// HealthTransitionEvent streams from NATS JetStream (starting with the last
// event of every proxy, then every change), applies each event to the
// database idempotently (by revision, by sequence), and resyncs from the
// orchestrator's ProxyService.ListProxies at start, after a NATS reconnect,
// after an event could not be applied, and periodically.
//
// Every replica runs its own consumers on the shared table; applying the
// same event twice changes nothing.
package mirror

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/proxysync"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/metrics"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/store"
)

// Lister is the part of the orchestrator's ProxyService a resync uses.
type Lister = proxysync.Lister

// Config configures a Syncer.
type Config struct {
	Names bus.Names
	// Lister is the orchestrator; nil disables resyncs (events only).
	Lister Lister
	// ResyncInterval is the period of the safety-net resync; 0 disables
	// it.
	ResyncInterval time.Duration
	// ResyncTimeout bounds one resync.
	ResyncTimeout time.Duration
	// Changed, when set, is told of every proxy snapshot the mirror
	// applied: its uid, or "" when a resync changed or deleted proxies it
	// does not name one by one.
	Changed func(uid string)
}

// Syncer applies events and resyncs.
type Syncer struct {
	st  *store.Store
	js  jetstream.JetStream
	cfg Config
	met *metrics.Metrics
	log *slog.Logger

	loop *proxysync.Loop
}

// New returns a Syncer.
func New(st *store.Store, js jetstream.JetStream, cfg Config, met *metrics.Metrics, log *slog.Logger) *Syncer {
	if cfg.ResyncTimeout <= 0 {
		cfg.ResyncTimeout = time.Minute
	}
	s := &Syncer{st: st, js: js, cfg: cfg, met: met, log: log}
	s.loop = &proxysync.Loop{Resync: s.resync, Interval: cfg.ResyncInterval, What: "the proxy mirror", Log: log}
	return s
}

// RequestResync asks for a resync soon (coalescing requests).
func (s *Syncer) RequestResync(reason string) { s.loop.Request(reason) }

// Resyncs is how many resyncs have completed, for tests.
func (s *Syncer) Resyncs() int { return s.loop.Done() }

// Run consumes both event streams and runs resyncs until ctx ends.
//
// The two are independent: while NATS is unreachable (a restart, a
// network blip, a replica starting before NATS) the consumers are set up
// again and again (bus.KeepConsuming), and afresh once it is back, while resyncs from the orchestrator
// keep the mirror current; once the consumers are up again a resync catches
// up on what was missed.
func (s *Syncer) Run(ctx context.Context) error {
	resyncs := make(chan struct{})
	if s.cfg.Lister == nil {
		s.log.Warn("WARNING: no orchestrator address configured; the proxy mirror is learnt from events alone, with no resync from the orchestrator to check it against")
		close(resyncs)
	} else {
		go func() { defer close(resyncs); s.loop.Run(ctx) }()
	}
	attempts := 0
	bus.KeepConsuming(ctx, s.js, s.log, "the proxy mirror's event streams", func(ctx context.Context) error {
		if attempts++; attempts > 1 {
			s.RequestResync("event consumers set up again")
		}
		return s.consume(ctx)
	})
	<-resyncs
	return nil
}

// consume follows both event streams until ctx ends or NATS reconnects.
func (s *Syncer) consume(ctx context.Context) error {
	ctx, cancel := bus.UntilReconnect(ctx, s.js.Conn())
	defer cancel()
	proxies, err := s.js.OrderedConsumer(ctx, s.cfg.Names.ProxyEventStream(), jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{s.cfg.Names.ProxyEventSubjects()},
		DeliverPolicy:  jetstream.DeliverLastPerSubjectPolicy,
	})
	if err != nil {
		return fmt.Errorf("proxy event consumer: %w", err)
	}
	health, err := s.js.OrderedConsumer(ctx, s.cfg.Names.HealthEventStream(), jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{s.cfg.Names.HealthEventSubjects()},
		DeliverPolicy:  jetstream.DeliverLastPerSubjectPolicy,
	})
	if err != nil {
		return fmt.Errorf("health event consumer: %w", err)
	}
	errHandler := func(kind string) jetstream.ConsumeErrHandler {
		return func(_ jetstream.ConsumeContext, err error) {
			if ctx.Err() != nil {
				return
			}
			s.log.Warn("event consumer error; events may have been missed", "stream", kind, "error", err)
			s.RequestResync("consumer error on " + kind)
		}
	}
	// Decoded events queue for appliers that take what has queued up as
	// one batch. They end with ctx, which is ended here on every return,
	// after the consumers stopped: an error return must not wait for a
	// reconnect that may never come.
	proxyEvents, healthEvents := make(chan proxyEvent, eventBatch), make(chan healthEvent, eventBatch)
	var appliers sync.WaitGroup
	defer func() { cancel(); appliers.Wait() }()
	appliers.Go(func() { applyInBatches(ctx, proxyEvents, s.applyProxies) })
	appliers.Go(func() { applyInBatches(ctx, healthEvents, s.applyHealths) })
	pc, err := proxies.Consume(func(m jetstream.Msg) { s.handleProxy(ctx, m, proxyEvents) }, bus.ConsumeOpts(jetstream.ConsumeErrHandler(errHandler("proxy events")))...)
	if err != nil {
		return fmt.Errorf("consuming proxy events: %w", err)
	}
	defer pc.Stop()
	hc, err := health.Consume(func(m jetstream.Msg) { s.handleHealth(ctx, m, healthEvents) }, bus.ConsumeOpts(jetstream.ConsumeErrHandler(errHandler("health events")))...)
	if err != nil {
		return fmt.Errorf("consuming health events: %w", err)
	}
	defer hc.Stop()
	<-ctx.Done()
	return nil
}

// eventBatch is the most proxy events applied in one statement.
const eventBatch = 512

// proxyEvent is a decoded proxy event on its way to the database.
type proxyEvent struct {
	ctx      context.Context // carries the event's trace
	state    store.ProxyState
	revision int64
	typ      proxyv1.ChangeType
}

// handleProxy decodes a proxy event and queues it for applyEvents; one it
// cannot apply is dropped or skipped here.
func (s *Syncer) handleProxy(ctx context.Context, m jetstream.Msg, events chan<- proxyEvent) {
	var ev busv1.ProxyEvent
	mctx, err := bus.Decode(ctx, m, &ev)
	if err != nil {
		s.met.Events.WithLabelValues("proxy", "invalid").Inc()
		s.log.Warn("dropping a proxy event that cannot be decoded", "subject", m.Subject(), "error", err)
		return
	}
	deleted := ev.GetType() == proxyv1.ChangeType_CHANGE_TYPE_DELETED
	p, err := FromProxy(ev.GetProxy(), deleted)
	if err != nil && ev.GetRevision() > 0 && storable(ev.GetProxy().GetUid()) {
		s.met.Events.WithLabelValues("proxy", "skipped").Inc()
		s.skip(mctx, "event", ev.GetProxy().GetUid(), ev.GetProxy().GetName(), ev.GetRevision(), deleted, err)
		return
	}
	if err != nil || ev.GetRevision() <= 0 {
		s.met.Events.WithLabelValues("proxy", "invalid").Inc()
		s.met.Skipped.WithLabelValues("event").Inc()
		s.log.Warn("WARNING: dropping an invalid proxy event", "subject", m.Subject(), "revision", ev.GetRevision(), "error", err)
		return
	}
	select {
	case events <- proxyEvent{ctx: mctx, state: p, revision: ev.GetRevision(), typ: ev.GetType()}:
	case <-ctx.Done():
	}
}

// applyInBatches hands queued events to apply until ctx ends: whatever
// has queued up (at most eventBatch) at once, so that following a
// converge of many proxies costs a statement and a commit per batch, not
// per event. A proxy's events arrive in order, and a batch keeps the
// newest of each; revisions and sequences make applying in batches, and
// beside other replicas, safe.
func applyInBatches[E any](ctx context.Context, events <-chan E, apply func(context.Context, []E)) {
	batch := make([]E, 0, eventBatch)
	for {
		select {
		case <-ctx.Done():
			return
		case ev := <-events:
			batch = append(batch[:0], ev)
		}
	more:
		for len(batch) < eventBatch {
			select {
			case ev := <-events:
				batch = append(batch, ev)
			default:
				break more
			}
		}
		apply(ctx, batch)
	}
}

func (s *Syncer) applyProxies(ctx context.Context, batch []proxyEvent) {
	states, revisions := make([]store.ProxyState, len(batch)), make([]int64, len(batch))
	for i, ev := range batch {
		states[i], revisions[i] = ev.state, ev.revision
	}
	applied, err := s.st.ApplyProxies(ctx, states, revisions)
	if store.Rejected(err) {
		// A snapshot PostgreSQL refuses: one at a time, so that it alone
		// is skipped.
		for _, ev := range batch {
			s.applyOne(ctx, ev)
		}
		return
	}
	if err != nil {
		s.met.Events.WithLabelValues("proxy", "error").Add(float64(len(batch)))
		if ctx.Err() == nil {
			s.log.Error("applying proxy events failed", "events", len(batch), "error", err)
			s.RequestResync("proxy events could not be applied")
		}
		return
	}
	for i, ev := range batch {
		s.proxyApplied(ev, applied[i])
	}
}

func (s *Syncer) applyOne(ctx context.Context, ev proxyEvent) {
	applied, err := s.st.ApplyProxy(ev.ctx, ev.state, ev.revision)
	if store.Rejected(err) {
		// The same snapshot fails every time: a resync would fail on it
		// too. Skip it, and keep the proxy out of the mirror meanwhile.
		s.met.Events.WithLabelValues("proxy", "skipped").Inc()
		s.skip(ev.ctx, "event", ev.state.UID, ev.state.Name, ev.revision, ev.state.Deleted, err)
		return
	}
	if err != nil {
		s.met.Events.WithLabelValues("proxy", "error").Inc()
		if ctx.Err() == nil {
			s.log.Error("applying a proxy event failed", "proxy_uid", ev.state.UID, "revision", ev.revision, "error", err)
			s.RequestResync("a proxy event could not be applied")
		}
		return
	}
	s.proxyApplied(ev, applied)
}

// proxyApplied counts an event the database took (or found stale) and tells
// the lease view.
func (s *Syncer) proxyApplied(ev proxyEvent, applied bool) {
	if !applied {
		s.met.Events.WithLabelValues("proxy", "stale").Inc()
		return
	}
	s.changed(ev.state.UID)
	s.met.Events.WithLabelValues("proxy", "applied").Inc()
	s.log.DebugContext(ev.ctx, "proxy event applied", "proxy_uid", ev.state.UID, "proxy_name", ev.state.Name, "revision", ev.revision,
		"type", ev.typ.String(), "ready", ev.state.Ready, "healthy", ev.state.Healthy)
}

// healthEvent is a decoded health transition on its way to the database.
type healthEvent struct {
	ctx context.Context // carries the event's trace
	t   store.HealthTransition
}

// handleHealth decodes a health event and queues it for applyHealths.
func (s *Syncer) handleHealth(ctx context.Context, m jetstream.Msg, events chan<- healthEvent) {
	var ev busv1.HealthTransitionEvent
	mctx, err := bus.Decode(ctx, m, &ev)
	if err != nil {
		s.met.Events.WithLabelValues("health", "invalid").Inc()
		s.log.Warn("dropping a health event that cannot be decoded", "subject", m.Subject(), "error", err)
		return
	}
	t := ev.GetTransition()
	if t.GetProxyUid() == "" || t.GetSequence() <= 0 {
		s.met.Events.WithLabelValues("health", "invalid").Inc()
		s.log.Warn("dropping an invalid health event", "subject", m.Subject(), "sequence", t.GetSequence())
		return
	}
	when := time.Now()
	if t.GetTransitionTime() != nil {
		when = t.GetTransitionTime().AsTime()
	}
	ht := store.HealthTransition{Sequence: t.GetSequence(), ProxyUID: t.GetProxyUid(), ProviderID: t.GetProviderId(), Healthy: t.GetHealthy(), Time: when}
	select {
	case events <- healthEvent{ctx: mctx, t: ht}:
	case <-ctx.Done():
	}
}

func (s *Syncer) applyHealths(ctx context.Context, batch []healthEvent) {
	ts := make([]store.HealthTransition, len(batch))
	for i, ev := range batch {
		ts[i] = ev.t
	}
	applied, err := s.st.ApplyHealths(ctx, ts)
	if store.Rejected(err) {
		// A transition PostgreSQL refuses: one at a time, so that it
		// alone is skipped.
		for _, ev := range batch {
			s.applyHealth(ctx, ev)
		}
		return
	}
	if err != nil {
		s.met.Events.WithLabelValues("health", "error").Add(float64(len(batch)))
		if ctx.Err() == nil {
			s.log.Error("applying health events failed", "events", len(batch), "error", err)
			s.RequestResync("health events could not be applied")
		}
		return
	}
	for i, ev := range batch {
		s.healthApplied(ev, applied[i])
	}
}

func (s *Syncer) applyHealth(ctx context.Context, ev healthEvent) {
	applied, err := s.st.ApplyHealth(ev.ctx, ev.t)
	if store.Rejected(err) {
		s.met.Events.WithLabelValues("health", "skipped").Inc()
		s.met.Skipped.WithLabelValues("event").Inc()
		s.log.Warn("WARNING: skipping a health event that cannot be applied", "proxy_uid", ev.t.ProxyUID, "sequence", ev.t.Sequence, "error", err)
		return
	}
	if err != nil {
		s.met.Events.WithLabelValues("health", "error").Inc()
		if ctx.Err() == nil {
			s.log.Error("applying a health event failed", "proxy_uid", ev.t.ProxyUID, "sequence", ev.t.Sequence, "error", err)
			s.RequestResync("a health event could not be applied")
		}
		return
	}
	s.healthApplied(ev, applied)
}

func (s *Syncer) healthApplied(ev healthEvent, applied bool) {
	if !applied {
		s.met.Events.WithLabelValues("health", "stale").Inc()
		return
	}
	s.met.Events.WithLabelValues("health", "applied").Inc()
	s.log.DebugContext(ev.ctx, "health transition applied", "proxy_uid", ev.t.ProxyUID, "sequence", ev.t.Sequence, "healthy", ev.t.Healthy)
}

// Resync lists every proxy from the orchestrator and applies the listing:
// each proxy at the revision of its last change (the page's revision when
// the orchestrator does not say), so that proxies unchanged since they
// were stored are left untouched, then every stored proxy
// missing from the listing whose snapshot was applied before the listing
// began is marked deleted (by the listing, not by revisions, so a reset of
// the orchestrator's database purges what it no longer holds).
func (s *Syncer) Resync(ctx context.Context) error {
	if s.cfg.Lister == nil {
		return errors.New("no orchestrator configured")
	}
	return s.loop.Once(ctx)
}

func (s *Syncer) resync(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ResyncTimeout)
	defer cancel()
	start := time.Now()
	mark, err := s.st.TakeResyncMark(ctx)
	if err != nil {
		s.met.Resyncs.WithLabelValues("error").Inc()
		return err
	}
	seen := []string{}
	applied, deleted := 0, 0
	firstRevision, err := proxysync.List(ctx, s.cfg.Lister, func(proxies []*proxyv1.Proxy, revision int64) error {
		page := make([]store.ProxyState, 0, len(proxies))
		revisions := make([]int64, 0, len(proxies))
		for _, p := range proxies {
			rev := proxysync.Revision(p, revision)
			ps, err := FromProxy(p, false)
			if err != nil {
				if storable(p.GetUid()) {
					// It exists: withdrawn, not deleted.
					seen = append(seen, p.GetUid())
				}
				s.skip(ctx, "resync", p.GetUid(), p.GetName(), rev, false, err)
				continue
			}
			page, revisions = append(page, ps), append(revisions, rev)
			seen = append(seen, ps.UID)
		}
		n, rejected, err := s.st.ApplySnapshot(ctx, page, revisions)
		if err != nil {
			return err
		}
		for _, r := range rejected {
			s.skip(ctx, "resync", r.Proxy.UID, r.Proxy.Name, r.Revision, false, r.Err)
		}
		applied += n
		return nil
	})
	defer func() {
		if applied > 0 || deleted > 0 {
			s.changed("")
		}
	}()
	if err != nil {
		s.met.Resyncs.WithLabelValues("error").Inc()
		return err
	}
	deleted, err = s.st.DeleteMissing(ctx, seen, mark, firstRevision)
	if err != nil {
		s.met.Resyncs.WithLabelValues("error").Inc()
		return err
	}
	s.met.Resyncs.WithLabelValues("ok").Inc()
	s.log.Info("proxy mirror resynced from the orchestrator", "proxies", len(seen), "changed", applied, "deleted", deleted,
		"revision", firstRevision, "duration", time.Since(start))
	return nil
}

func (s *Syncer) changed(uid string) {
	if s.cfg.Changed != nil {
		s.cfg.Changed(uid)
	}
}

// skip isolates a proxy whose snapshot cannot be applied, so that it never
// stops the rest of the pool: counted, logged loudly by name, and
// withdrawn from leasing (deleted, for a tombstone) until a snapshot that
// can be applied arrives.
func (s *Syncer) skip(ctx context.Context, source, uid, name string, revision int64, deleted bool, cause error) {
	s.met.Skipped.WithLabelValues(source).Inc()
	s.log.WarnContext(ctx, "WARNING: skipping a proxy that cannot be applied; it is not leased until a snapshot that can be applied arrives",
		"source", source, "proxy_uid", uid, "proxy_name", name, "revision", revision, "deleted", deleted, "error", cause)
	if !storable(uid) {
		return
	}
	if err := s.st.Withdraw(ctx, uid, revision, deleted); err != nil && ctx.Err() == nil {
		s.log.WarnContext(ctx, "WARNING: withdrawing a skipped proxy failed; the next resync tries again", "proxy_uid", uid, "error", err)
	}
}

// storable reports text PostgreSQL can store: UTF-8 without NUL bytes.
func storable(v string) bool {
	return v != "" && utf8.ValidString(v) && !strings.ContainsRune(v, 0)
}

// checkText names the first field of a proxy PostgreSQL could not store.
func checkText(fields ...string) error {
	for i := 0; i+1 < len(fields); i += 2 {
		v := fields[i+1]
		if !utf8.ValidString(v) || strings.ContainsRune(v, 0) {
			return status.Errorf(codes.InvalidArgument, "%s is not UTF-8 text without NUL bytes", fields[i])
		}
	}
	return nil
}

// FromProxy turns an orchestrator Proxy into the lease service's view. A
// text field PostgreSQL cannot store is an error naming the field.
func FromProxy(p *proxyv1.Proxy, deleted bool) (store.ProxyState, error) {
	if p.GetUid() == "" {
		return store.ProxyState{}, status.Error(codes.InvalidArgument, "proxy without uid")
	}
	st := p.GetStatus()
	ps := store.ProxyState{
		UID:        p.GetUid(),
		Name:       p.GetName(),
		Provider:   p.GetSpec().GetProvider(),
		Region:     p.GetSpec().GetPlacement().GetRegion(),
		Zone:       p.GetSpec().GetPlacement().GetZone(),
		Labels:     p.GetLabels(),
		Host:       st.GetIp(),
		Port:       st.GetPort(),
		ProviderID: st.GetProviderId(),
		Ready:      st.GetPhase() == proxyv1.ProxyPhase_PROXY_PHASE_READY,
		Healthy:    st.GetHealthy(),
		Deleted:    deleted,
		Pool:       p.GetPool(),
		Draining:   p.GetDraining(),
	}
	if ps.Host == "" && p.GetSpec().GetEndpoint() != nil {
		ps.Host = p.GetSpec().GetEndpoint().GetHost()
		if ps.Port == 0 {
			ps.Port = p.GetSpec().GetEndpoint().GetPort()
		}
	}
	if st.GetHealthTransitionTime() != nil {
		t := st.GetHealthTransitionTime().AsTime()
		ps.HealthTime = &t
	}
	if p.GetSpec().GetLease() != nil && p.GetSpec().GetLease().MaxLeases != nil {
		v := p.GetSpec().GetLease().GetMaxLeases()
		ps.MaxLeases = &v
	}
	if err := checkText("uid", ps.UID, "name", ps.Name, "spec.provider", ps.Provider, "spec.placement.region", ps.Region,
		"spec.placement.zone", ps.Zone, "address host", ps.Host, "status.provider_id", ps.ProviderID, "pool", ps.Pool); err != nil {
		return store.ProxyState{}, fmt.Errorf("proxy %q: %w", ps.UID, err)
	}
	for k, v := range ps.Labels {
		if err := checkText("labels key", k, "labels["+k+"]", v); err != nil {
			return store.ProxyState{}, fmt.Errorf("proxy %q: %w", ps.UID, err)
		}
	}
	return ps, nil
}
