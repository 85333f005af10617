package app

import (
	"context"
	"log/slog"
	"testing"
	"time"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/fleet"
	"github.com/egress-proxies/egress-proxies/services/health/internal/probe"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store/storetest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/transitions"
)

func listed(t *testing.T, st *store.Store) map[string]*healthv1.ProxyHealth {
	t.Helper()
	list, err := st.ListProxies(context.Background(), "", "", 1000)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*healthv1.ProxyHealth{}
	for _, h := range list {
		out[h.GetProxyName()] = h
	}
	return out
}

// A proxy first seen Pending (so its stored health is to go) that turns
// Running and reaches its verdict before the next flush keeps the state
// stored with that verdict: the listing shows every proxy with a verdict.
// Before deletions carried the revision of the snapshot that asked for
// them, the flush removed the row and the proxy was missing from
// ListProxyHealth until its next state was written, a flush later.
func TestFlush_aProxyProbedAgainKeepsItsVerdict(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.DiscardHandler)
	_, st := storetest.New(t)

	now := time.Date(2026, 12, 4, 4, 0, 0, 0, time.UTC)
	var trs []engine.Transition
	eng := engine.New(engine.Config{
		Probe:        func(context.Context, engine.Spec) probe.Result { return probe.Result{} },
		OnTransition: func(tr engine.Transition) { trs = append(trs, tr) },
		Now:          func() time.Time { return now },
		Jitter:       func(time.Duration) time.Duration { return 0 },
	})
	var gone goneList
	fl := &fleet.Fleet{Engine: eng, Defaults: engine.DefaultDefaults, Gone: gone.add, Log: log}
	rec := &transitions.Recorder{Store: st, Prober: "replica-a", State: eng.Get, Log: log}
	done := make(chan error, 1)
	go func() { done <- rec.Run(ctx) }()
	defer func() { cancel(); <-done }()

	p := &proxyv1.Proxy{Uid: "u1", Name: "crawler-1", Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED},
		Status: &proxyv1.ProxyStatus{Phase: proxyv1.ProxyPhase_PROXY_PHASE_PENDING}}
	fl.Apply(&busv1.ProxyEvent{Revision: 1, Type: proxyv1.ChangeType_CHANGE_TYPE_CREATED, Proxy: p})
	p.Status = &proxyv1.ProxyStatus{Phase: proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, Ip: "10.0.0.1", ProviderId: "vm-1"}
	fl.Apply(&busv1.ProxyEvent{Revision: 2, Type: proxyv1.ChangeType_CHANGE_TYPE_UPDATED, Proxy: p})

	// Two passing probes: the first verdict, healthy, stored with the
	// state by the recorder as in the service.
	pass := probe.Result{OK: true, Reason: probe.ReasonSucceeded, Message: "200 OK", Latency: time.Millisecond}
	for range engine.DefaultDefaults.SuccessThreshold {
		for _, j := range eng.Due(now) {
			eng.Complete(j, pass)
		}
		now = now.Add(engine.DefaultDefaults.Interval)
	}
	if len(trs) != 1 || !trs[0].Healthy {
		t.Fatalf("transitions %+v, want one first verdict, healthy", trs)
	}
	rec.Add(trs[0])
	waittest.For(t, 10*time.Second, "the verdict stored", func() bool { return listed(t, st)["crawler-1"] != nil })

	flushOnce(ctx, st, eng, &gone, "replica-a", log)
	h := listed(t, st)["crawler-1"]
	if h == nil || !h.GetVerdictKnown() || !h.GetHealthy() {
		t.Fatalf("after the flush ListProxies has %v, want crawler-1 healthy", h)
	}

	// Deleted: its health goes at the next flush.
	fl.Apply(&busv1.ProxyEvent{Revision: 3, Type: proxyv1.ChangeType_CHANGE_TYPE_DELETED, Proxy: p})
	flushOnce(ctx, st, eng, &gone, "replica-a", log)
	if h := listed(t, st)["crawler-1"]; h != nil {
		t.Fatalf("after deletion ListProxies still has %v", h)
	}
}
