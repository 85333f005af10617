package pool

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// Metrics of the pool controller.
type Metrics struct {
	Actions   *prometheus.CounterVec
	Scaling   *prometheus.CounterVec
	SyncTime  prometheus.Histogram
	Desired   *prometheus.GaugeVec
	SyncFails prometheus.Counter
	// Claimed counts syncs that claimed their pool (not skipped because
	// another replica held it).
	Claimed prometheus.Counter
	// ProviderHealthFails counts failed polls of the providers' health.
	ProviderHealthFails prometheus.Counter
}

// NewMetrics registers the controller's metrics on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Actions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_pool_actions_total", Help: "Proxies the pool controller created, drained or deleted, by pool, action and reason.",
		}, []string{"pool", "action", "reason"}),
		Scaling: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_pool_scaling_decisions_total", Help: "Changes of a pool's desired count, by pool and reason.",
		}, []string{"pool", "reason"}),
		SyncTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "egress_pool_sync_seconds", Help: "Time of one pool sync (read, decide, write).",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14),
		}),
		Desired: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "egress_pool_desired_replicas", Help: "The count each pool aims at.",
		}, []string{"pool"}),
		SyncFails: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "egress_pool_sync_failures_total", Help: "Pool syncs that failed and are retried.",
		}),
		Claimed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "egress_pool_syncs_total", Help: "Pool syncs this replica ran (it held the pool's claim).",
		}),
		ProviderHealthFails: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "egress_pool_provider_health_poll_failures_total", Help: "Polls of the providers' health (ListProviderHealth) that failed; the pools keep the last verdicts for --provider-health-stale-after.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.Actions, m.Scaling, m.SyncTime, m.Desired, m.SyncFails, m.Claimed, m.ProviderHealthFails)
	}
	return m
}

// Controller keeps every pool's proxies as its spec asks. It runs on every
// orchestrator replica; each sync of a pool claims the pool's row (FOR
// UPDATE SKIP LOCKED) for the transaction that reads its proxies, decides
// and writes, so one replica at a time owns a pool and a replica that dies
// mid-sync leaves nothing half-applied.
type Controller struct {
	Store *store.Store
	// Changes fires after committed writes (store.Listen); the controller
	// syncs every pool after it.
	Changes *store.Signal
	Log     *slog.Logger
	Metrics *Metrics
	// Resync is how often every pool is synced without a change; 0 means 5s.
	Resync time.Duration
	// MinInterval spaces syncs out under a stream of changes; 0 means 200ms.
	MinInterval time.Duration
	// Demand returns the lease demand last reported for a pool; nil when
	// there is none.
	Demand func(pool string) *Demand
	// ProviderNotReady returns the providers whose backends are not
	// ready, each with why (ProviderHealth.NotReady); nil: none known.
	ProviderNotReady func() map[string]string

	now func() time.Time
}

func (c *Controller) clock() time.Time {
	if c.now != nil {
		return c.now()
	}
	return time.Now()
}

// Run syncs every pool after each change and every Resync, until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	resync := c.Resync
	if resync <= 0 {
		resync = 5 * time.Second
	}
	gap := c.MinInterval
	if gap <= 0 {
		gap = 200 * time.Millisecond
	}
	for {
		wake := c.Changes.Wait()
		c.SyncAll(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-time.After(resync):
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(gap):
		}
	}
}

// SyncAll syncs every pool once.
func (c *Controller) SyncAll(ctx context.Context) {
	names, err := c.Store.PoolNames(ctx)
	if err != nil {
		if ctx.Err() == nil {
			c.Log.Warn("listing pools failed", "error", err)
		}
		return
	}
	for _, name := range names {
		if err := c.Sync(ctx, name); err != nil && ctx.Err() == nil {
			c.Metrics.SyncFails.Inc()
			c.Log.Warn("pool sync failed; retrying", "pool", name, "error", err)
		}
	}
	if err := c.SweepDrained(ctx); err != nil && ctx.Err() == nil {
		c.Log.Warn("deleting drained proxies failed; retrying", "error", err)
	}
}

// SweepDrained deletes the draining proxies of no pool whose leases ended
// (as the lease service last reported, after the proxy began to drain) or
// whose drain deadline passed.
func (c *Controller) SweepDrained(ctx context.Context) error {
	rows, err := c.Store.DrainingAlone(ctx)
	if err != nil || len(rows) == 0 {
		return err
	}
	var demand *Demand
	if c.Demand != nil {
		demand = c.Demand("")
	}
	now := c.clock()
	var due []Action
	for _, r := range rows {
		switch {
		case r.DrainDeadline != nil && !now.Before(*r.DrainDeadline):
			due = append(due, Action{r.UID, r.Name, RemoveDrainTimeout})
		case demand != nil && demand.Received.After(*r.DrainTime) && demand.LeasesByProxyID[r.UID] == 0:
			due = append(due, Action{r.UID, r.Name, RemoveDrainedNoLeases})
		}
	}
	if len(due) == 0 {
		return nil
	}
	return c.Store.Write(ctx, func(tx *store.Tx) error {
		for _, a := range due {
			r, err := tx.LockIfFree(ctx, a.UID)
			if errors.Is(err, store.ErrNotFound) {
				continue
			}
			if err != nil {
				return err
			}
			if r.Deleting() || !r.Draining() {
				continue
			}
			deleteProxy(tx, r, tx.Now())
			c.Log.Info("drained proxy deleted", "proxy_name", r.Name, "reason", a.Reason)
			c.Metrics.Actions.WithLabelValues("", "delete", a.Reason).Inc()
		}
		return nil
	})
}

const suffixChars = "abcdefghijklmnopqrstuvwxyz0123456789"

// newName is `<pool>-<5 random characters>`.
func newName(pool string) string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	for i := range b {
		b[i] = suffixChars[int(b[i])%len(suffixChars)]
	}
	return pool + "-" + string(b)
}

// Sync claims one pool, decides and applies the plan in one transaction.
// A pool another replica holds is skipped.
func (c *Controller) Sync(ctx context.Context, name string) error {
	start := time.Now()
	defer func() { c.Metrics.SyncTime.Observe(time.Since(start).Seconds()) }()
	var events []func()
	claimed := false
	err := c.Store.Write(ctx, func(tx *store.Tx) error {
		events, claimed = events[:0], false
		p, err := tx.ClaimPool(ctx, name)
		if errors.Is(err, store.ErrPoolNotFound) {
			return nil // gone, or another replica owns it right now
		}
		if err != nil {
			return err
		}
		claimed = true
		rows, err := tx.PoolProxies(ctx, name)
		if err != nil {
			return err
		}
		now := tx.Now()
		var demand *Demand
		if c.Demand != nil {
			demand = c.Demand(name)
		}
		members := Members(p.Spec, name, rows, demand)
		st := proto.Clone(p.Status).(*proxyv1.ProxyPoolStatus)
		hist := p.ScaleHistory
		desired, decision := c.desired(p, st, demand, now)
		if !reflect.DeepEqual(hist, p.ScaleHistory) {
			if err := tx.WriteScaleHistory(ctx, p.UID, p.ScaleHistory); err != nil {
				return err
			}
		}
		if decision != nil {
			st.LastScalingDecision = decision
			st.DesiredReplicas = decision.GetToReplicas()
			events = append(events, func() {
				c.Metrics.Scaling.WithLabelValues(name, decision.GetReason()).Inc()
				c.Log.Info("pool scaled", "pool", name, "from", decision.GetFromReplicas(), "to", decision.GetToReplicas(),
					"reason", decision.GetReason(), "why", decision.GetMessage())
			})
		}
		var notReady map[string]string
		if c.ProviderNotReady != nil {
			notReady = c.ProviderNotReady()
		}
		plan := Decide(Input{
			Pool: name, Spec: p.Spec, Deleted: p.Deleting(), Desired: int(desired), Members: members,
			LastFailure: lastFailures(st), ProviderNotReady: notReady, Now: now,
		})
		if err := c.apply(ctx, tx, p, plan, &events); err != nil {
			return err
		}
		events = append(events, func() { c.Metrics.Desired.WithLabelValues(name).Set(float64(desired)) })
		if p.Deleting() && len(rows) == 0 {
			events = append(events, func() {
				c.Metrics.Desired.DeleteLabelValues(name)
				c.Log.Info("pool deleted", "pool", name)
			})
			return tx.WritePool(ctx, p, proxyv1.ChangeType_CHANGE_TYPE_DELETED)
		}
		fillStatus(st, p, plan, demand, now)
		if proto.Equal(st, p.Status) {
			return nil
		}
		p.Status = st
		return tx.WritePool(ctx, p, proxyv1.ChangeType_CHANGE_TYPE_UPDATED)
	})
	if err == nil {
		if claimed {
			c.Metrics.Claimed.Inc()
		}
		for _, e := range events {
			e()
		}
	}
	return err
}

// desired is the count the pool aims at and, when it changes now, the
// decision that changed it.
func (c *Controller) desired(p *store.PoolRow, st *proxyv1.ProxyPoolStatus, demand *Demand, now time.Time) (int32, *proxyv1.ScalingDecision) {
	cur := st.GetDesiredReplicas()
	if st.GetLastScalingDecision() == nil {
		to := Clamp(p.Spec, p.Spec.GetReplicas())
		return to, &proxyv1.ScalingDecision{
			Time: timestamppb.New(now), FromReplicas: 0, ToReplicas: to, Reason: ScaleScaled,
			Message: fmt.Sprintf("pool created with replicas %d", p.Spec.GetReplicas()),
		}
	}
	if p.Spec.GetAutoscaling() == nil {
		if cur != p.Spec.GetReplicas() {
			return p.Spec.GetReplicas(), &proxyv1.ScalingDecision{
				Time: timestamppb.New(now), FromReplicas: cur, ToReplicas: p.Spec.GetReplicas(), Reason: ScaleScaled,
				Message: fmt.Sprintf("replicas is %d", p.Spec.GetReplicas()),
			}
		}
		return cur, nil
	}
	to, d, hist := Autoscale(p.Spec, st, demand, p.ScaleHistory, now)
	p.ScaleHistory = hist
	if d != nil {
		return to, d
	}
	return Clamp(p.Spec, cur), nil
}

// Members turns a pool's rows into what Decide needs.
func Members(s *proxyv1.ProxyPoolSpec, pool string, rows []*lifecycle.Proxy, demand *Demand) []Member {
	out := make([]Member, 0, len(rows))
	for _, r := range rows {
		m := Member{
			UID: r.UID, Name: r.Name, Target: TargetOf(s, r.Spec), Created: r.CreateTime, Phase: r.Phase, Reason: r.Reason,
			UpToDate: UpToDate(s, pool, r.Spec, r.Labels), Draining: r.Draining(), Deleting: r.Deleting(), Leases: -1,
		}
		if r.DrainDeadline != nil {
			m.DrainDeadline = *r.DrainDeadline
		}
		if !m.Ready() {
			switch {
			case !r.Healthy && r.HealthTransitionTime != nil:
				m.NotReadySince = *r.HealthTransitionTime
			case r.Healthy && r.PhaseTransitionTime != nil:
				m.NotReadySince = *r.PhaseTransitionTime
			default:
				m.NotReadySince = r.CreateTime
			}
		}
		if demand != nil {
			// A report older than the proxy's draining says nothing of
			// the leases it holds now.
			if r.DrainTime == nil || demand.Received.After(*r.DrainTime) {
				m.Leases = demand.LeasesByProxyID[r.UID]
			}
		}
		out = append(out, m)
	}
	return out
}

func lastFailures(st *proxyv1.ProxyPoolStatus) map[Target]time.Time {
	out := map[Target]time.Time{}
	for _, s := range st.GetSpread() {
		if s.GetLastFailureTime() != nil {
			out[Target{Provider: s.GetProvider(), Zone: s.GetZone()}] = s.GetLastFailureTime().AsTime()
		}
	}
	return out
}

// apply writes the plan: new proxies, drains, deletions.
func (c *Controller) apply(ctx context.Context, tx *store.Tx, p *store.PoolRow, plan Plan, events *[]func()) error {
	now := tx.Now()
	name := p.Name
	for _, t := range plan.Create {
		r := lifecycle.New(newName(name), ProxyLabels(p.Spec, name), ProxySpec(p.Spec, t), false, now)
		r.Pool = name
		tx.Insert(r)
		pn := r.Name
		*events = append(*events, func() {
			c.Metrics.Actions.WithLabelValues(name, "create", t.String()).Inc()
			c.Log.Info("pool proxy created", "pool", name, "proxy_name", pn, "target", t.String())
		})
	}
	timeout := DrainTimeout(p.Spec)
	for _, a := range plan.Drain {
		r, err := tx.LockIfFree(ctx, a.UID)
		if errors.Is(err, store.ErrNotFound) {
			continue // busy: the next sync decides again
		}
		if err != nil {
			return err
		}
		if r.Draining() || r.Deleting() {
			continue
		}
		lifecycle.Drain(r, now, timeout)
		tx.Update(r)
		*events = append(*events, func() {
			c.Metrics.Actions.WithLabelValues(name, "drain", a.Reason).Inc()
			c.Log.Info("pool proxy draining", "pool", name, "proxy_name", a.Name, "reason", a.Reason)
		})
	}
	for _, a := range plan.Delete {
		r, err := tx.LockIfFree(ctx, a.UID)
		if errors.Is(err, store.ErrNotFound) {
			continue
		}
		if err != nil {
			return err
		}
		if r.Deleting() {
			continue
		}
		deleteProxy(tx, r, now)
		*events = append(*events, func() {
			c.Metrics.Actions.WithLabelValues(name, "delete", a.Reason).Inc()
			c.Log.Info("pool proxy deleted", "pool", name, "proxy_name", a.Name, "reason", a.Reason)
		})
	}
	return nil
}

// fillStatus writes the plan's counts and conditions into st.
func fillStatus(st *proxyv1.ProxyPoolStatus, p *store.PoolRow, plan Plan, demand *Demand, now time.Time) {
	st.ObservedGeneration = p.Generation
	st.CurrentReplicas = int32(plan.Current)
	st.ReadyReplicas = int32(plan.Ready)
	st.UpdatedReplicas = int32(plan.Updated)
	st.DrainingReplicas = int32(plan.Draining)
	st.TemplateHash = TemplateHash(p.Spec)
	st.Spread = plan.Spread
	if demand != nil {
		st.Demand = demand.Pool
	}
	_, unavailable := Surge(p.Spec)
	if plan.Available {
		setCondition(st, ConditionAvailable, true, ReasonMinimumReady, fmt.Sprintf("%d Ready, at least %d wanted", plan.Ready, int(st.GetDesiredReplicas())-unavailable), now)
	} else {
		setCondition(st, ConditionAvailable, false, ReasonBelowMinimumReady, fmt.Sprintf("%d Ready, at least %d wanted", plan.Ready, int(st.GetDesiredReplicas())-unavailable), now)
	}
	if plan.Progressing != "" {
		setCondition(st, ConditionProgressing, true, ReasonProgressing, plan.Progressing, now)
	} else {
		setCondition(st, ConditionProgressing, false, ReasonSettled, "every proxy is Ready and up to date", now)
	}
	if len(plan.Failing) > 0 {
		msg := "failing:"
		for k, t := range plan.Failing {
			if k > 0 {
				msg += ";"
			}
			msg += " " + t.String()
			if why := plan.FailingWhy[t]; why != "" {
				msg += " (" + why + ")"
			}
		}
		setCondition(st, ConditionProviderDegraded, true, ReasonProviderFailing, msg+"; their missing share is spread over the others", now)
	} else {
		setCondition(st, ConditionProviderDegraded, false, ReasonAllProvidersHealthy, "", now)
	}
}

func setCondition(st *proxyv1.ProxyPoolStatus, typ string, holds bool, reason, msg string, now time.Time) {
	want := proxyv1.ConditionStatus_CONDITION_STATUS_FALSE
	if holds {
		want = proxyv1.ConditionStatus_CONDITION_STATUS_TRUE
	}
	for _, c := range st.Conditions {
		if c.GetType() == typ {
			if c.GetStatus() != want {
				c.LastTransitionTime = timestamppb.New(now)
			}
			c.Status, c.Reason, c.Message = want, reason, msg
			return
		}
	}
	st.Conditions = append(st.Conditions, &proxyv1.PoolCondition{
		Type: typ, Status: want, Reason: reason, Message: msg, LastTransitionTime: timestamppb.New(now),
	})
}

// deleteProxy deletes a proxy the pool gives up (it asks for no
// skip_cleanup and starts no trace of its own).
func deleteProxy(tx *store.Tx, r *lifecycle.Proxy, now time.Time) {
	if lifecycle.RequestDelete(r, false, "", now) {
		tx.Delete(r)
		return
	}
	tx.Update(r)
}
