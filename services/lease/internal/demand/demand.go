// Package demand publishes the lease demand on each proxy pool for the
// orchestrator's pool controller: leases held, capacity, leasable proxies,
// acquires refused since the previous report, and the leases each proxy
// holds (which tell the controller when a draining proxy is free to go).
// One lease replica at a time publishes (a PostgreSQL advisory lock); the
// numbers come from the shared database, so any replica reports the same.
package demand

import (
	"context"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/store"
)

// Publisher reports demand every Interval.
type Publisher struct {
	Store    *store.Store
	JS       jetstream.JetStream
	Names    bus.Names
	Interval time.Duration
	Log      *slog.Logger
	// Published counts reports by pool ("" for proxies of no pool).
	Published *prometheus.CounterVec
}

// NewPublished registers the publisher's counter on reg.
func NewPublished(reg prometheus.Registerer) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "egress_lease_pool_demand_reports_total", Help: "Pool demand reports published for the orchestrator, by pool.",
	}, []string{"pool"})
	if reg != nil {
		reg.MustRegister(c)
	}
	return c
}

// Run publishes while this replica holds the lock, until ctx ends.
func (p *Publisher) Run(ctx context.Context) error {
	s := &postgres.Singleton{Pool: p.Store.Pool(), Key: postgres.LockKey("lease", "demand"), Name: "pool demand publisher", Log: p.Log,
		Retry: max(p.Interval, time.Second)}
	return s.Run(ctx, p.lead)
}

func (p *Publisher) lead(ctx context.Context) error {
	t := time.NewTicker(p.Interval)
	defer t.Stop()
	last := map[string]int64{} // refusal counts at the previous report
	first := true
	for {
		if err := p.PublishOnce(ctx, last, first); err != nil && ctx.Err() == nil {
			p.Log.Warn("publishing pool demand failed; retrying", "error", err)
		} else {
			first = false
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// PublishOnce reads the demand and publishes one report per pool. last
// holds each pool's refusal count at the previous report and is updated;
// on the first report refusals already counted are not reported again.
func (p *Publisher) PublishOnce(ctx context.Context, last map[string]int64, first bool) error {
	all, err := p.Store.Demand(ctx)
	if err != nil {
		return err
	}
	now := timestamppb.New(p.Store.Now())
	for pool, d := range all {
		refused := d.Refused - last[pool]
		if first || refused < 0 {
			refused = 0
		}
		ev := &busv1.PoolDemandEvent{
			Pool: pool,
			Demand: &proxyv1.PoolDemand{
				ActiveLeases: d.ActiveLeases, Capacity: d.Capacity, LeasableProxies: d.Leasable,
				RefusedAcquires: refused, ObserveTime: now,
			},
			LeasesByProxy: d.LeasesByProxy,
		}
		if _, err := bus.Publish(ctx, p.JS, p.Names.DemandSubject(pool), ev); err != nil {
			return err
		}
		last[pool] = d.Refused
		if p.Published != nil {
			p.Published.WithLabelValues(pool).Inc()
		}
	}
	return nil
}
