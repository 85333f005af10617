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
	pc, err := proxies.Consume(func(m jetstream.Msg) { s.handleProxy(ctx, m) }, bus.ConsumeOpts(jetstream.ConsumeErrHandler(errHandler("proxy events")))...)
	if err != nil {
		return fmt.Errorf("consuming proxy events: %w", err)
	}
	defer pc.Stop()
	hc, err := health.Consume(func(m jetstream.Msg) { s.handleHealth(ctx, m) }, bus.ConsumeOpts(jetstream.ConsumeErrHandler(errHandler("health events")))...)
	if err != nil {
		return fmt.Errorf("consuming health events: %w", err)
	}
	defer hc.Stop()
	<-ctx.Done()
	return nil
}

func (s *Syncer) handleProxy(ctx context.Context, m jetstream.Msg) {
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
	applied, err := s.st.ApplyProxy(mctx, p, ev.GetRevision())
	if store.Rejected(err) {
		// The same snapshot fails every time: a resync would fail on it
		// too. Skip it, and keep the proxy out of the mirror meanwhile.
		s.met.Events.WithLabelValues("proxy", "skipped").Inc()
		s.skip(mctx, "event", p.UID, p.Name, ev.GetRevision(), deleted, err)
		return
	}
	if err != nil {
		s.met.Events.WithLabelValues("proxy", "error").Inc()
		if ctx.Err() == nil {
			s.log.Error("applying a proxy event failed", "proxy_uid", p.UID, "revision", ev.GetRevision(), "error", err)
			s.RequestResync("a proxy event could not be applied")
		}
		return
	}
	if !applied {
		s.met.Events.WithLabelValues("proxy", "stale").Inc()
		return
	}
	s.changed(p.UID)
	s.met.Events.WithLabelValues("proxy", "applied").Inc()
	s.log.DebugContext(mctx, "proxy event applied", "proxy_uid", p.UID, "proxy_name", p.Name, "revision", ev.GetRevision(),
		"type", ev.GetType().String(), "ready", p.Ready, "healthy", p.Healthy)
}

func (s *Syncer) handleHealth(ctx context.Context, m jetstream.Msg) {
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
	applied, err := s.st.ApplyHealth(mctx, store.HealthTransition{
		Sequence: t.GetSequence(), ProxyUID: t.GetProxyUid(), ProviderID: t.GetProviderId(), Healthy: t.GetHealthy(), Time: when,
	})
	if store.Rejected(err) {
		s.met.Events.WithLabelValues("health", "skipped").Inc()
		s.met.Skipped.WithLabelValues("event").Inc()
		s.log.Warn("WARNING: skipping a health event that cannot be applied", "proxy_uid", t.GetProxyUid(), "sequence", t.GetSequence(), "error", err)
		return
	}
	if err != nil {
		s.met.Events.WithLabelValues("health", "error").Inc()
		if ctx.Err() == nil {
			s.log.Error("applying a health event failed", "proxy_uid", t.GetProxyUid(), "sequence", t.GetSequence(), "error", err)
			s.RequestResync("a health event could not be applied")
		}
		return
	}
	if !applied {
		s.met.Events.WithLabelValues("health", "stale").Inc()
		return
	}
	s.met.Events.WithLabelValues("health", "applied").Inc()
	s.log.DebugContext(mctx, "health transition applied", "proxy_uid", t.GetProxyUid(), "sequence", t.GetSequence(), "healthy", t.GetHealthy())
}

// Resync lists every proxy from the orchestrator and applies the listing:
// each page's proxies at that page's revision, then every stored proxy
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
	mark, err := s.st.ResyncMark(ctx)
	if err != nil {
		s.met.Resyncs.WithLabelValues("error").Inc()
		return err
	}
	seen := []string{}
	applied, deleted := 0, 0
	firstRevision, err := proxysync.List(ctx, s.cfg.Lister, func(proxies []*proxyv1.Proxy, revision int64) error {
		page := make([]store.ProxyState, 0, len(proxies))
		for _, p := range proxies {
			ps, err := FromProxy(p, false)
			if err != nil {
				if storable(p.GetUid()) {
					// It exists: withdrawn, not deleted.
					seen = append(seen, p.GetUid())
				}
				s.skip(ctx, "resync", p.GetUid(), p.GetName(), revision, false, err)
				continue
			}
			page = append(page, ps)
			seen = append(seen, ps.UID)
		}
		n, rejected, err := s.st.ApplySnapshot(ctx, page, revision)
		if err != nil {
			return err
		}
		for _, r := range rejected {
			s.skip(ctx, "resync", r.Proxy.UID, r.Proxy.Name, revision, false, r.Err)
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
