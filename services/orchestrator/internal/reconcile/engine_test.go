package reconcile

import (
	"io"
	"log/slog"
	"testing"
	"time"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

var t0 = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

func engine() *Engine {
	return &Engine{
		Timing:     DefaultTiming(),
		Configured: func(p string) bool { return p == "pve" },
		Log:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		NoJitter:   true,
	}
}

type rowOpt func(*store.Row)

func row(opts ...rowOpt) *store.Row {
	r := &store.Row{
		UID: "u1", Name: "p1", Generation: 1, SpecHash: "h1",
		Spec:  &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve", Port: 3128},
		Phase: proxyv1.ProxyPhase_PROXY_PHASE_PENDING,
	}
	for _, o := range opts {
		o(r)
	}
	return r
}

func withInstance(r *store.Row) {
	r.ProviderID, r.InstanceSpecHash, r.IP = "vms/101/proxy-u1", "h1", "10.0.0.9"
	r.Phase = proxyv1.ProxyPhase_PROXY_PHASE_RUNNING
}
func deleting(r *store.Row) { r.DeleteTime = &t0 }
func stoppedSince(t time.Time) rowOpt {
	return func(r *store.Row) { r.StoppedSince = &t }
}
func skipCleanup(r *store.Row) { r.SkipCleanup = true }
func provider(p string) rowOpt { return func(r *store.Row) { r.Spec.Provider = p } }
func external(r *store.Row) {
	r.Spec = &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "h", Port: 1}}
	r.SpecHash = ""
}
func failedLatch(r *store.Row) {
	r.Phase, r.FailedSpecHash = proxyv1.ProxyPhase_PROXY_PHASE_FAILED, "h1"
}
func specChanged(r *store.Row) { r.SpecHash, r.Generation = "h2", 2 }
func inFlight(step store.Step, deadline time.Time) rowOpt {
	return func(r *store.Row) { r.CommandID, r.CommandStep, r.CommandDeadline = "c-old", step, &deadline }
}

// The decision table: what a claimed proxy leads to.
func TestDecideTable(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name        string
		row         *store.Row
		wantOp      busv1.Operation
		wantRelease bool
		wantPhase   proxyv1.ProxyPhase
		wantReason  string
	}{
		{"no instance: create", row(), busv1.Operation_OPERATION_CREATE, false, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "Provisioning"},
		{"instance of this spec: read it", row(withInstance), busv1.Operation_OPERATION_GET, false, proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, ""},
		{"spec changed: delete to replace", row(withInstance, specChanged), busv1.Operation_OPERATION_DELETE, false, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "Replacing"},
		{"replacement deleted: poll until gone", row(withInstance, specChanged, func(r *store.Row) { r.CommandStep = store.StepReplacePoll }), busv1.Operation_OPERATION_GET, false, proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, ""},
		{"stopped within the grace period: read it", row(withInstance, stoppedSince(t0.Add(-4*time.Minute))), busv1.Operation_OPERATION_GET, false, proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, ""},
		{"stopped for the grace period: delete to replace", row(withInstance, stoppedSince(t0.Add(-5*time.Minute))), busv1.Operation_OPERATION_DELETE, false, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "InstanceStopped"},
		{"external: never provisioned", row(external), 0, false, proxyv1.ProxyPhase_PROXY_PHASE_PENDING, ""},
		{"permanent failure latched", row(failedLatch), 0, false, proxyv1.ProxyPhase_PROXY_PHASE_FAILED, ""},
		{"latch released by a spec change", row(failedLatch, specChanged), busv1.Operation_OPERATION_CREATE, false, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "Provisioning"},
		{"provider not configured", row(provider("gone")), 0, false, proxyv1.ProxyPhase_PROXY_PHASE_PENDING, "ProviderNotConfigured"},
		{"command in flight before its deadline: wait", row(inFlight(store.StepCreate, t0.Add(time.Minute))), 0, false, proxyv1.ProxyPhase_PROXY_PHASE_PENDING, ""},
		{"command past its deadline: reissue", row(inFlight(store.StepCreate, t0.Add(-time.Second))), busv1.Operation_OPERATION_CREATE, false, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "Provisioning"},
		// reconcileDelete
		{"deleting, nothing recorded: release", row(deleting), 0, true, proxyv1.ProxyPhase_PROXY_PHASE_DELETING, ""},
		{"deleting with skip_cleanup: release without asking", row(withInstance, deleting, skipCleanup), 0, true, proxyv1.ProxyPhase_PROXY_PHASE_DELETING, ""},
		{"skip_cleanup releases a proxy whose provider is gone", row(withInstance, deleting, skipCleanup, provider("retired")), 0, true, proxyv1.ProxyPhase_PROXY_PHASE_DELETING, ""},
		{"deleting, provider gone: stuck with a message", row(withInstance, deleting, provider("retired")), 0, false, proxyv1.ProxyPhase_PROXY_PHASE_DELETING, "ProviderNotConfigured"},
		{"deleting: get first", row(withInstance, deleting), busv1.Operation_OPERATION_GET, false, proxyv1.ProxyPhase_PROXY_PHASE_DELETING, ""},
		{"deleting after a permanent get: delete", row(withInstance, deleting, func(r *store.Row) { r.CommandStep = store.StepCleanupDeleteRelease }), busv1.Operation_OPERATION_DELETE, false, proxyv1.ProxyPhase_PROXY_PHASE_DELETING, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dec := engine().Decide(tc.row, t0)
			if got := dec.Command.GetOperation(); got != tc.wantOp {
				t.Errorf("operation = %v, want %v", got, tc.wantOp)
			}
			if dec.Release != tc.wantRelease {
				t.Errorf("release = %v, want %v", dec.Release, tc.wantRelease)
			}
			if tc.row.Phase != tc.wantPhase {
				t.Errorf("phase = %v, want %v", tc.row.Phase, tc.wantPhase)
			}
			if tc.wantReason != "" && tc.row.Reason != tc.wantReason {
				t.Errorf("reason = %q, want %q", tc.row.Reason, tc.wantReason)
			}
			if dec.Command != nil {
				if tc.row.CommandID != dec.Command.GetCommandId() || tc.row.CommandID == "c-old" {
					t.Errorf("in-flight command %q not recorded as %q", tc.row.CommandID, dec.Command.GetCommandId())
				}
				if tc.row.NextAttemptTime == nil || !tc.row.NextAttemptTime.Equal(dec.Command.GetDeadline().AsTime()) {
					t.Errorf("next attempt %v, want the deadline %v", tc.row.NextAttemptTime, dec.Command.GetDeadline().AsTime())
				}
			}
		})
	}
}

func result(cmd *busv1.Command, err error, inst *provisionerv1.Instance) *busv1.CommandResult {
	res := &busv1.CommandResult{CommandId: cmd.GetCommandId(), SpecHash: cmd.GetSpecHash(), Operation: cmd.GetOperation()}
	switch {
	case err != nil:
		res.Outcome = &busv1.CommandResult_Error{Error: errclass.ToCommandError(err)}
	case cmd.GetOperation() == busv1.Operation_OPERATION_CREATE:
		res.Outcome = &busv1.CommandResult_Create{Create: &provisionerv1.CreateInstanceResponse{Instance: inst}}
	case cmd.GetOperation() == busv1.Operation_OPERATION_GET:
		res.Outcome = &busv1.CommandResult_Get{Get: &provisionerv1.GetInstanceResponse{Instance: inst}}
	default:
		res.Outcome = &busv1.CommandResult_Delete{Delete: &provisionerv1.DeleteInstanceResponse{Deleted: true}}
	}
	return res
}

var running = &provisionerv1.Instance{ProviderId: "vms/101/proxy-u1", State: provisionerv1.InstanceState_INSTANCE_STATE_RUNNING, Ip: "10.0.0.9"}

// The result table: what a provisioner's answer does to the proxy.
func TestApplyTable(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name        string
		row         *store.Row
		err         error
		inst        *provisionerv1.Instance
		want        Outcome
		wantPhase   proxyv1.ProxyPhase
		wantReason  string
		wantNextIn  time.Duration // -1: no next attempt (latched)
		wantStep    store.Step
		wantAttempt int32
	}{
		{"create ok, running with address", row(), nil, running, Applied, proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, "Running", 5 * time.Minute, store.StepNone, 0},
		{"create ok, no address yet", row(), nil, &provisionerv1.Instance{ProviderId: "x", State: provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING}, Applied, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "WaitingForAddress", 2 * time.Second, store.StepNone, 0},
		{"create permanent: latched", row(), errclass.New(errclass.Permanent, `placement.zone "x" is not in proxmox.nodes`), nil, Applied, proxyv1.ProxyPhase_PROXY_PHASE_FAILED, "ProviderError", -1, store.StepNone, 0},
		{"create transient: backoff 1s", row(), errclass.New(errclass.Transient, "timeout"), nil, Applied, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "Retrying", time.Second, store.StepNone, 1},
		{"create transient, 4th attempt: backoff 8s", row(func(r *store.Row) { r.Attempts = 3 }), errclass.New(errclass.Transient, "timeout"), nil, Applied, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "Retrying", 8 * time.Second, store.StepNone, 4},
		{"create quota: slow backoff 30s", row(), errclass.New(errclass.QuotaExceeded, "Quota 'CPUS' exceeded"), nil, Applied, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "QuotaExceeded", 30 * time.Second, store.StepNone, 1},
		{"create quota, capped at 30m", row(func(r *store.Row) { r.Attempts = 20 }), errclass.New(errclass.QuotaExceeded, "quota"), nil, Applied, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "QuotaExceeded", 30 * time.Minute, store.StepNone, 21},
		{"get not found on a live proxy: recreate", row(withInstance), errclass.New(errclass.NotFound, "gone"), nil, Applied, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "InstanceLost", 0, store.StepNone, 0},
		{"get permanent on a live proxy: latched", row(withInstance), errclass.New(errclass.Permanent, "resume or destroy it in Proxmox"), nil, Applied, proxyv1.ProxyPhase_PROXY_PHASE_FAILED, "ProviderError", -1, store.StepNone, 0},
		{"get stopped: provisioning, polled", row(withInstance), nil, &provisionerv1.Instance{State: provisionerv1.InstanceState_INSTANCE_STATE_STOPPED}, Applied, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "InstanceStopped", 2 * time.Second, store.StepNone, 0},
		{"replace delete ok: poll until gone", row(withInstance, specChanged), nil, nil, Applied, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, "Replacing", 2 * time.Second, store.StepReplacePoll, 0},
		{"cleanup get not found: release", row(withInstance, deleting), errclass.New(errclass.NotFound, "gone"), nil, Released, proxyv1.ProxyPhase_PROXY_PHASE_DELETING, "", 0, store.StepNone, 0},
		{"cleanup get ok: delete", row(withInstance, deleting), nil, running, Applied, proxyv1.ProxyPhase_PROXY_PHASE_DELETING, "", 0, store.StepCleanupDelete, 0},
		{"cleanup get permanent: delete anyway", row(withInstance, deleting), errclass.New(errclass.Permanent, "host retired"), nil, Applied, proxyv1.ProxyPhase_PROXY_PHASE_DELETING, "CleanupGetFailed", 0, store.StepCleanupDeleteRelease, 0},
		{"cleanup get transient: retry", row(withInstance, deleting), errclass.New(errclass.Transient, "unreachable"), nil, Applied, proxyv1.ProxyPhase_PROXY_PHASE_DELETING, "CleanupFailed", time.Second, store.StepNone, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := engine()
			dec := e.Decide(tc.row, t0)
			if dec.Command == nil {
				t.Fatalf("no command decided for %+v", tc.row)
			}
			now := t0.Add(time.Second)
			got := e.Apply(tc.row, result(dec.Command, tc.err, tc.inst), now)
			if got != tc.want {
				t.Fatalf("outcome = %v, want %v", got, tc.want)
			}
			if got == Released {
				return
			}
			r := tc.row
			if r.Phase != tc.wantPhase || (tc.wantReason != "" && r.Reason != tc.wantReason) {
				t.Errorf("phase/reason = %v/%q, want %v/%q", r.Phase, r.Reason, tc.wantPhase, tc.wantReason)
			}
			switch {
			case tc.wantNextIn < 0 && r.NextAttemptTime != nil:
				t.Errorf("next attempt %v, want none (latched)", r.NextAttemptTime)
			case tc.wantNextIn >= 0 && (r.NextAttemptTime == nil || r.NextAttemptTime.Sub(now) != tc.wantNextIn):
				t.Errorf("next attempt in %v, want %v", durOrNil(r.NextAttemptTime, now), tc.wantNextIn)
			}
			if r.CommandStep != tc.wantStep || r.Attempts != tc.wantAttempt {
				t.Errorf("step/attempts = %v/%d, want %v/%d", r.CommandStep, r.Attempts, tc.wantStep, tc.wantAttempt)
			}
			if r.CommandID != "" {
				t.Errorf("command %q still in flight after its result", r.CommandID)
			}
		})
	}
}

func durOrNil(t *time.Time, now time.Time) any {
	if t == nil {
		return "none"
	}
	return t.Sub(now)
}

func TestApplyIgnoresSupersededResults(t *testing.T) {
	t.Parallel()
	e := engine()
	r := row()
	dec := e.Decide(r, t0)
	res := result(dec.Command, errclass.New(errclass.Permanent, "late"), nil)
	res.CommandId = "an-older-command"
	if got := e.Apply(r, res, t0); got != Stale {
		t.Fatalf("outcome = %v, want Stale", got)
	}
	if r.CommandID != dec.Command.GetCommandId() || r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_FAILED {
		t.Errorf("a stale result changed the proxy: %+v", r)
	}
}

// A create answered after the spec changed records the instance with the
// command's hash, so the next decision replaces it rather than leaking it.
func TestCreateResultForAnOlderSpec(t *testing.T) {
	t.Parallel()
	e := engine()
	r := row()
	dec := e.Decide(r, t0)
	specChanged(r)
	if got := e.Apply(r, result(dec.Command, nil, running), t0); got != Applied {
		t.Fatal(got)
	}
	if r.InstanceSpecHash != "h1" || r.NextAttemptTime == nil || r.NextAttemptTime.After(t0) {
		t.Errorf("instance hash %q next %v: want h1 and due now", r.InstanceSpecHash, r.NextAttemptTime)
	}
	if next := e.Decide(r, t0); next.Command.GetOperation() != busv1.Operation_OPERATION_DELETE {
		t.Errorf("next decision %v, want the replacing DELETE", next.Command.GetOperation())
	}
}

func TestApplyHealth(t *testing.T) {
	t.Parallel()
	e := engine()
	r := row(withInstance)
	tr := func(seq int64, pid string, healthy bool) *healthv1.HealthTransition {
		return &healthv1.HealthTransition{Sequence: seq, ProviderId: pid, Healthy: healthy}
	}
	if e.ApplyHealth(r, tr(1, "vms/999/other", true), t0) {
		t.Error("a verdict about another instance was applied")
	}
	if !e.ApplyHealth(r, tr(2, r.ProviderID, true), t0) || r.Phase != proxyv1.ProxyPhase_PROXY_PHASE_READY {
		t.Errorf("healthy: phase %v", r.Phase)
	}
	if e.ApplyHealth(r, tr(1, r.ProviderID, false), t0) || r.Phase != proxyv1.ProxyPhase_PROXY_PHASE_READY {
		t.Error("an older transition was applied")
	}
	if !e.ApplyHealth(r, tr(3, r.ProviderID, false), t0) || r.Phase != proxyv1.ProxyPhase_PROXY_PHASE_RUNNING || r.Reason != "Unhealthy" {
		t.Errorf("unhealthy: phase %v reason %q", r.Phase, r.Reason)
	}
	p := row() // provisioning: health does not make it Ready
	p.ProviderID = "vms/101/proxy-u1"
	p.Phase = proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING
	e.ApplyHealth(p, tr(1, p.ProviderID, true), t0)
	if p.Phase != proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING || !p.Healthy {
		t.Errorf("provisioning proxy: phase %v healthy %v", p.Phase, p.Healthy)
	}
}

// JetStream delivers at least once: the same result twice changes the proxy
// once.
func TestApplyIgnoresDuplicateResults(t *testing.T) {
	t.Parallel()
	e := engine()
	r := row()
	dec := e.Decide(r, t0)
	res := result(dec.Command, nil, running)
	if got := e.Apply(r, res, t0); got != Applied {
		t.Fatalf("first delivery: %v", got)
	}
	before := *r
	if got := e.Apply(r, res, t0.Add(time.Second)); got != Stale {
		t.Fatalf("second delivery: %v, want Stale", got)
	}
	if r.Phase != before.Phase || r.ProviderID != before.ProviderID || r.NextAttemptTime != before.NextAttemptTime {
		t.Errorf("a duplicate result changed the proxy")
	}
}

// The retry schedule: base·2^(attempt-1) capped at max, with ±20% jitter.
func TestBackoffSchedule(t *testing.T) {
	t.Parallel()
	cases := []struct {
		attempt   int32
		base, max time.Duration
		want      time.Duration
	}{
		{1, time.Second, 5 * time.Minute, time.Second},
		{2, time.Second, 5 * time.Minute, 2 * time.Second},
		{5, time.Second, 5 * time.Minute, 16 * time.Second},
		{9, time.Second, 5 * time.Minute, 256 * time.Second},
		{10, time.Second, 5 * time.Minute, 5 * time.Minute},
		{100000, time.Second, 5 * time.Minute, 5 * time.Minute},
		{3, 30 * time.Second, 30 * time.Minute, 2 * time.Minute},
		{7, 30 * time.Second, 30 * time.Minute, 30 * time.Minute},
	}
	for _, tc := range cases {
		if got := engine().backoff(tc.attempt, tc.base, tc.max); got != tc.want {
			t.Errorf("backoff(%d, %s, %s) = %s, want %s", tc.attempt, tc.base, tc.max, got, tc.want)
		}
		jittered := &Engine{}
		for range 200 {
			got := jittered.backoff(tc.attempt, tc.base, tc.max)
			lo, hi := time.Duration(float64(tc.want)*0.8), time.Duration(float64(tc.want)*1.2)
			if got < lo || got > hi+time.Nanosecond {
				t.Fatalf("jittered backoff(%d) = %s, want within [%s, %s]", tc.attempt, got, lo, hi)
			}
		}
	}
}
