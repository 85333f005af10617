package lifecycle

import (
	"strings"
	"testing"
	"time"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// The decision table: what a claimed proxy leads to.
func TestDecideTable(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name        string
		proxy       *Proxy
		wantOp      busv1.Operation
		wantStep    Step
		wantRelease bool
		wantPhase   proxyv1.ProxyPhase
		wantReason  Reason
		// wantNextIn is when the proxy is looked at again when no command
		// is issued (a command's deadline is checked for every command);
		// -1: never (latched or external).
		wantNextIn time.Duration
	}{
		{name: "no instance: create", proxy: proxy(),
			wantOp: opCreate, wantStep: StepCreate, wantPhase: provisioning, wantReason: ReasonProvisioning},
		{name: "retrying create keeps its reason", proxy: proxy(reason(ReasonRetrying), attempts(2)),
			wantOp: opCreate, wantStep: StepCreate, wantPhase: provisioning, wantReason: ReasonRetrying},
		{name: "create after quota keeps its reason", proxy: proxy(reason(ReasonQuotaExceeded), attempts(1)),
			wantOp: opCreate, wantStep: StepCreate, wantPhase: provisioning, wantReason: ReasonQuotaExceeded},
		{name: "instance of this spec: read it", proxy: proxy(withInstance),
			wantOp: opGet, wantStep: StepPoll, wantPhase: running, wantReason: ReasonRunning},
		{name: "spec changed: delete to replace", proxy: proxy(withInstance, specChanged),
			wantOp: opDelete, wantStep: StepReplaceDelete, wantPhase: provisioning, wantReason: ReasonReplacing},
		{name: "replacement deleted: poll until gone", proxy: proxy(withInstance, specChanged, step(StepReplacePoll), reason(ReasonReplacing)),
			wantOp: opGet, wantStep: StepReplacePoll, wantPhase: running, wantReason: ReasonReplacing},
		{name: "stopped within the grace period: read it", proxy: proxy(withInstance, stoppedSince(t0.Add(-4*time.Minute))),
			wantOp: opGet, wantStep: StepPoll, wantPhase: running, wantReason: ReasonRunning},
		{name: "stopped for the grace period: delete to replace", proxy: proxy(withInstance, stoppedSince(t0.Add(-5*time.Minute))),
			wantOp: opDelete, wantStep: StepReplaceDelete, wantPhase: provisioning, wantReason: ReasonInstanceStopped},
		{name: "external: never provisioned", proxy: proxy(external),
			wantPhase: running, wantReason: ReasonExternal, wantNextIn: -1},
		{name: "permanent failure latched", proxy: proxy(failedLatch),
			wantPhase: failed, wantReason: ReasonProviderError, wantNextIn: -1},
		{name: "latch released by a spec change", proxy: proxy(failedLatch, specChanged),
			wantOp: opCreate, wantStep: StepCreate, wantPhase: provisioning, wantReason: ReasonProvisioning},
		{name: "provider not configured: look again in a minute", proxy: proxy(provider("gone")),
			wantPhase: pending, wantReason: ReasonProviderNotConfigured, wantNextIn: time.Minute},
		{name: "command in flight before its deadline: wait for it", proxy: proxy(inFlight(StepCreate, t0.Add(time.Minute))),
			wantStep: StepCreate, wantPhase: pending, wantNextIn: time.Minute},
		{name: "command past its deadline: reissue", proxy: proxy(inFlight(StepCreate, t0.Add(-time.Second))),
			wantOp: opCreate, wantStep: StepCreate, wantPhase: provisioning, wantReason: ReasonProvisioning},
		// Deletion.
		{name: "deleting, nothing recorded: release", proxy: proxy(deleting),
			wantRelease: true, wantPhase: deletingP, wantReason: ReasonDeleting},
		{name: "deleting with skip_cleanup: release without asking", proxy: proxy(withInstance, deleting, skipCleanup),
			wantRelease: true, wantPhase: deletingP, wantReason: ReasonDeleting},
		{name: "skip_cleanup releases a proxy whose provider is gone", proxy: proxy(withInstance, deleting, skipCleanup, provider("retired")),
			wantRelease: true, wantPhase: deletingP, wantReason: ReasonDeleting},
		{name: "deleting, provider gone: stuck with a message", proxy: proxy(withInstance, deleting, provider("retired")),
			wantPhase: deletingP, wantReason: ReasonProviderNotConfigured, wantNextIn: time.Minute},
		{name: "deleting: get first", proxy: proxy(withInstance, deleting),
			wantOp: opGet, wantStep: StepCleanupGet, wantPhase: deletingP, wantReason: ReasonDeleting},
		{name: "deleting, instance found: delete", proxy: proxy(withInstance, deleting, step(StepCleanupDelete)),
			wantOp: opDelete, wantStep: StepCleanupDelete, wantPhase: deletingP, wantReason: ReasonDeleting},
		{name: "deleting after a permanent get: delete", proxy: proxy(withInstance, deleting, step(StepCleanupDeleteRelease), reason(ReasonCleanupGetFailed)),
			wantOp: opDelete, wantStep: StepCleanupDeleteRelease, wantPhase: deletingP, wantReason: ReasonCleanupGetFailed},
		{name: "deleting, cleanup command past its deadline: reissue", proxy: proxy(withInstance, deleting, inFlight(StepCleanupGet, t0.Add(-time.Second))),
			wantOp: opGet, wantStep: StepCleanupGet, wantPhase: deletingP, wantReason: ReasonDeleting},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := tc.proxy
			attemptsBefore := p.Attempts
			dec := machine().Decide(p, t0)
			if got := dec.Command.GetOperation(); got != tc.wantOp {
				t.Errorf("operation = %v, want %v", got, tc.wantOp)
			}
			if dec.Release != tc.wantRelease {
				t.Errorf("release = %v, want %v", dec.Release, tc.wantRelease)
			}
			if p.Phase != tc.wantPhase || p.Reason != tc.wantReason {
				t.Errorf("phase/reason = %v/%q, want %v/%q", p.Phase, p.Reason, tc.wantPhase, tc.wantReason)
			}
			if !tc.wantRelease && p.CommandStep != tc.wantStep {
				t.Errorf("step = %v, want %v", p.CommandStep, tc.wantStep)
			}
			if dec.Command == nil {
				switch {
				case tc.wantRelease:
				case tc.wantNextIn < 0 && p.NextAttemptTime != nil:
					t.Errorf("next look in %v, want never", in(p.NextAttemptTime, t0))
				case tc.wantNextIn >= 0 && (p.NextAttemptTime == nil || p.NextAttemptTime.Sub(t0) != tc.wantNextIn):
					t.Errorf("next look in %v, want %v", in(p.NextAttemptTime, t0), tc.wantNextIn)
				}
				return
			}
			cmd := dec.Command
			if p.CommandID != cmd.GetCommandId() || p.CommandID == "c-old" {
				t.Errorf("in-flight command %q not recorded as %q", p.CommandID, cmd.GetCommandId())
			}
			if p.NextAttemptTime == nil || !p.NextAttemptTime.Equal(cmd.GetDeadline().AsTime()) {
				t.Errorf("next attempt %v, want the deadline %v", p.NextAttemptTime, cmd.GetDeadline().AsTime())
			}
			if cmd.GetAttempt() != uint32(p.Attempts+1) || (strings.Contains(tc.name, "past its deadline") && p.Attempts != attemptsBefore+1) {
				t.Errorf("attempt %d with %d attempts (before %d)", cmd.GetAttempt(), p.Attempts, attemptsBefore)
			}
			if cmd.GetPurpose() != busv1.CommandPurpose_COMMAND_PURPOSE_RECONCILE || cmd.GetProxyUid() != p.UID || cmd.GetProvider() != p.Spec.GetProvider() {
				t.Errorf("command %v: want a reconcile command for %s at %s", cmd, p.UID, p.Spec.GetProvider())
			}
			if p.ObservedGeneration != p.Generation && !p.Deleting() {
				t.Errorf("observed generation %d, want %d", p.ObservedGeneration, p.Generation)
			}
		})
	}
}

// The Create carries the spec's port, and the proxy shows the port of the
// instance it has: a port change replaces the instance and the proxy's
// port moves with the new one.
func TestPortChangeReplacesAndMovesThePort(t *testing.T) {
	t.Parallel()
	m := machine()
	p := proxy(withInstance, specChanged)
	p.Spec.Port = 8080
	steps := []struct {
		wantOp   busv1.Operation
		answer   error
		wantPort uint32
	}{
		{opDelete, nil, 3128},   // the old instance still serves on 3128
		{opGet, notFound, 3128}, // gone
		{opCreate, nil, 8080},   // the replacement listens on 8080
	}
	now := t0
	for i, s := range steps {
		cmd := m.Decide(p, now).Command
		if cmd.GetOperation() != s.wantOp {
			t.Fatalf("step %d: decided %v, want %v", i, cmd.GetOperation(), s.wantOp)
		}
		if s.wantOp == opCreate && cmd.GetCreate().GetPort() != 8080 {
			t.Errorf("the Create asks for port %d, want 8080", cmd.GetCreate().GetPort())
		}
		if p.Port != s.wantPort {
			t.Errorf("step %d (%v): port %d, want %d", i, s.wantOp, p.Port, s.wantPort)
		}
		now = now.Add(time.Second)
		if got := m.Apply(p, result(cmd, s.answer, runningInst), now); got != Applied {
			t.Fatalf("step %d: %v", i, got)
		}
		now = now.Add(m.Timing.DeletionPoll)
	}
	if p.Phase != running || p.Port != 8080 || p.InstanceSpecHash != p.SpecHash {
		t.Errorf("after the replacement: phase %v port %d hash %q/%q", p.Phase, p.Port, p.InstanceSpecHash, p.SpecHash)
	}
}

// A command NATS never stored is taken back: a failed attempt, decided
// again after the transient backoff rather than at its deadline.
func TestUnsent(t *testing.T) {
	t.Parallel()
	m := machine()
	p := proxy()
	if m.Decide(p, t0).Command == nil {
		t.Fatal("no command")
	}
	now := t0.Add(time.Second)
	m.Unsent(p, now)
	if p.CommandID != "" || p.CommandDeadline != nil || p.Attempts != 1 {
		t.Errorf("command %q deadline %v attempts %d; want none, none, 1", p.CommandID, p.CommandDeadline, p.Attempts)
	}
	if p.NextAttemptTime == nil || p.NextAttemptTime.Sub(now) != time.Second {
		t.Errorf("decided again in %v, want 1s", in(p.NextAttemptTime, now))
	}
	if cmd := m.Decide(p, *p.NextAttemptTime).Command; cmd.GetOperation() != opCreate || cmd.GetAttempt() != 2 {
		t.Errorf("next decision %v attempt %d, want CREATE attempt 2", cmd.GetOperation(), cmd.GetAttempt())
	}
}

// A change's trace ends when the proxy settles, and only then.
func TestEndSettledTrace(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name     string
		proxy    *Proxy
		wantKept bool
	}{
		{"running, nothing in flight: settled", proxy(withInstance, traced), false},
		{"ready: settled", proxy(withInstance, healthy, traced), false},
		{"failed and latched: settled", proxy(failedLatch, traced), false},
		{"external: settled", proxy(external, traced), false},
		{"running with a command in flight: not yet", proxy(withInstance, inFlight(StepPoll, t0), traced), true},
		{"provisioning: not yet", proxy(func(p *Proxy) { p.Phase = provisioning }, traced), true},
		{"pending on a missing provider: not yet", proxy(provider("gone"), reason(ReasonProviderNotConfigured), traced), true},
		{"deleting: not yet", proxy(withInstance, deleting, traced), true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			EndSettledTrace(tc.proxy)
			if kept := tc.proxy.TraceParent != ""; kept != tc.wantKept {
				t.Errorf("trace kept = %v, want %v", kept, tc.wantKept)
			}
		})
	}
}
