package dispatch_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/api"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/dispatch"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// A new proxy's Create is decided in the transaction that creates it and
// published after the commit: it reaches the provisioner with no replica
// running, so no claim took the proxy. Watchers see the proxy created
// (PENDING), then decided (PROVISIONING), as when a claim decided it.
func TestCreateIssuesFirstCommandWithoutClaim(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	cloud, fake := h.StartCloud("fake")
	ctx := context.Background()
	before, err := h.Store.Revision(ctx)
	if err != nil {
		t.Fatal(err)
	}

	p := h.Create(orchtest.Managed("p1"))
	if p.GetStatus().GetPhase() != proxyv1.ProxyPhase_PROXY_PHASE_PENDING {
		t.Errorf("phase in the create's answer = %v, want PENDING", p.GetStatus().GetPhase())
	}
	waittest.For(t, orchtest.Wait, "the Create at the provisioner", func() bool {
		return fake.Count(busv1.Operation_OPERATION_CREATE, p.GetUid()) == 1
	})
	cmd := fake.Received()[0]
	r, err := h.Store.Get(ctx, "p1")
	if err != nil {
		t.Fatal(err)
	}
	if r.CommandID != cmd.GetCommandId() || r.CommandStep != lifecycle.StepCreate || r.Phase != proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING ||
		r.Reason != lifecycle.ReasonProvisioning || cmd.GetAttempt() != 1 || cmd.GetCreate().GetInstallation() != orchtest.Installation {
		t.Errorf("stored command %q step %v phase %v reason %q; sent %q attempt %d installation %q",
			r.CommandID, r.CommandStep, r.Phase, r.Reason, cmd.GetCommandId(), cmd.GetAttempt(), cmd.GetCreate().GetInstallation())
	}
	changes, err := h.Store.Changes(ctx, before, 10)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range changes {
		got = append(got, fmt.Sprintf("%d %v %v", c.Revision-before, c.Type, c.Proxy.GetStatus().GetPhase()))
	}
	want := []string{"1 CHANGE_TYPE_CREATED PROXY_PHASE_PENDING", "2 CHANGE_TYPE_UPDATED PROXY_PHASE_PROVISIONING"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("changes = %q, want %q", got, want)
	}

	// A replica applies the result that waited for it.
	h.StartReplica()
	h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	if n := cloud.Created(p.GetUid()); n != 1 {
		t.Errorf("instances created = %d, want 1", n)
	}
}

// stopsBeforePublish decides first commands as the orchestrator does and
// then publishes nothing, as a process that stopped right after its create
// committed.
type stopsBeforePublish struct {
	d *dispatch.Dispatcher

	mu      sync.Mutex
	dropped []*busv1.Command
}

func (s *stopsBeforePublish) DecideNew(p *lifecycle.Proxy, now time.Time) *busv1.Command {
	return s.d.DecideNew(p, now)
}

func (s *stopsBeforePublish) PublishNew(_ context.Context, _ time.Time, cmds []dispatch.NewCommand) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range cmds {
		s.dropped = append(s.dropped, c.Command)
	}
}

// A create whose process stops between the commit and the publish is
// recovered as a claim's unsent command is: at the Create's deadline a
// claim finds it unanswered and issues it again with a new id, and one
// instance is created.
func TestCreateStoppedBeforePublishIsIssuedAtItsDeadline(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	cloud, fake := h.StartCloud("fake")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	log := slog.New(slog.NewTextHandler(h.Logs, nil))
	stopped := &stopsBeforePublish{d: &dispatch.Dispatcher{
		Store: h.Store, JS: h.JS, Names: h.Names, Log: log, Metrics: dispatch.NewMetrics(prometheus.NewRegistry()),
		Machine: &lifecycle.Machine{Timing: h.Timing, Log: log, Installation: orchtest.Installation,
			Configured: func(name string) bool { _, ok := h.Providers.Get(name); return ok }},
	}}
	srv := &api.Server{Store: h.Store, Providers: providers.Static(h.Providers), Changes: store.NewSignal(), FirstCommands: stopped}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Run(ctx) }()
	resp, err := srv.CreateProxy(ctx, orchtest.Managed("p1"))
	cancel()
	<-done
	if err != nil {
		t.Fatal(err)
	}
	uid := resp.GetProxy().GetUid()
	stopped.mu.Lock()
	lost := stopped.dropped
	stopped.mu.Unlock()
	if len(lost) != 1 {
		t.Fatalf("commands decided = %d, want 1", len(lost))
	}
	r, err := h.Store.Get(context.Background(), "p1")
	if err != nil {
		t.Fatal(err)
	}
	if r.CommandID != lost[0].GetCommandId() || r.CommandDeadline == nil {
		t.Fatalf("stored command %q deadline %v, want %q in flight", r.CommandID, r.CommandDeadline, lost[0].GetCommandId())
	}

	h.StartReplica()
	h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	h.WaitLog("command unanswered past its deadline; issuing it again")
	var creates []*busv1.Command
	for _, c := range fake.Received() {
		if c.GetProxyUid() == uid && c.GetOperation() == busv1.Operation_OPERATION_CREATE {
			creates = append(creates, c)
		}
	}
	if len(creates) != 1 || creates[0].GetCommandId() == lost[0].GetCommandId() || creates[0].GetAttempt() != 2 ||
		creates[0].GetIssueTime().AsTime().Before(r.CommandDeadline.Add(-time.Millisecond)) {
		t.Errorf("creates received = %v; want one, a new id, attempt 2, issued at the deadline %v", creates, r.CommandDeadline)
	}
	if n := cloud.Created(uid); n != 1 {
		t.Errorf("instances created = %d, want 1", n)
	}
}
