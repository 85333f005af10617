package dispatch_test

import (
	"context"
	"testing"
	"time"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// A resync that finds the instance as it was changes nothing a client can
// see, so it must not bump the revision, etag or update time, nor add a
// change (a watch entry and a ProxyEvent). An etag read before many
// resyncs still updates the proxy.
func TestResyncWithoutChangeKeepsRevision(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	timing := fastTiming()
	timing.Resync = 20 * time.Millisecond
	h.timing = &timing
	cloud := newCloud()
	fake := h.startProvisioner("fake", cloud.answer)
	h.startReplica()

	p := h.create(managed("p1"))
	r := h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	h.publishHealth(p.GetUid(), r.ProviderID, 1, true)
	before := h.waitFor("p1", "Ready", phase(proxyv1.ProxyPhase_PROXY_PHASE_READY))
	read, err := h.api.GetProxy(context.Background(), &proxyv1.GetProxyRequest{Name: "p1"})
	if err != nil {
		t.Fatal(err)
	}
	polls := fake.count(busv1.Operation_OPERATION_GET, p.GetUid())
	const resyncs = 20
	deadline := time.Now().Add(20 * time.Second)
	for fake.count(busv1.Operation_OPERATION_GET, p.GetUid()) < polls+resyncs {
		if time.Now().After(deadline) {
			t.Fatalf("only %d resyncs within 20s", fake.count(busv1.Operation_OPERATION_GET, p.GetUid())-polls)
		}
		time.Sleep(20 * time.Millisecond) // polling the fake's counter
	}
	// The last resync's result is applied once no command is in flight.
	after := h.waitFor("p1", "resynced", func(r *store.Row) bool { return r.CommandID == "" })

	if after.Revision != before.Revision || !after.UpdateTime.Equal(before.UpdateTime) {
		t.Errorf("after %d resyncs: revision %d, update time %v; want %d, %v",
			resyncs, after.Revision, after.UpdateTime, before.Revision, before.UpdateTime)
	}
	changes, err := h.store.Changes(context.Background(), before.Revision, 1000)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range changes {
		t.Errorf("resync added change r%d: %v", c.Revision, c.Proxy.GetStatus())
	}

	upd, err := h.api.UpdateProxy(context.Background(), &proxyv1.UpdateProxyRequest{
		Name: "p1", Etag: read.GetProxy().GetEtag(), Labels: map[string]string{"pool": "eu"}, Spec: read.GetProxy().GetSpec(),
	})
	if err != nil {
		t.Fatalf("UpdateProxy with the etag read before the resyncs: %v", err)
	}
	if upd.GetProxy().GetEtag() == read.GetProxy().GetEtag() || !upd.GetProxy().GetUpdateTime().AsTime().After(before.UpdateTime) {
		t.Errorf("a real change kept etag %s / update time %v", upd.GetProxy().GetEtag(), upd.GetProxy().GetUpdateTime().AsTime())
	}
}
