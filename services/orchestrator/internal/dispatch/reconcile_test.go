package dispatch_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

func TestProvisionThenReadyFromHealth(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	_, fake := h.StartCloud("fake")
	h.StartReplica()

	p := h.Create(orchtest.Managed("p1"))
	if p.GetStatus().GetPhase() != proxyv1.ProxyPhase_PROXY_PHASE_PENDING {
		t.Errorf("phase after create = %v, want PENDING", p.GetStatus().GetPhase())
	}
	r := h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	if r.ProviderID != "vm/"+p.GetUid() || r.IP != "10.0.0.1" || r.InstanceSpecHash != r.SpecHash {
		t.Errorf("running row: providerID %q ip %q hash %q/%q", r.ProviderID, r.IP, r.InstanceSpecHash, r.SpecHash)
	}
	if n := fake.Count(busv1.Operation_OPERATION_CREATE, p.GetUid()); n != 1 {
		t.Errorf("creates = %d, want 1", n)
	}

	// A verdict about another instance is ignored; ours makes it Ready.
	h.PublishHealth(p.GetUid(), "vm/someone-else", 1, true)
	h.PublishHealth(p.GetUid(), r.ProviderID, 2, true)
	h.WaitFor("p1", "Ready", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_READY))
	h.PublishHealth(p.GetUid(), r.ProviderID, 3, false)
	r = h.WaitFor("p1", "back to Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	if r.Reason != lifecycle.ReasonUnhealthy || r.Healthy {
		t.Errorf("reason %q healthy %v", r.Reason, r.Healthy)
	}
}

// A replica that starts while NATS is down waits for it: once NATS is back
// its result and health consumers are set up and proxies reach Ready.
func TestReplicaStartedDuringNATSOutage(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	h.StartCloud("fake")
	h.NATS.Stop()
	h.StartReplica()
	for _, consumer := range []string{"provisioner results", "health transitions"} {
		h.WaitLog("WARNING: consuming " + consumer + " failed; retrying")
	}
	h.NATS.Start(t)

	p := h.Create(orchtest.Managed("p1"))
	r := h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	h.PublishHealth(p.GetUid(), r.ProviderID, 1, true)
	h.WaitFor("p1", "Ready", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_READY))
}

// A command JetStream refuses to store (here its stream is missing, as
// while a clustered stream elects a leader) is taken back and issued again
// after a short backoff, not at its deadline (a minute here). While NATS
// is merely disconnected, the client holds publishes until it reconnects.
func TestCommandJetStreamRefusedIsReissuedSoon(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	h.Timing.CreateDeadline = time.Minute
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := h.JS.DeleteStream(ctx, h.Names.CommandStream()); err != nil {
		t.Fatal(err)
	}
	h.StartReplica()
	h.Create(orchtest.Managed("p1"))
	h.WaitLog("commands not stored by JetStream are issued again after a backoff")
	if err := bus.EnsureStreams(ctx, h.JS, h.Names); err != nil {
		t.Fatal(err)
	}
	h.StartCloud("fake")
	h.WaitFor("p1", "Running well before the Create's deadline", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
}

func TestReplaceOnSpecChange(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	cloud, fake := h.StartCloud("fake")
	h.StartReplica()

	p := h.Create(orchtest.Managed("p1"))
	r := h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	oldHash := r.SpecHash

	// A label change does not touch the instance.
	upd := orchtest.Managed("p1")
	_, err := h.API.UpdateProxy(context.Background(), &proxyv1.UpdateProxyRequest{
		Name: "p1", Labels: map[string]string{"tier": "a"}, Spec: upd.GetSpec(), Generation: r.Generation,
	})
	if err != nil {
		t.Fatal(err)
	}
	upd.Spec.Placement.MachineType = "large"
	// Read-modify-write with the etag, retrying when the reconciler changed
	// the proxy in between, as a client would.
	waittest.ForErr(t, orchtest.Wait, "an update with a current etag", func() error {
		cur, err := h.Store.Get(context.Background(), "p1")
		if err != nil {
			t.Fatal(err)
		}
		_, err = h.API.UpdateProxy(context.Background(), &proxyv1.UpdateProxyRequest{
			Name: "p1", Labels: map[string]string{"tier": "a"}, Spec: upd.GetSpec(), Etag: lifecycle.Etag(cur.Revision),
		})
		if status.Code(err) == codes.FailedPrecondition {
			return err // the reconciler changed it meanwhile
		}
		if err != nil {
			t.Fatal(err)
		}
		return nil
	})
	r = h.WaitFor("p1", "Running with the new spec", func(r *lifecycle.Proxy) bool {
		return r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING && r.InstanceSpecHash == r.SpecHash && r.SpecHash != oldHash
	})
	if hash, ok := cloud.Live(p.GetUid()); !ok || hash != r.SpecHash {
		t.Errorf("live instance hash %q, want %q", hash, r.SpecHash)
	}
	if d := fake.Count(busv1.Operation_OPERATION_DELETE, p.GetUid()); d != 1 {
		t.Errorf("deletes = %d, want 1", d)
	}
	if c := fake.Count(busv1.Operation_OPERATION_CREATE, p.GetUid()); c != 2 {
		t.Errorf("creates = %d, want 2", c)
	}
	if r.Generation != 3 || r.ObservedGeneration != 3 {
		t.Errorf("generation %d observed %d, want 3/3", r.Generation, r.ObservedGeneration)
	}
}

func TestDeletionRules(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		// getErr makes the cleanup Get fail with this class.
		getErr      errclass.Class
		skipCleanup bool
		wantDeletes int
		wantGets    int
	}{
		{name: "instance deleted, then polled until gone", wantDeletes: 1, wantGets: 2},
		{name: "skip_cleanup abandons the instance without asking", skipCleanup: true, wantDeletes: 0, wantGets: 0},
		{name: "a permanent Get still deletes and releases", getErr: errclass.Permanent, wantDeletes: 1, wantGets: 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := orchtest.New(t)
			cloud := orchtest.NewCloud()
			var deleting atomic.Bool
			fake := h.StartProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
				if deleting.Load() && tc.getErr != 0 && cmd.GetOperation() == busv1.Operation_OPERATION_GET {
					return orchtest.Failure(tc.getErr, "host retired from the config")
				}
				return cloud.Answer(cmd)
			})
			h.StartReplica()
			p := h.Create(orchtest.Managed("p1"))
			h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
			getsBefore := fake.Count(busv1.Operation_OPERATION_GET, p.GetUid())
			deleting.Store(true)
			if _, err := h.API.DeleteProxy(context.Background(), &proxyv1.DeleteProxyRequest{Name: "p1", SkipCleanup: tc.skipCleanup}); err != nil {
				t.Fatal(err)
			}
			h.WaitGone("p1")
			if d := fake.Count(busv1.Operation_OPERATION_DELETE, p.GetUid()); d != tc.wantDeletes {
				t.Errorf("deletes = %d, want %d", d, tc.wantDeletes)
			}
			if g := fake.Count(busv1.Operation_OPERATION_GET, p.GetUid()) - getsBefore; g != tc.wantGets {
				t.Errorf("gets during deletion = %d, want %d", g, tc.wantGets)
			}
			if _, live := cloud.Live(p.GetUid()); live != tc.skipCleanup {
				t.Errorf("instance live after deletion = %v, want %v", live, tc.skipCleanup)
			}
		})
	}
}

func TestDeletionKeepsProxyWhileCleanupFails(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	cloud := orchtest.NewCloud()
	var failing atomic.Bool
	fake := h.StartProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
		if failing.Load() {
			if cmd.GetOperation() == busv1.Operation_OPERATION_GET {
				return orchtest.Failure(errclass.Permanent, "permission denied")
			}
			if cmd.GetOperation() == busv1.Operation_OPERATION_DELETE {
				return orchtest.Failure(errclass.Permanent, "403 Permission check failed (/storage/iso, Datastore.Allocate)")
			}
		}
		return cloud.Answer(cmd)
	})
	h.StartReplica()
	p := h.Create(orchtest.Managed("p1"))
	h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	failing.Store(true)
	if _, err := h.API.DeleteProxy(context.Background(), &proxyv1.DeleteProxyRequest{Name: "p1"}); err != nil {
		t.Fatal(err)
	}
	r := h.WaitFor("p1", "retrying the failed cleanup", func(r *lifecycle.Proxy) bool {
		return r.Reason == lifecycle.ReasonCleanupFailed && fake.Count(busv1.Operation_OPERATION_DELETE, p.GetUid()) >= 2
	})
	if r.Phase != proxyv1.ProxyPhase_PROXY_PHASE_DELETING || !strings.Contains(r.Message, "Datastore.Allocate") {
		t.Errorf("phase %v message %q", r.Phase, r.Message)
	}
	// skip_cleanup releases it.
	if _, err := h.API.DeleteProxy(context.Background(), &proxyv1.DeleteProxyRequest{Name: "p1", SkipCleanup: true}); err != nil {
		t.Fatal(err)
	}
	h.WaitGone("p1")
}

func TestUnconfiguredProviderBlocksDeletionUntilSkipCleanup(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	h.StartCloud("fake")
	h.StartReplica()
	h.Create(orchtest.Managed("p1"))
	h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	// The provider disappears from the config (a restart with a new file).
	h.Providers.Providers = h.Providers.Providers[1:]
	if _, err := h.API.DeleteProxy(context.Background(), &proxyv1.DeleteProxyRequest{Name: "p1"}); err != nil {
		t.Fatal(err)
	}
	r := h.WaitFor("p1", "stuck on the missing provider", func(r *lifecycle.Proxy) bool { return r.Reason == lifecycle.ReasonProviderNotConfigured })
	if !strings.Contains(r.Message, "skip_cleanup") {
		t.Errorf("message %q does not say how to get out", r.Message)
	}
	if _, err := h.API.DeleteProxy(context.Background(), &proxyv1.DeleteProxyRequest{Name: "p1", SkipCleanup: true}); err != nil {
		t.Fatal(err)
	}
	h.WaitGone("p1")
}

func TestPermanentCreateLatchesUntilSpecChanges(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	cloud := orchtest.NewCloud()
	fake := h.StartProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
		if cmd.GetOperation() == busv1.Operation_OPERATION_CREATE && cmd.GetCreate().GetPlacement().GetImage() == "missing" {
			return orchtest.Failure(errclass.Permanent, `placement.image "missing" is not in proxmox.templates`)
		}
		return cloud.Answer(cmd)
	})
	h.StartReplica()
	req := orchtest.Managed("p1")
	req.Spec.Placement.Image = "missing"
	p := h.Create(req)
	r := h.WaitFor("p1", "Failed", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_FAILED))
	if r.Reason != lifecycle.ReasonProviderError || !strings.Contains(r.Message, "is not in proxmox.templates") || r.NextAttemptTime != nil {
		t.Errorf("failed row: reason %q message %q next %v", r.Reason, r.Message, r.NextAttemptTime)
	}
	// A labels-only update keeps the latch: the update makes the proxy due,
	// and the claim that follows finds it latched and leaves it so.
	if _, err := h.API.UpdateProxy(context.Background(), &proxyv1.UpdateProxyRequest{
		Name: "p1", Spec: req.GetSpec(), Labels: map[string]string{"x": "y"}, Generation: r.Generation,
	}); err != nil {
		t.Fatal(err)
	}
	h.WaitFor("p1", "decided again after the update", func(r *lifecycle.Proxy) bool {
		return r.Generation == 2 && r.CommandID == "" && r.NextAttemptTime == nil
	})
	if n := fake.Count(busv1.Operation_OPERATION_CREATE, p.GetUid()); n != 1 {
		t.Fatalf("creates while latched = %d, want 1", n)
	}
	fixed := orchtest.Managed("p1")
	if _, err := h.API.UpdateProxy(context.Background(), &proxyv1.UpdateProxyRequest{
		Name: "p1", Spec: fixed.GetSpec(), Labels: map[string]string{"x": "y"}, Generation: r.Generation + 1,
	}); err != nil {
		t.Fatal(err)
	}
	h.WaitFor("p1", "Running after the fix", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
}

func TestTransientAndQuotaRetry(t *testing.T) {
	t.Parallel()
	for _, class := range []errclass.Class{errclass.Transient, errclass.QuotaExceeded} {
		t.Run(class.String(), func(t *testing.T) {
			t.Parallel()
			h := orchtest.New(t)
			cloud := orchtest.NewCloud()
			var failures atomic.Int32
			h.StartProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
				if cmd.GetOperation() == busv1.Operation_OPERATION_CREATE && failures.Add(1) <= 3 {
					return orchtest.Failure(class, "try again")
				}
				return cloud.Answer(cmd)
			})
			h.StartReplica()
			p := h.Create(orchtest.Managed("p1"))
			wantReason := map[errclass.Class]lifecycle.Reason{errclass.Transient: lifecycle.ReasonRetrying, errclass.QuotaExceeded: lifecycle.ReasonQuotaExceeded}[class]
			h.WaitFor("p1", "backing off", func(r *lifecycle.Proxy) bool { return r.Reason == wantReason && r.Attempts >= 1 })
			h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
			if cloud.Created(p.GetUid()) != 1 {
				t.Errorf("instances created = %d", cloud.Created(p.GetUid()))
			}
		})
	}
}

func TestInstanceLostIsRecreated(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	cloud, fake := h.StartCloud("fake")
	h.StartReplica()
	p := h.Create(orchtest.Managed("p1"))
	r := h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	// Someone deletes the instance behind our back; the next resync Get
	// (forced here by making the proxy due) finds it gone.
	cloud.Lose(p.GetUid())
	if _, err := h.Store.Pool().Exec(context.Background(),
		"UPDATE orchestrator.proxies SET next_attempt_time = now() WHERE uid = $1", r.UID); err != nil {
		t.Fatal(err)
	}
	h.WaitFor("p1", "recreated", func(r *lifecycle.Proxy) bool {
		return r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING && fake.Count(busv1.Operation_OPERATION_CREATE, p.GetUid()) == 2
	})
}

// A command lost in transit is reissued after its deadline, with a new id;
// the late answer to the old id is ignored.
func TestLostCommandReissuedAndStaleResultIgnored(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	cloud := orchtest.NewCloud()
	var first atomic.Pointer[busv1.Command]
	fake := h.StartProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
		if cmd.GetOperation() == busv1.Operation_OPERATION_CREATE && first.CompareAndSwap(nil, cmd) {
			return nil // lost
		}
		return cloud.Answer(cmd)
	})
	h.StartReplica()
	p := h.Create(orchtest.Managed("p1"))
	h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	creates := fake.Count(busv1.Operation_OPERATION_CREATE, p.GetUid())
	if creates != 2 {
		t.Fatalf("creates = %d, want 2 (the lost one and its reissue)", creates)
	}
	before, _ := h.Store.Get(context.Background(), "p1")
	// The lost command's answer finally arrives: a failure that would latch
	// the proxy if it were applied.
	stale := orchtest.Failure(errclass.Permanent, "stale answer")
	c := first.Load()
	stale.CommandId, stale.ProxyUid, stale.Provider, stale.Operation, stale.SpecHash = c.GetCommandId(), c.GetProxyUid(), "fake", c.GetOperation(), c.GetSpecHash()
	if _, err := bus.Publish(context.Background(), h.JS, h.Names.ResultSubject("fake"), stale); err != nil {
		t.Fatal(err)
	}
	h.WaitResultsDrained()
	after, _ := h.Store.Get(context.Background(), "p1")
	if after.Phase != proxyv1.ProxyPhase_PROXY_PHASE_RUNNING || after.Revision != before.Revision {
		t.Errorf("stale result changed the proxy: phase %v revision %d→%d", after.Phase, before.Revision, after.Revision)
	}
}

// Two replicas on one database dispatch every command once.
func TestTwoReplicasNeverDoubleDispatch(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	_, fake := h.StartCloud("fake")
	h.StartReplica()
	h.StartReplica()
	const n = 60
	var uids []string
	for i := range n {
		uids = append(uids, h.Create(orchtest.Managed(fmt.Sprintf("p%02d", i))).GetUid())
	}
	for i := range n {
		h.WaitFor(fmt.Sprintf("p%02d", i), "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	}
	for _, uid := range uids {
		if c := fake.Count(busv1.Operation_OPERATION_CREATE, uid); c != 1 {
			t.Errorf("proxy %s: %d creates dispatched, want 1", uid, c)
		}
	}
}

// An orchestrator killed with a command in flight: after a new one starts,
// the proxy converges with exactly one instance.
func TestRestartWithCommandInFlight(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	cloud := orchtest.NewCloud()
	release := make(chan struct{})
	var held atomic.Bool
	fake := h.StartProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
		if cmd.GetOperation() == busv1.Operation_OPERATION_CREATE && held.CompareAndSwap(false, true) {
			<-release // the backend is slow while the orchestrator dies
		}
		return cloud.Answer(cmd)
	})
	stop := h.StartReplica()
	p := h.Create(orchtest.Managed("p1"))
	h.WaitFor("p1", "with a command in flight", func(r *lifecycle.Proxy) bool { return r.CommandID != "" })
	stop()
	close(release)
	h.StartReplica()
	h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	if cloud.Created(p.GetUid()) != 1 {
		t.Errorf("instances created = %d, want 1", cloud.Created(p.GetUid()))
	}
	if c := fake.Count(busv1.Operation_OPERATION_CREATE, p.GetUid()); c != 1 {
		t.Errorf("creates = %d, want 1: the result of the in-flight command was applied by the new replica", c)
	}
}
