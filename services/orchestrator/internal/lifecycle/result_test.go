package lifecycle

import (
	"strings"
	"testing"
	"time"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// The result table: what a provisioner's answer to the command Decide
// issued for a proxy does to it.
func TestApplyTable(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name       string
		proxy      *Proxy
		err        error
		inst       *provisionerv1.Instance
		want       Outcome
		wantPhase  proxyv1.ProxyPhase
		wantReason Reason
		// wantNextIn: when the proxy is decided again; 0 means at once,
		// -1 never (latched).
		wantNextIn  time.Duration
		wantStep    Step
		wantAttempt int32
		// wantMessage is a part of the message, when it matters.
		wantMessage string
		// meanwhile happens to the proxy while its command is in flight.
		meanwhile opt
	}{
		// Create.
		{name: "create ok, running with address", proxy: proxy(), inst: runningInst,
			wantPhase: running, wantReason: ReasonRunning, wantNextIn: 5 * time.Minute},
		{name: "create ok, no address yet", proxy: proxy(), inst: noAddress,
			wantPhase: provisioning, wantReason: ReasonWaitingForAddress, wantNextIn: 2 * time.Second},
		{name: "create ok, stopped: polled, with when it is replaced", proxy: proxy(), inst: stoppedInst,
			wantPhase: provisioning, wantReason: ReasonInstanceStopped, wantNextIn: 2 * time.Second, wantMessage: "it is replaced at 2026-12-02T12:05:01Z unless it starts"},
		{name: "create ok, instance failed: latched", proxy: proxy(), inst: failedInst,
			wantPhase: failed, wantReason: ReasonInstanceFailed, wantNextIn: -1},
		{name: "create permanent: latched", proxy: proxy(), err: permanent,
			wantPhase: failed, wantReason: ReasonProviderError, wantNextIn: -1, wantMessage: "is not in proxmox.nodes"},
		{name: "create not found: nothing recorded, retried", proxy: proxy(), err: notFound,
			wantPhase: provisioning, wantReason: ReasonRetrying, wantNextIn: time.Second, wantAttempt: 1},
		{name: "create transient: backoff 1s", proxy: proxy(), err: transient,
			wantPhase: provisioning, wantReason: ReasonRetrying, wantNextIn: time.Second, wantAttempt: 1},
		{name: "create transient, 4th attempt: backoff 8s", proxy: proxy(attempts(3)), err: transient,
			wantPhase: provisioning, wantReason: ReasonRetrying, wantNextIn: 8 * time.Second, wantAttempt: 4},
		{name: "create quota: slow backoff 30s", proxy: proxy(), err: quota,
			wantPhase: provisioning, wantReason: ReasonQuotaExceeded, wantNextIn: 30 * time.Second, wantAttempt: 1},
		{name: "create quota, capped at 30m", proxy: proxy(attempts(20)), err: quota,
			wantPhase: provisioning, wantReason: ReasonQuotaExceeded, wantNextIn: 30 * time.Minute, wantAttempt: 21},
		// Poll and resync.
		{name: "get ok, still running", proxy: proxy(withInstance), inst: runningInst,
			wantPhase: running, wantReason: ReasonRunning, wantNextIn: 5 * time.Minute},
		{name: "get ok, healthy stays ready", proxy: proxy(withInstance, healthy), inst: runningInst,
			wantPhase: ready, wantReason: ReasonHealthy, wantNextIn: 5 * time.Minute},
		{name: "get ok, running again after stopped: the stop is forgotten", proxy: proxy(withInstance, stoppedSince(t0.Add(-time.Minute))), inst: runningInst,
			wantPhase: running, wantReason: ReasonRunning, wantNextIn: 5 * time.Minute},
		{name: "get stopped: provisioning, polled", proxy: proxy(withInstance), inst: stoppedInst,
			wantPhase: provisioning, wantReason: ReasonInstanceStopped, wantNextIn: 2 * time.Second},
		{name: "get stopped near the grace: decided at the grace", proxy: proxy(withInstance, stoppedSince(t0.Add(-5*time.Minute+time.Second+500*time.Millisecond))), inst: stoppedInst,
			wantPhase: provisioning, wantReason: ReasonInstanceStopped, wantNextIn: 500 * time.Millisecond},
		{name: "get not found on a live proxy: recreate", proxy: proxy(withInstance), err: notFound,
			wantPhase: provisioning, wantReason: ReasonInstanceLost},
		{name: "get permanent on a live proxy: latched", proxy: proxy(withInstance), err: permanent,
			wantPhase: failed, wantReason: ReasonProviderError, wantNextIn: -1},
		{name: "get transient on a live proxy: retried, phase kept", proxy: proxy(withInstance), err: transient,
			wantPhase: running, wantReason: ReasonRetrying, wantNextIn: time.Second, wantAttempt: 1},
		{name: "result after an update in flight: decided again at once", proxy: proxy(withInstance), inst: runningInst,
			meanwhile: func(p *Proxy) { p.Generation++ }, wantPhase: running, wantReason: ReasonRunning},
		// Replacement.
		{name: "replace delete ok: poll until gone", proxy: proxy(withInstance, specChanged),
			wantPhase: provisioning, wantReason: ReasonReplacing, wantNextIn: 2 * time.Second, wantStep: StepReplacePoll},
		{name: "replace delete not found: create the replacement", proxy: proxy(withInstance, specChanged), err: notFound,
			wantPhase: provisioning, wantReason: ReasonReplacing},
		{name: "replace poll still there: poll again", proxy: proxy(withInstance, specChanged, step(StepReplacePoll)), inst: runningInst,
			wantPhase: running, wantNextIn: 2 * time.Second, wantStep: StepReplacePoll, wantReason: ReasonRunning},
		{name: "replace poll transient: keeps polling", proxy: proxy(withInstance, specChanged, step(StepReplacePoll)), err: transient,
			wantPhase: running, wantReason: ReasonRetrying, wantNextIn: time.Second, wantStep: StepReplacePoll, wantAttempt: 1},
		// Deletion.
		{name: "cleanup get not found: release", proxy: proxy(withInstance, deleting), err: notFound,
			want: Released},
		{name: "cleanup get ok: delete", proxy: proxy(withInstance, deleting), inst: runningInst,
			wantPhase: deletingP, wantReason: ReasonDeleting, wantStep: StepCleanupDelete},
		{name: "cleanup delete ok: read until gone", proxy: proxy(withInstance, deleting, step(StepCleanupDelete)),
			wantPhase: deletingP, wantReason: ReasonDeleting, wantNextIn: 2 * time.Second},
		{name: "cleanup get permanent: delete anyway", proxy: proxy(withInstance, deleting), err: permanent,
			wantPhase: deletingP, wantReason: ReasonCleanupGetFailed, wantStep: StepCleanupDeleteRelease},
		{name: "cleanup delete after a permanent get ok: release", proxy: proxy(withInstance, deleting, step(StepCleanupDeleteRelease)),
			want: Released},
		{name: "cleanup delete after a permanent get fails: retried", proxy: proxy(withInstance, deleting, step(StepCleanupDeleteRelease)), err: permanent,
			wantPhase: deletingP, wantReason: ReasonCleanupFailed, wantNextIn: time.Second, wantAttempt: 1, wantMessage: "get and delete both failed"},
		{name: "cleanup get transient: retry", proxy: proxy(withInstance, deleting), err: transient,
			wantPhase: deletingP, wantReason: ReasonCleanupFailed, wantNextIn: time.Second, wantAttempt: 1},
		{name: "cleanup delete permanent: never gives up", proxy: proxy(withInstance, deleting, step(StepCleanupDelete), attempts(30)), err: permanent,
			wantPhase: deletingP, wantReason: ReasonCleanupFailed, wantNextIn: 5 * time.Minute, wantAttempt: 31},
		{name: "cleanup delete quota: the slow backoff", proxy: proxy(withInstance, deleting, step(StepCleanupDelete)), err: quota,
			wantPhase: deletingP, wantReason: ReasonCleanupFailed, wantNextIn: 30 * time.Second, wantAttempt: 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			m := machine()
			dec := m.Decide(tc.proxy, t0)
			if dec.Command == nil {
				t.Fatalf("no command decided for %+v", tc.proxy)
			}
			if tc.meanwhile != nil {
				tc.meanwhile(tc.proxy)
			}
			now := t0.Add(time.Second)
			got := m.Apply(tc.proxy, result(dec.Command, tc.err, tc.inst), now)
			if got != tc.want {
				t.Fatalf("outcome = %v, want %v", got, tc.want)
			}
			if got == Released {
				return
			}
			p := tc.proxy
			if p.Phase != tc.wantPhase || p.Reason != tc.wantReason {
				t.Errorf("phase/reason = %v/%q, want %v/%q", p.Phase, p.Reason, tc.wantPhase, tc.wantReason)
			}
			switch {
			case tc.wantNextIn < 0 && p.NextAttemptTime != nil:
				t.Errorf("next attempt in %v, want none (latched)", in(p.NextAttemptTime, now))
			case tc.wantNextIn >= 0 && (p.NextAttemptTime == nil || p.NextAttemptTime.Sub(now) != tc.wantNextIn):
				t.Errorf("next attempt in %v, want %v", in(p.NextAttemptTime, now), tc.wantNextIn)
			}
			if p.CommandStep != tc.wantStep || p.Attempts != tc.wantAttempt {
				t.Errorf("step/attempts = %v/%d, want %v/%d", p.CommandStep, p.Attempts, tc.wantStep, tc.wantAttempt)
			}
			if p.CommandID != "" || p.CommandDeadline != nil || p.CommandIssueTime != nil {
				t.Errorf("command %q still in flight after its result", p.CommandID)
			}
			if !strings.Contains(p.Message, tc.wantMessage) {
				t.Errorf("message %q, want it to contain %q", p.Message, tc.wantMessage)
			}
			if (tc.inst.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_STOPPED) != (p.StoppedSince == nil) {
				t.Errorf("stopped since %v after a %v answer", p.StoppedSince, tc.inst.GetState())
			}
		})
	}
}

// A result answering another command than the proxy's current one (its
// deadline passed and it was issued again) changes nothing.
func TestApplyIgnoresSupersededResults(t *testing.T) {
	t.Parallel()
	m := machine()
	p := proxy()
	dec := m.Decide(p, t0)
	res := result(dec.Command, permanent, nil)
	res.CommandId = "an-older-command"
	if got := m.Apply(p, res, t0); got != Stale {
		t.Fatalf("outcome = %v, want Stale", got)
	}
	if p.CommandID != dec.Command.GetCommandId() || p.Phase == failed {
		t.Errorf("a stale result changed the proxy: %+v", p)
	}
}

// JetStream delivers at least once: the same result twice changes the
// proxy once.
func TestApplyIgnoresDuplicateResults(t *testing.T) {
	t.Parallel()
	m := machine()
	p := proxy()
	dec := m.Decide(p, t0)
	res := result(dec.Command, nil, runningInst)
	if got := m.Apply(p, res, t0); got != Applied {
		t.Fatalf("first delivery: %v", got)
	}
	before := *p
	if got := m.Apply(p, res, t0.Add(time.Second)); got != Stale {
		t.Fatalf("second delivery: %v, want Stale", got)
	}
	if p.Phase != before.Phase || p.ProviderID != before.ProviderID || p.NextAttemptTime != before.NextAttemptTime {
		t.Errorf("a duplicate result changed the proxy")
	}
}

// A create answered after the spec changed records the instance with the
// command's hash, so the next decision replaces it rather than leaking it;
// a permanent failure of that create latches only the old spec.
func TestCreateResultForAnOlderSpec(t *testing.T) {
	t.Parallel()
	m := machine()
	p := proxy()
	dec := m.Decide(p, t0)
	specChanged(p)
	if got := m.Apply(p, result(dec.Command, nil, runningInst), t0); got != Applied {
		t.Fatal(got)
	}
	if p.InstanceSpecHash != "h1" || p.NextAttemptTime == nil || p.NextAttemptTime.After(t0) {
		t.Errorf("instance hash %q next %v: want h1 and due now", p.InstanceSpecHash, p.NextAttemptTime)
	}
	if next := m.Decide(p, t0); next.Command.GetOperation() != opDelete {
		t.Errorf("next decision %v, want the replacing DELETE", next.Command.GetOperation())
	}

	q := proxy()
	dec = m.Decide(q, t0)
	specChanged(q)
	m.Apply(q, result(dec.Command, permanent, nil), t0)
	if q.Phase != failed || q.FailedSpecHash != "h1" || q.NextAttemptTime == nil || q.NextAttemptTime.After(t0) {
		t.Errorf("failed for the old spec: phase %v failed hash %q next %v; want FAILED, h1, due now", q.Phase, q.FailedSpecHash, q.NextAttemptTime)
	}
	if next := m.Decide(q, t0); next.Command.GetOperation() != opCreate {
		t.Errorf("next decision %v, want a CREATE for the new spec", next.Command.GetOperation())
	}
}

// Each step of the deletion of a proxy with an instance, result by
// result, to its release.
func TestDeletionSequence(t *testing.T) {
	t.Parallel()
	m := machine()
	p := proxy(withInstance)
	if RequestDelete(p, false, "", t0) {
		t.Fatal("a proxy with an instance was released without cleanup")
	}
	now := t0
	for i, s := range []struct {
		wantOp busv1.Operation
		answer error
		want   Outcome
	}{
		{opGet, nil, Applied},       // found: delete it
		{opDelete, nil, Applied},    // deleted: read until gone
		{opGet, nil, Applied},       // still there
		{opDelete, nil, Applied},    // delete again
		{opGet, notFound, Released}, // gone
	} {
		cmd := m.Decide(p, now).Command
		if cmd.GetOperation() != s.wantOp {
			t.Fatalf("step %d: decided %v, want %v", i, cmd.GetOperation(), s.wantOp)
		}
		now = now.Add(time.Second)
		if got := m.Apply(p, result(cmd, s.answer, runningInst), now); got != s.want {
			t.Fatalf("step %d: outcome %v, want %v", i, got, s.want)
		}
		if p.Phase != deletingP {
			t.Fatalf("step %d: phase %v, want DELETING", i, p.Phase)
		}
		now = now.Add(m.Timing.DeletionPoll)
	}
}
