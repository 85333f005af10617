package dispatch_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// An instance the provider reports stopped (a Proxmox VM whose guest agent
// was switched off, a shut-off domain) is waited for during the grace
// period, then replaced: deleted and created again, the reason on the
// proxy. One that starts again within the grace period is kept.
func TestStoppedInstanceReplacedAfterGrace(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		restartedAt int // Get answer (counted from the first stopped one) that finds it running again; 0: never
		wantReplace bool
	}{
		{name: "stays stopped", wantReplace: true},
		{name: "started again within the grace period", restartedAt: 3, wantReplace: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			timing := fastTiming()
			timing.StoppedGrace = 2 * time.Second
			h.timing = &timing
			cloud := newCloud()
			var mu sync.Mutex
			stopped := map[string]int{} // uid -> stopped Gets answered; -1 once it runs again
			var stopUID string
			fake := h.startProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
				mu.Lock()
				defer mu.Unlock()
				uid := cmd.GetProxyUid()
				if n, ok := stopped[uid]; ok && n >= 0 {
					switch cmd.GetOperation() {
					case busv1.Operation_OPERATION_GET:
						stopped[uid]++
						if tc.restartedAt > 0 && stopped[uid] >= tc.restartedAt {
							stopped[uid] = -1
							break
						}
						return &busv1.CommandResult{Outcome: &busv1.CommandResult_Get{Get: &provisionerv1.GetInstanceResponse{
							Instance: &provisionerv1.Instance{ProviderId: "vm/" + uid, ProxyUid: uid, State: provisionerv1.InstanceState_INSTANCE_STATE_STOPPED},
						}}}
					case busv1.Operation_OPERATION_DELETE:
						delete(stopped, uid)
					}
				}
				return cloud.answer(cmd)
			})
			h.startReplica()

			p := h.create(managed("p1"))
			h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
			mu.Lock()
			stopped[p.GetUid()], stopUID = 0, p.GetUid()
			mu.Unlock()
			// Resync now, as an update would: the next Get finds it stopped.
			upd := managed("p1")
			if _, err := h.api.UpdateProxy(context.Background(), &proxyv1.UpdateProxyRequest{
				Name: "p1", Generation: 1, Spec: upd.GetSpec(), Labels: map[string]string{"k": "v"},
			}); err != nil {
				t.Fatal(err)
			}
			h.waitFor("p1", "seen stopped", func(r *store.Row) bool { return r.Reason == "InstanceStopped" })

			if !tc.wantReplace {
				r := h.waitFor("p1", "running again", func(r *store.Row) bool {
					return r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING && r.Reason == "Running"
				})
				// Past the grace period, it is still the same instance.
				deadline := time.Now().Add(timing.StoppedGrace + time.Second)
				for time.Now().Before(deadline) {
					time.Sleep(100 * time.Millisecond) // watching that nothing is deleted
				}
				if n := fake.count(busv1.Operation_OPERATION_DELETE, stopUID); n != 0 {
					t.Errorf("an instance that started again within the grace period was deleted (%d deletes)", n)
				}
				cloud.mu.Lock()
				created := cloud.created[stopUID]
				cloud.mu.Unlock()
				if created != 1 || r.ProviderID != "vm/"+stopUID {
					t.Errorf("creates = %d, providerID %q; want the first instance kept", created, r.ProviderID)
				}
				return
			}

			seenStopped := time.Now()
			h.waitFor("p1", "replaced and running", func(r *store.Row) bool {
				return r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING && fake.count(busv1.Operation_OPERATION_DELETE, stopUID) > 0
			})
			if waited := time.Since(seenStopped); waited < timing.StoppedGrace/2 {
				t.Errorf("replaced %v after it was seen stopped; grace is %v", waited, timing.StoppedGrace)
			}
			cloud.mu.Lock()
			created := cloud.created[stopUID]
			cloud.mu.Unlock()
			if created != 2 {
				t.Errorf("creates = %d, want 2 (the original and its replacement)", created)
			}
			// The reason was on the proxy while it was being replaced.
			changes, err := h.store.Changes(context.Background(), 0, 1000)
			if err != nil {
				t.Fatal(err)
			}
			found := false
			for _, c := range changes {
				st := c.Proxy.GetStatus()
				if st.GetReason() == "InstanceStopped" && strings.Contains(st.GetMessage(), "replacing it") {
					found = true
				}
			}
			if !found {
				t.Error("no change carried reason InstanceStopped with the replacement message")
			}
		})
	}
}
