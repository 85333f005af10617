// Package gc is orphan garbage collection: every interval one orchestrator
// replica (the holder of an advisory lock) asks each provider to list its
// managed instances, and whichever replica receives a list deletes the
// instances that belong to no proxy and are older than the grace age.
//
// An instance is an orphan only when its mark names a proxy UID that the
// store does not know and its mark's creation time is older than the grace
// age, and its mark names this installation (Installation). Instances of
// live, deleting or just-created proxies are known; unmarked instances,
// another installation's, those whose mark names no installation (marked
// before marks did: their own proxy's Get or Create claims them),
// instances without a creation time, and the instances of a provider whose
// list failed are never touched.
package gc

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// lockKey is the advisory lock of the sweep singleton.
var lockKey = postgres.LockKey("orchestrator", "orphan-gc")

// Collector runs sweeps and handles their lists.
type Collector struct {
	Store *store.Store
	JS    jetstream.JetStream
	Names bus.Names
	// Installation is this installation's identity: lists and deletes
	// name it, and only its instances are collected.
	Installation string
	Providers    func() []string
	Interval     time.Duration
	Grace        time.Duration
	// Deadline of the list and delete commands.
	Deadline time.Duration
	Log      *slog.Logger
	Metrics  *Metrics
	Now      func() time.Time

	sparedMu sync.Mutex
	spared   map[string]bool // legacy instances already logged
}

func (c *Collector) now() time.Time {
	if c.Now != nil {
		return c.Now()
	}
	return time.Now()
}

// Run triggers a sweep every Interval while this replica holds the lock
// (a postgres.Singleton). Interval 0 turns GC off.
func (c *Collector) Run(ctx context.Context) error {
	if c.Interval <= 0 {
		c.Log.Info("orphan GC is off")
		return nil
	}
	s := &postgres.Singleton{Pool: c.Store.Pool(), Key: lockKey, Name: "orphan GC", Log: c.Log, Retry: c.Interval / 4}
	return s.Run(ctx, c.lead)
}

// lead sweeps at once and every Interval until ctx ends (leadership lost
// or shutdown).
func (c *Collector) lead(ctx context.Context) error {
	t := time.NewTicker(c.Interval)
	defer t.Stop()
	for {
		if err := c.Sweep(ctx); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

var tracer = otel.Tracer("github.com/egress-proxies/egress-proxies/services/orchestrator/gc")

// Sweep asks every provider for its managed instances, in a gc.sweep span
// that the list commands carry to the provisioners.
func (c *Collector) Sweep(ctx context.Context) (err error) {
	ctx, span := tracer.Start(ctx, "gc.sweep", trace.WithSpanKind(trace.SpanKindProducer))
	defer func() {
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, "publishing a list command failed")
		}
		span.End()
	}()
	now := c.now()
	for _, provider := range c.Providers() {
		cmd := &busv1.Command{
			CommandId: uuid.NewString(),
			Provider:  provider,
			Purpose:   busv1.CommandPurpose_COMMAND_PURPOSE_ORPHAN_GC,
			Operation: busv1.Operation_OPERATION_LIST,
			IssueTime: timestamppb.New(now),
			Deadline:  timestamppb.New(now.Add(c.Deadline)),
			Attempt:   1,
			Request:   &busv1.Command_List{List: &provisionerv1.ListInstancesRequest{Provider: provider, Installation: c.Installation}},
		}
		if _, err := bus.Publish(ctx, c.JS, c.Names.CommandSubject(provider), cmd, jetstream.WithMsgID(cmd.GetCommandId())); err != nil {
			return err
		}
		c.Metrics.Sweeps.WithLabelValues(provider).Inc()
	}
	return nil
}

// HandleResult takes the result of one of GC's commands (purpose
// COMMAND_PURPOSE_ORPHAN_GC), which the results loop routes here: a list
// (handleList) or an orphan delete (handleDelete).
func (c *Collector) HandleResult(ctx context.Context, res *busv1.CommandResult) {
	if res.GetOperation() == busv1.Operation_OPERATION_LIST {
		c.handleList(ctx, res)
		return
	}
	c.handleDelete(res)
}

// handleList deletes the orphans among a provider's listed instances. A
// failed list skips that provider for this sweep. ctx carries the list's
// trace (the sweep's), which the deletes continue.
func (c *Collector) handleList(ctx context.Context, res *busv1.CommandResult) {
	provider := res.GetProvider()
	ctx, span := tracer.Start(ctx, "gc.handle_list", trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(attribute.String("provider", provider)))
	defer span.End()
	if e := res.GetError(); e != nil {
		c.Log.Warn("a provider's instance list failed; skipping it this sweep",
			"provider", provider, "error", errclass.FromCommandError(e).Error())
		c.Metrics.ListFailures.WithLabelValues(provider).Inc()
		return
	}
	now := c.now()
	candidates := map[string]*provisionerv1.Instance{}
	// legacy are instances whose mark names no installation: taken when
	// their proxy is ours (its Get or Create claims them), left alone
	// otherwise, since they may be another installation's.
	legacy := map[string]*provisionerv1.Instance{}
	var uids []string
	for _, inst := range res.GetList().GetInstances() {
		uid := inst.GetProxyUid()
		if _, err := uuid.Parse(uid); err != nil {
			continue // unmarked, or not a UID of ours
		}
		if in := inst.GetInstallation(); in != c.Installation {
			if in == "" {
				legacy[uid] = inst
				uids = append(uids, uid)
			}
			continue // another installation's
		}
		if inst.GetCreateTime() == nil || now.Sub(inst.GetCreateTime().AsTime()) < c.Grace {
			continue // young (or of unknown age): its proxy may be on its way
		}
		candidates[uid] = inst
		uids = append(uids, uid)
	}
	if len(uids) == 0 {
		return
	}
	var known map[string]bool
	err := c.Store.Write(ctx, func(tx *store.Tx) error {
		var err error
		known, err = tx.Known(ctx, uids)
		return err
	})
	if err != nil {
		c.Log.Warn("orphan GC could not read the store; skipping this list", "provider", provider, "error", err)
		return
	}
	for uid, inst := range legacy {
		if !known[uid] {
			c.spareLegacy(provider, inst)
		}
	}
	for uid, inst := range candidates {
		if known[uid] {
			continue
		}
		cmd := &busv1.Command{
			CommandId: uuid.NewString(),
			ProxyUid:  uid,
			Provider:  provider,
			Purpose:   busv1.CommandPurpose_COMMAND_PURPOSE_ORPHAN_GC,
			Operation: busv1.Operation_OPERATION_DELETE,
			IssueTime: timestamppb.New(now),
			Deadline:  timestamppb.New(now.Add(c.Deadline)),
			Attempt:   1,
			Request: &busv1.Command_Delete{Delete: &provisionerv1.DeleteInstanceRequest{
				Provider: provider, ProviderId: inst.GetProviderId(), ProxyUid: uid, Installation: c.Installation,
			}},
		}
		c.Log.Info("deleting an orphaned instance", "provider", provider, "provider_id", inst.GetProviderId(),
			"proxy_uid", uid, "created", inst.GetCreateTime().AsTime())
		if _, err := bus.Publish(ctx, c.JS, c.Names.CommandSubject(provider), cmd, jetstream.WithMsgID(cmd.GetCommandId())); err != nil {
			c.Log.Warn("publishing an orphan delete failed; the next sweep retries", "provider", provider, "error", err)
		}
	}
}

// spareLegacy logs, once per instance and process, that an instance
// whose mark names no installation and whose proxy this installation does
// not know is left alone.
func (c *Collector) spareLegacy(provider string, inst *provisionerv1.Instance) {
	c.sparedMu.Lock()
	defer c.sparedMu.Unlock()
	key := provider + "/" + inst.GetProviderId()
	if c.spared[key] {
		return
	}
	if c.spared == nil {
		c.spared = map[string]bool{}
	}
	c.spared[key] = true
	c.Log.Info("leaving alone an instance whose mark names no installation and whose proxy is not this installation's; delete it by hand if it is an orphan",
		"provider", provider, "provider_id", inst.GetProviderId(), "proxy_uid", inst.GetProxyUid(), "installation", c.Installation)
}

// handleDelete counts the outcome of an orphan delete.
func (c *Collector) handleDelete(res *busv1.CommandResult) {
	if e := res.GetError(); e != nil {
		c.Log.Warn("deleting an orphaned instance failed; the next sweep retries",
			"provider", res.GetProvider(), "proxy_uid", res.GetProxyUid(), "error", errclass.FromCommandError(e).Error())
		c.Metrics.OrphanFailures.WithLabelValues(res.GetProvider()).Inc()
		return
	}
	c.Metrics.OrphansDeleted.WithLabelValues(res.GetProvider()).Inc()
}

// Metrics are GC's series.
type Metrics struct {
	Sweeps         *prometheus.CounterVec
	ListFailures   *prometheus.CounterVec
	OrphansDeleted *prometheus.CounterVec
	OrphanFailures *prometheus.CounterVec
}

// NewMetrics registers them on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Sweeps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_orchestrator_gc_sweeps_total", Help: "Instance lists requested by orphan GC, by provider.",
		}, []string{"provider"}),
		ListFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_orchestrator_gc_list_failures_total", Help: "Provider lists that failed, skipping the provider for that sweep.",
		}, []string{"provider"}),
		OrphansDeleted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_orchestrator_orphans_deleted_total", Help: "Orphaned instances deleted, by provider.",
		}, []string{"provider"}),
		OrphanFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "egress_orchestrator_orphan_delete_failures_total", Help: "Orphan deletes that failed, by provider.",
		}, []string{"provider"}),
	}
	reg.MustRegister(m.Sweeps, m.ListFailures, m.OrphansDeleted, m.OrphanFailures)
	return m
}
