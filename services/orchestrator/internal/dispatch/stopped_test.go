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
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
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
			h := orchtest.New(t)
			h.Timing.StoppedGrace = 2 * time.Second
			timing := h.Timing
			cloud := orchtest.NewCloud()
			var mu sync.Mutex
			stopped := map[string]int{} // uid -> stopped Gets answered; -1 once it runs again
			var stopUID string
			fake := h.StartProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
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
				return cloud.Answer(cmd)
			})
			h.StartReplica()

			p := h.Create(orchtest.Managed("p1"))
			h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
			mu.Lock()
			stopped[p.GetUid()], stopUID = 0, p.GetUid()
			mu.Unlock()
			// Resync now, as an update would: the next Get finds it stopped.
			upd := orchtest.Managed("p1")
			if _, err := h.API.UpdateProxy(context.Background(), &proxyv1.UpdateProxyRequest{
				Name: "p1", Generation: 1, Spec: upd.GetSpec(), Labels: map[string]string{"k": "v"},
			}); err != nil {
				t.Fatal(err)
			}
			h.WaitFor("p1", "seen stopped", func(r *lifecycle.Proxy) bool { return r.Reason == lifecycle.ReasonInstanceStopped })

			if !tc.wantReplace {
				r := h.WaitFor("p1", "running again", func(r *lifecycle.Proxy) bool {
					return r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING && r.Reason == lifecycle.ReasonRunning
				})
				// Running again, the stop is forgotten: no replacement is
				// scheduled (the next look is the hour-long resync), and the
				// first instance is kept.
				if r.StoppedSince != nil || r.NextAttemptTime == nil || time.Until(*r.NextAttemptTime) < 30*time.Minute {
					t.Errorf("stopped since %v, next look at %v; want the stop forgotten and the next look at the resync", r.StoppedSince, r.NextAttemptTime)
				}
				if n := fake.Count(busv1.Operation_OPERATION_DELETE, stopUID); n != 0 {
					t.Errorf("an instance that started again within the grace period was deleted (%d deletes)", n)
				}
				if created := cloud.Created(stopUID); created != 1 || r.ProviderID != "vm/"+stopUID {
					t.Errorf("creates = %d, providerID %q; want the first instance kept", created, r.ProviderID)
				}
				return
			}

			seenStopped := time.Now()
			h.WaitFor("p1", "replaced and running", func(r *lifecycle.Proxy) bool {
				return r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING && fake.Count(busv1.Operation_OPERATION_DELETE, stopUID) > 0
			})
			if waited := time.Since(seenStopped); waited < timing.StoppedGrace/2 {
				t.Errorf("replaced %v after it was seen stopped; grace is %v", waited, timing.StoppedGrace)
			}
			if created := cloud.Created(stopUID); created != 2 {
				t.Errorf("creates = %d, want 2 (the original and its replacement)", created)
			}
			// The reason was on the proxy while it was being replaced.
			changes, err := h.Store.Changes(context.Background(), 0, 1000)
			if err != nil {
				t.Fatal(err)
			}
			found := false
			for _, c := range changes {
				st := c.Proxy.GetStatus()
				if st.GetReason() == string(lifecycle.ReasonInstanceStopped) && strings.Contains(st.GetMessage(), "replacing it") {
					found = true
				}
			}
			if !found {
				t.Error("no change carried reason InstanceStopped with the replacement message")
			}
		})
	}
}
