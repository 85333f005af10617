package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

// A resync that finds the instance as it was changes nothing a client can
// see, so it must not bump the revision, etag or update time, nor add a
// change (a watch entry and a ProxyEvent). An etag read before many
// resyncs still updates the proxy.
func TestResyncWithoutChangeKeepsRevision(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	h.Timing.Resync = 20 * time.Millisecond
	_, fake := h.StartCloud("fake")
	h.StartReplica()

	p := h.Create(orchtest.Managed("p1"))
	r := h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	h.PublishHealth(p.GetUid(), r.ProviderID, 1, true)
	before := h.WaitFor("p1", "Ready", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_READY))
	read, err := h.API.GetProxy(context.Background(), &proxyv1.GetProxyRequest{Name: "p1"})
	if err != nil {
		t.Fatal(err)
	}
	polls := fake.Count(busv1.Operation_OPERATION_GET, p.GetUid())
	const resyncs = 20
	waittest.For(t, orchtest.Wait, fmt.Sprint(resyncs, " resyncs"), func() bool {
		return fake.Count(busv1.Operation_OPERATION_GET, p.GetUid()) >= polls+resyncs
	})
	// The last resync's result is applied once no command is in flight.
	after := h.WaitFor("p1", "resynced", func(r *lifecycle.Proxy) bool { return r.CommandID == "" })

	if after.Revision != before.Revision || !after.UpdateTime.Equal(before.UpdateTime) {
		t.Errorf("after %d resyncs: revision %d, update time %v; want %d, %v",
			resyncs, after.Revision, after.UpdateTime, before.Revision, before.UpdateTime)
	}
	changes, err := h.Store.Changes(context.Background(), before.Revision, 1000)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range changes {
		t.Errorf("resync added change r%d: %v", c.Revision, c.Proxy.GetStatus())
	}

	upd, err := h.API.UpdateProxy(context.Background(), &proxyv1.UpdateProxyRequest{
		Name: "p1", Etag: read.GetProxy().GetEtag(), Labels: map[string]string{"pool": "eu"}, Spec: read.GetProxy().GetSpec(),
	})
	if err != nil {
		t.Fatalf("UpdateProxy with the etag read before the resyncs: %v", err)
	}
	if upd.GetProxy().GetEtag() == read.GetProxy().GetEtag() || !upd.GetProxy().GetUpdateTime().AsTime().After(before.UpdateTime) {
		t.Errorf("a real change kept etag %s / update time %v", upd.GetProxy().GetEtag(), upd.GetProxy().GetUpdateTime().AsTime())
	}

	// The API's revision of a proxy is that of its last change: kept by
	// the resyncs, then each change's, which its Watch entry and
	// ProxyEvent carry too.
	if read.GetProxy().GetRevision() != before.Revision {
		t.Errorf("read before the resyncs: revision %d, want %d", read.GetProxy().GetRevision(), before.Revision)
	}
	settled := h.WaitFor("p1", "the update observed", func(r *lifecycle.Proxy) bool {
		return r.ObservedGeneration == r.Generation && r.CommandID == ""
	})
	changes, err = h.Store.Changes(context.Background(), before.Revision, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if len(changes) == 0 || changes[0].Revision != upd.GetProxy().GetRevision() {
		t.Fatalf("changes after the update: %v; want the first at UpdateProxy's revision %d", changes, upd.GetProxy().GetRevision())
	}
	for _, c := range changes {
		if c.Proxy.GetRevision() != c.Revision {
			t.Errorf("change r%d carries revision %d", c.Revision, c.Proxy.GetRevision())
		}
	}
	list, err := h.API.ListProxies(context.Background(), &proxyv1.ListProxiesRequest{})
	if err != nil || len(list.GetProxies()) != 1 {
		t.Fatalf("ListProxies: %v, %v", list, err)
	}
	if got := list.GetProxies()[0].GetRevision(); got != settled.Revision || got != changes[len(changes)-1].Revision {
		t.Errorf("listed revision %d; want the last change's, %d (store row %d)", got, changes[len(changes)-1].Revision, settled.Revision)
	}
}
