package dispatch_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

func TestProvisionThenReadyFromHealth(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cloud := newCloud()
	fake := h.startProvisioner("fake", cloud.answer)
	h.startReplica()

	p := h.create(managed("p1"))
	if p.GetStatus().GetPhase() != proxyv1.ProxyPhase_PROXY_PHASE_PENDING {
		t.Errorf("phase after create = %v, want PENDING", p.GetStatus().GetPhase())
	}
	r := h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	if r.ProviderID != "vm/"+p.GetUid() || r.IP != "10.0.0.1" || r.InstanceSpecHash != r.SpecHash {
		t.Errorf("running row: providerID %q ip %q hash %q/%q", r.ProviderID, r.IP, r.InstanceSpecHash, r.SpecHash)
	}
	if n := fake.count(busv1.Operation_OPERATION_CREATE, p.GetUid()); n != 1 {
		t.Errorf("creates = %d, want 1", n)
	}

	// A verdict about another instance is ignored; ours makes it Ready.
	h.publishHealth(p.GetUid(), "vm/someone-else", 1, true)
	h.publishHealth(p.GetUid(), r.ProviderID, 2, true)
	h.waitFor("p1", "Ready", phase(proxyv1.ProxyPhase_PROXY_PHASE_READY))
	h.publishHealth(p.GetUid(), r.ProviderID, 3, false)
	r = h.waitFor("p1", "back to Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	if r.Reason != "Unhealthy" || r.Healthy {
		t.Errorf("reason %q healthy %v", r.Reason, r.Healthy)
	}
}

// A replica that starts while NATS is down waits for it: once NATS is back
// its result and health consumers are set up and proxies reach Ready.
func TestReplicaStartedDuringNATSOutage(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cloud := newCloud()
	h.startProvisioner("fake", cloud.answer)
	h.nats.Stop()
	h.startReplica()
	for _, consumer := range []string{"provisioner results", "health transitions"} {
		want := "WARNING: consuming " + consumer + " failed; retrying"
		deadline := time.Now().Add(30 * time.Second)
		for !strings.Contains(h.logs.String(), want) {
			if time.Now().After(deadline) {
				t.Fatalf("no %q logged while NATS was down; log:\n%s", want, h.logs.String())
			}
			time.Sleep(20 * time.Millisecond) // polling the log
		}
	}
	h.nats.Start(t)

	p := h.create(managed("p1"))
	r := h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	h.publishHealth(p.GetUid(), r.ProviderID, 1, true)
	h.waitFor("p1", "Ready", phase(proxyv1.ProxyPhase_PROXY_PHASE_READY))
}

// A command JetStream refuses to store (here its stream is missing, as
// while a clustered stream elects a leader) is taken back and issued again
// after a short backoff, not at its deadline (a minute here). While NATS
// is merely disconnected, the client holds publishes until it reconnects.
func TestCommandJetStreamRefusedIsReissuedSoon(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	timing := fastTiming()
	timing.CreateDeadline = time.Minute
	h.timing = &timing
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := h.js.DeleteStream(ctx, h.names.CommandStream()); err != nil {
		t.Fatal(err)
	}
	h.startReplica()
	h.create(managed("p1"))
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(h.logs.String(), "commands not stored by JetStream are issued again after a backoff") {
		if time.Now().After(deadline) {
			t.Fatalf("the refused Create was not taken back; log:\n%s", h.logs.String())
		}
		time.Sleep(20 * time.Millisecond) // polling the log
	}
	if err := bus.EnsureStreams(ctx, h.js, h.names); err != nil {
		t.Fatal(err)
	}
	cloud := newCloud()
	h.startProvisioner("fake", cloud.answer)
	h.waitFor("p1", "Running well before the Create's deadline", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
}

func TestReplaceOnSpecChange(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cloud := newCloud()
	fake := h.startProvisioner("fake", cloud.answer)
	h.startReplica()

	p := h.create(managed("p1"))
	r := h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	oldHash := r.SpecHash

	// A label change does not touch the instance.
	upd := managed("p1")
	_, err := h.api.UpdateProxy(context.Background(), &proxyv1.UpdateProxyRequest{
		Name: "p1", Labels: map[string]string{"tier": "a"}, Spec: upd.GetSpec(), Generation: r.Generation,
	})
	if err != nil {
		t.Fatal(err)
	}
	upd.Spec.Placement.MachineType = "large"
	// Read-modify-write with the etag, retrying when the reconciler changed
	// the proxy in between, as a client would.
	for {
		cur, _ := h.store.Get(context.Background(), "p1")
		_, err = h.api.UpdateProxy(context.Background(), &proxyv1.UpdateProxyRequest{
			Name: "p1", Labels: map[string]string{"tier": "a"}, Spec: upd.GetSpec(), Etag: store.Etag(cur.Revision),
		})
		if status.Code(err) == codes.FailedPrecondition {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		break
	}
	r = h.waitFor("p1", "Running with the new spec", func(r *store.Row) bool {
		return r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING && r.InstanceSpecHash == r.SpecHash && r.SpecHash != oldHash
	})
	if hash, ok := cloud.live(p.GetUid()); !ok || hash != r.SpecHash {
		t.Errorf("live instance hash %q, want %q", hash, r.SpecHash)
	}
	if d := fake.count(busv1.Operation_OPERATION_DELETE, p.GetUid()); d != 1 {
		t.Errorf("deletes = %d, want 1", d)
	}
	if c := fake.count(busv1.Operation_OPERATION_CREATE, p.GetUid()); c != 2 {
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
			h := newHarness(t)
			cloud := newCloud()
			var deleting atomic.Bool
			fake := h.startProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
				if deleting.Load() && tc.getErr != 0 && cmd.GetOperation() == busv1.Operation_OPERATION_GET {
					return failure(tc.getErr, "host retired from the config")
				}
				return cloud.answer(cmd)
			})
			h.startReplica()
			p := h.create(managed("p1"))
			h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
			getsBefore := fake.count(busv1.Operation_OPERATION_GET, p.GetUid())
			deleting.Store(true)
			if _, err := h.api.DeleteProxy(context.Background(), &proxyv1.DeleteProxyRequest{Name: "p1", SkipCleanup: tc.skipCleanup}); err != nil {
				t.Fatal(err)
			}
			h.waitGone("p1")
			if d := fake.count(busv1.Operation_OPERATION_DELETE, p.GetUid()); d != tc.wantDeletes {
				t.Errorf("deletes = %d, want %d", d, tc.wantDeletes)
			}
			if g := fake.count(busv1.Operation_OPERATION_GET, p.GetUid()) - getsBefore; g != tc.wantGets {
				t.Errorf("gets during deletion = %d, want %d", g, tc.wantGets)
			}
			if _, live := cloud.live(p.GetUid()); live != tc.skipCleanup {
				t.Errorf("instance live after deletion = %v, want %v", live, tc.skipCleanup)
			}
		})
	}
}

func TestDeletionKeepsProxyWhileCleanupFails(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cloud := newCloud()
	var failing atomic.Bool
	fake := h.startProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
		if failing.Load() {
			if cmd.GetOperation() == busv1.Operation_OPERATION_GET {
				return failure(errclass.Permanent, "permission denied")
			}
			if cmd.GetOperation() == busv1.Operation_OPERATION_DELETE {
				return failure(errclass.Permanent, "403 Permission check failed (/storage/iso, Datastore.Allocate)")
			}
		}
		return cloud.answer(cmd)
	})
	h.startReplica()
	p := h.create(managed("p1"))
	h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	failing.Store(true)
	if _, err := h.api.DeleteProxy(context.Background(), &proxyv1.DeleteProxyRequest{Name: "p1"}); err != nil {
		t.Fatal(err)
	}
	r := h.waitFor("p1", "retrying the failed cleanup", func(r *store.Row) bool {
		return r.Reason == "CleanupFailed" && fake.count(busv1.Operation_OPERATION_DELETE, p.GetUid()) >= 2
	})
	if r.Phase != proxyv1.ProxyPhase_PROXY_PHASE_DELETING || !strings.Contains(r.Message, "Datastore.Allocate") {
		t.Errorf("phase %v message %q", r.Phase, r.Message)
	}
	// skip_cleanup releases it.
	if _, err := h.api.DeleteProxy(context.Background(), &proxyv1.DeleteProxyRequest{Name: "p1", SkipCleanup: true}); err != nil {
		t.Fatal(err)
	}
	h.waitGone("p1")
}

func TestUnconfiguredProviderBlocksDeletionUntilSkipCleanup(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cloud := newCloud()
	h.startProvisioner("fake", cloud.answer)
	h.startReplica()
	h.create(managed("p1"))
	h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	// The provider disappears from the config (a restart with a new file).
	h.provs.Providers = h.provs.Providers[1:]
	if _, err := h.api.DeleteProxy(context.Background(), &proxyv1.DeleteProxyRequest{Name: "p1"}); err != nil {
		t.Fatal(err)
	}
	r := h.waitFor("p1", "stuck on the missing provider", func(r *store.Row) bool { return r.Reason == "ProviderNotConfigured" })
	if !strings.Contains(r.Message, "skip_cleanup") {
		t.Errorf("message %q does not say how to get out", r.Message)
	}
	if _, err := h.api.DeleteProxy(context.Background(), &proxyv1.DeleteProxyRequest{Name: "p1", SkipCleanup: true}); err != nil {
		t.Fatal(err)
	}
	h.waitGone("p1")
}

func TestPermanentCreateLatchesUntilSpecChanges(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cloud := newCloud()
	fake := h.startProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
		if cmd.GetOperation() == busv1.Operation_OPERATION_CREATE && cmd.GetCreate().GetPlacement().GetImage() == "missing" {
			return failure(errclass.Permanent, `placement.image "missing" is not in proxmox.templates`)
		}
		return cloud.answer(cmd)
	})
	h.startReplica()
	req := managed("p1")
	req.Spec.Placement.Image = "missing"
	p := h.create(req)
	r := h.waitFor("p1", "Failed", phase(proxyv1.ProxyPhase_PROXY_PHASE_FAILED))
	if r.Reason != "ProviderError" || !strings.Contains(r.Message, "is not in proxmox.templates") || r.NextAttemptTime != nil {
		t.Errorf("failed row: reason %q message %q next %v", r.Reason, r.Message, r.NextAttemptTime)
	}
	// A labels-only update keeps the latch.
	if _, err := h.api.UpdateProxy(context.Background(), &proxyv1.UpdateProxyRequest{
		Name: "p1", Spec: req.GetSpec(), Labels: map[string]string{"x": "y"}, Generation: r.Generation,
	}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // give a wrongly unlatched proxy time to retry
	if n := fake.count(busv1.Operation_OPERATION_CREATE, p.GetUid()); n != 1 {
		t.Fatalf("creates while latched = %d, want 1", n)
	}
	fixed := managed("p1")
	if _, err := h.api.UpdateProxy(context.Background(), &proxyv1.UpdateProxyRequest{
		Name: "p1", Spec: fixed.GetSpec(), Labels: map[string]string{"x": "y"}, Generation: r.Generation + 1,
	}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("p1", "Running after the fix", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
}

func TestTransientAndQuotaRetry(t *testing.T) {
	t.Parallel()
	for _, class := range []errclass.Class{errclass.Transient, errclass.QuotaExceeded} {
		t.Run(class.String(), func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			cloud := newCloud()
			var failures atomic.Int32
			h.startProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
				if cmd.GetOperation() == busv1.Operation_OPERATION_CREATE && failures.Add(1) <= 3 {
					return failure(class, "try again")
				}
				return cloud.answer(cmd)
			})
			h.startReplica()
			p := h.create(managed("p1"))
			wantReason := map[errclass.Class]string{errclass.Transient: "Retrying", errclass.QuotaExceeded: "QuotaExceeded"}[class]
			h.waitFor("p1", "backing off", func(r *store.Row) bool { return r.Reason == wantReason && r.Attempts >= 1 })
			h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
			if cloud.created[p.GetUid()] != 1 {
				t.Errorf("instances created = %d", cloud.created[p.GetUid()])
			}
		})
	}
}

func TestInstanceLostIsRecreated(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cloud := newCloud()
	fake := h.startProvisioner("fake", cloud.answer)
	h.startReplica()
	p := h.create(managed("p1"))
	r := h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	// Someone deletes the instance behind our back; the next resync Get
	// (forced here by making the proxy due) finds it gone.
	cloud.mu.Lock()
	delete(cloud.instances, p.GetUid())
	cloud.mu.Unlock()
	if _, err := h.store.Pool().Exec(context.Background(),
		"UPDATE orchestrator.proxies SET next_attempt_time = now() WHERE uid = $1", r.UID); err != nil {
		t.Fatal(err)
	}
	h.waitFor("p1", "recreated", func(r *store.Row) bool {
		return r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING && fake.count(busv1.Operation_OPERATION_CREATE, p.GetUid()) == 2
	})
}

// A command lost in transit is reissued after its deadline, with a new id;
// the late answer to the old id is ignored.
func TestLostCommandReissuedAndStaleResultIgnored(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cloud := newCloud()
	var first atomic.Pointer[busv1.Command]
	fake := h.startProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
		if cmd.GetOperation() == busv1.Operation_OPERATION_CREATE && first.CompareAndSwap(nil, cmd) {
			return nil // lost
		}
		return cloud.answer(cmd)
	})
	h.startReplica()
	p := h.create(managed("p1"))
	h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	creates := fake.count(busv1.Operation_OPERATION_CREATE, p.GetUid())
	if creates != 2 {
		t.Fatalf("creates = %d, want 2 (the lost one and its reissue)", creates)
	}
	before, _ := h.store.Get(context.Background(), "p1")
	// The lost command's answer finally arrives: a failure that would latch
	// the proxy if it were applied.
	stale := failure(errclass.Permanent, "stale answer")
	c := first.Load()
	stale.CommandId, stale.ProxyUid, stale.Provider, stale.Operation, stale.SpecHash = c.GetCommandId(), c.GetProxyUid(), "fake", c.GetOperation(), c.GetSpecHash()
	if _, err := bus.Publish(context.Background(), h.js, h.names.ResultSubject("fake"), stale); err != nil {
		t.Fatal(err)
	}
	waitConsumerDrained(t, h)
	after, _ := h.store.Get(context.Background(), "p1")
	if after.Phase != proxyv1.ProxyPhase_PROXY_PHASE_RUNNING || after.Revision != before.Revision {
		t.Errorf("stale result changed the proxy: phase %v revision %d→%d", after.Phase, before.Revision, after.Revision)
	}
}

func waitConsumerDrained(t *testing.T, h *harness) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		info, err := h.js.Consumer(context.Background(), h.names.ResultStream(), h.names.OrchestratorConsumer())
		if err == nil {
			ci, err := info.Info(context.Background())
			if err == nil && ci.NumPending == 0 && ci.NumAckPending == 0 {
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("results consumer not drained in 10s")
}

// Two replicas on one database dispatch every command once.
func TestTwoReplicasNeverDoubleDispatch(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cloud := newCloud()
	fake := h.startProvisioner("fake", cloud.answer)
	h.startReplica()
	h.startReplica()
	const n = 60
	var uids []string
	for i := range n {
		uids = append(uids, h.create(managed(fmt.Sprintf("p%02d", i))).GetUid())
	}
	for i := range n {
		h.waitFor(fmt.Sprintf("p%02d", i), "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	}
	for _, uid := range uids {
		if c := fake.count(busv1.Operation_OPERATION_CREATE, uid); c != 1 {
			t.Errorf("proxy %s: %d creates dispatched, want 1", uid, c)
		}
	}
}

// An orchestrator killed with a command in flight: after a new one starts,
// the proxy converges with exactly one instance.
func TestRestartWithCommandInFlight(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cloud := newCloud()
	release := make(chan struct{})
	var held atomic.Bool
	fake := h.startProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
		if cmd.GetOperation() == busv1.Operation_OPERATION_CREATE && held.CompareAndSwap(false, true) {
			<-release // the backend is slow while the orchestrator dies
		}
		return cloud.answer(cmd)
	})
	stop := h.startReplica()
	p := h.create(managed("p1"))
	h.waitFor("p1", "with a command in flight", func(r *store.Row) bool { return r.CommandID != "" })
	stop()
	close(release)
	h.startReplica()
	h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	if cloud.created[p.GetUid()] != 1 {
		t.Errorf("instances created = %d, want 1", cloud.created[p.GetUid()])
	}
	if c := fake.count(busv1.Operation_OPERATION_CREATE, p.GetUid()); c != 1 {
		t.Errorf("creates = %d, want 1: the result of the in-flight command was applied by the new replica", c)
	}
}

// Every change is published as a ProxyEvent, in revision order, without
// cloud-init.
func TestProxyEventsPublished(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cloud := newCloud()
	h.startProvisioner("fake", cloud.answer)
	h.startReplica()
	req := managed("p1")
	req.Spec.CloudInit = "#cloud-config\npassword: hunter2\n"
	p := h.create(req)
	h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	cons, err := h.js.OrderedConsumer(context.Background(), h.names.ProxyEventStream(), jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	m, err := cons.Next(jetstream.FetchMaxWait(10 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ev := &busv1.ProxyEvent{}
	if _, err := bus.Decode(context.Background(), m, ev); err != nil {
		t.Fatal(err)
	}
	if ev.GetProxy().GetUid() != p.GetUid() || ev.GetRevision() == 0 {
		t.Errorf("event %v", ev)
	}
	if strings.Contains(string(m.Data()), "hunter2") || ev.GetProxy().GetSpec().GetCloudInit() != "" {
		t.Error("cloud-init leaked into a ProxyEvent")
	}
}

// A proxy whose last event left the stream (unchanged for longer than the
// stream keeps messages; here purged) is published again with its current
// state and revision.
func TestEventsRefreshedBeforeTheyAgeOut(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.eventRefresh = 300 * time.Millisecond
	cloud := newCloud()
	h.startProvisioner("fake", cloud.answer)
	h.startReplica()
	req := managed("p1")
	req.Spec.CloudInit = "#cloud-config\npassword: hunter2\n"
	p := h.create(req)
	row := h.waitFor("p1", "Running", phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := h.js.Stream(ctx, h.names.ProxyEventStream())
	if err != nil {
		t.Fatal(err)
	}
	subject := h.names.ProxyEventSubject(p.GetUid())
	// last returns the stream's event for p1, nil when it has none.
	last := func() (*busv1.ProxyEvent, string) {
		m, err := stream.GetLastMsgForSubject(ctx, subject)
		if err != nil {
			return nil, ""
		}
		ev := &busv1.ProxyEvent{}
		if err := proto.Unmarshal(m.Data, ev); err != nil {
			t.Fatal(err)
		}
		return ev, string(m.Data)
	}
	waitEvent := func(what string) *busv1.ProxyEvent {
		deadline := time.Now().Add(20 * time.Second)
		for {
			if ev, raw := last(); ev != nil && ev.GetRevision() == row.Revision {
				if strings.Contains(raw, "hunter2") {
					t.Error("cloud-init leaked into a ProxyEvent")
				}
				return ev
			}
			if time.Now().After(deadline) {
				t.Fatalf("no event at revision %d %s", row.Revision, what)
			}
			time.Sleep(20 * time.Millisecond) // polling the stream
		}
	}
	waitEvent("after the proxy became Running")
	if err := stream.Purge(ctx, jetstream.WithPurgeSubject(subject)); err != nil {
		t.Fatal(err)
	}
	ev := waitEvent("after the stream lost it")
	if ev.GetType() != proxyv1.ChangeType_CHANGE_TYPE_UPDATED || ev.GetProxy().GetUid() != p.GetUid() ||
		ev.GetProxy().GetStatus().GetPhase() != proxyv1.ProxyPhase_PROXY_PHASE_RUNNING {
		t.Errorf("refreshed event = %v, want p1's current state as UPDATED", ev)
	}
}
