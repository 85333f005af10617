// Package reconcile is the orchestrator's state machine, the reconcile
// rules of docs/orchestrator.md on a claimed queue: Decide looks at a claimed
// proxy and picks the next provisioner command (or none); Apply folds a
// command's result into the proxy; ApplyHealth folds in a health verdict.
// All three only change the row they are given; the caller stores it and
// dispatches the command after commit.
package reconcile

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/google/uuid"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// Timing is the engine's schedule.
type Timing struct {
	// Deadlines per operation: a command unanswered by then is issued again.
	CreateDeadline, GetDeadline, DeleteDeadline time.Duration
	// ProvisioningPoll is how often an instance without an address is read.
	ProvisioningPoll time.Duration
	// Resync is how often a running instance is read to notice it vanished.
	Resync time.Duration
	// DeletionPoll is how often a deleted instance is read until it is gone.
	DeletionPoll time.Duration
	// Transient errors back off exponentially from TransientBase to
	// TransientMax; quota errors from QuotaBase to QuotaMax. Both with ±20%
	// jitter.
	TransientBase, TransientMax time.Duration
	QuotaBase, QuotaMax         time.Duration
	// UnconfiguredRetry is how often a proxy whose provider is missing from
	// the config is looked at again.
	UnconfiguredRetry time.Duration
	// StoppedGrace is how long an instance may stay stopped before it is
	// replaced; 0 never replaces it.
	StoppedGrace time.Duration
}

// DefaultTiming is the production schedule.
func DefaultTiming() Timing {
	return Timing{
		CreateDeadline:    20 * time.Minute,
		GetDeadline:       2 * time.Minute,
		DeleteDeadline:    15 * time.Minute,
		ProvisioningPoll:  2 * time.Second,
		Resync:            5 * time.Minute,
		DeletionPoll:      2 * time.Second,
		TransientBase:     time.Second,
		TransientMax:      5 * time.Minute,
		QuotaBase:         30 * time.Second,
		QuotaMax:          30 * time.Minute,
		UnconfiguredRetry: time.Minute,
		StoppedGrace:      5 * time.Minute,
	}
}

// Engine decides and applies.
type Engine struct {
	Timing Timing
	// Configured reports whether a provider is in the providers config.
	Configured func(string) bool
	Log        *slog.Logger
	// NoJitter turns off the ±20% jitter of the backoffs; tests set it.
	NoJitter bool
}

// backoff is base·2^(attempt-1), capped at max, with ±20% jitter.
func (e *Engine) backoff(attempt int32, base, max time.Duration) time.Duration {
	b := &backoff.ExponentialBackOff{InitialInterval: base, Multiplier: 2, MaxInterval: max, RandomizationFactor: 0.2}
	if e.NoJitter {
		b.RandomizationFactor = 0
	}
	// The attempt count is stored with the proxy, not the backoff: step to
	// its interval (the cap is reached long before 64 doublings).
	d := b.NextBackOff()
	for i := int32(1); i < min(attempt, 64); i++ {
		d = b.NextBackOff()
	}
	return d
}

func at(t time.Time) *time.Time { return &t }

// Decision is what Decide concluded.
type Decision struct {
	// Command to dispatch after the row is stored; nil for none.
	Command *busv1.Command
	// Release means the proxy is gone: delete the row.
	Release bool
}

// Unsent takes back r's command, which never reached JetStream (NATS was
// unreachable): it counts as a failed attempt and the step is decided
// again after the transient backoff, instead of at the command's deadline
// (up to 20 minutes for a Create).
func (e *Engine) Unsent(r *store.Row, now time.Time) {
	r.CommandID, r.CommandDeadline = "", nil
	r.Attempts++
	r.NextAttemptTime = at(now.Add(e.backoff(r.Attempts, e.Timing.TransientBase, e.Timing.TransientMax)))
}

// Decide runs the state machine on a claimed proxy at now.
func (e *Engine) Decide(r *store.Row, now time.Time) Decision {
	if r.CommandID != "" {
		if r.CommandDeadline != nil && r.CommandDeadline.After(now) {
			r.NextAttemptTime = r.CommandDeadline
			return Decision{}
		}
		e.Log.Warn("command unanswered past its deadline; issuing it again",
			"proxy", r.Name, "uid", r.UID, "step", r.CommandStep.String(), "command", r.CommandID)
		r.CommandID, r.CommandDeadline = "", nil
		r.Attempts++
	}
	if r.Deleting() {
		return e.decideDelete(r, now)
	}
	if r.Spec.GetMode() == proxyv1.ProxyMode_PROXY_MODE_EXTERNAL {
		r.NextAttemptTime, r.CommandStep = nil, store.StepNone
		return Decision{}
	}
	if !e.Configured(r.Spec.GetProvider()) {
		r.Reason = "ProviderNotConfigured"
		r.Message = fmt.Sprintf("provider %q is not in the providers config", r.Spec.GetProvider())
		r.NextAttemptTime = at(now.Add(e.Timing.UnconfiguredRetry))
		return Decision{}
	}
	if r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_FAILED && r.FailedSpecHash == r.SpecHash {
		// Latched until the spec changes.
		r.NextAttemptTime = nil
		return Decision{}
	}
	r.ObservedGeneration = r.Generation
	switch {
	case r.CommandStep == store.StepReplacePoll && r.ProviderID != "":
		return e.issue(r, store.StepReplacePoll, now)
	case r.ProviderID == "":
		r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
		if r.Reason != "Retrying" && r.Reason != "QuotaExceeded" {
			r.Reason, r.Message = "Provisioning", ""
		}
		return e.issue(r, store.StepCreate, now)
	case r.InstanceSpecHash != r.SpecHash:
		r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
		r.Reason, r.Message = "Replacing", "the spec changed; replacing the instance"
		return e.issue(r, store.StepReplaceDelete, now)
	case e.stoppedTooLong(r, now):
		// It cannot serve and nobody started it again (a Proxmox VM whose
		// guest agent was switched off can never report an address):
		// replace it, as a spec change would.
		e.Log.Warn("WARNING: instance stopped for longer than the grace period; replacing it",
			"proxy", r.Name, "uid", r.UID, "providerID", r.ProviderID, "stoppedSince", *r.StoppedSince, "grace", e.Timing.StoppedGrace)
		r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
		r.Reason = "InstanceStopped"
		r.Message = fmt.Sprintf("the instance has been stopped since %s, longer than the %s grace period; replacing it",
			r.StoppedSince.UTC().Format(time.RFC3339), e.Timing.StoppedGrace)
		return e.issue(r, store.StepReplaceDelete, now)
	default:
		return e.issue(r, store.StepPoll, now)
	}
}

// decideDelete applies the deletion rules (docs/orchestrator.md, Deletion).
func (e *Engine) decideDelete(r *store.Row, now time.Time) Decision {
	r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_DELETING, now)
	switch {
	case r.ProviderID == "":
		// Nothing was recorded as created; orphan GC reaps any stray
		// instance a cut-off create left behind.
		return Decision{Release: true}
	case r.SkipCleanup:
		// Checked before the provider lookup, so it also frees a proxy
		// whose provider is gone. The instance is left running.
		e.Log.Info("skip_cleanup set; abandoning the instance", "proxy", r.Name, "uid", r.UID,
			"provider", r.Spec.GetProvider(), "providerID", r.ProviderID)
		return Decision{Release: true}
	case !e.Configured(r.Spec.GetProvider()):
		r.Reason = "ProviderNotConfigured"
		r.Message = fmt.Sprintf("provider %q is not configured; cannot clean up instance %s; delete again with skip_cleanup to abandon it",
			r.Spec.GetProvider(), r.ProviderID)
		r.NextAttemptTime = at(now.Add(e.Timing.UnconfiguredRetry))
		return Decision{}
	}
	switch r.CommandStep {
	case store.StepCleanupDelete, store.StepCleanupDeleteRelease:
		return e.issue(r, r.CommandStep, now)
	default:
		return e.issue(r, store.StepCleanupGet, now)
	}
}

// issue records step as the proxy's in-flight command and builds it.
func (e *Engine) issue(r *store.Row, step store.Step, now time.Time) Decision {
	cmd := &busv1.Command{
		CommandId: uuid.NewString(),
		ProxyUid:  r.UID,
		Provider:  r.Spec.GetProvider(),
		IssueTime: timestamppb.New(now),
		Attempt:   uint32(r.Attempts + 1),
		Purpose:   busv1.CommandPurpose_COMMAND_PURPOSE_RECONCILE,
	}
	var deadline time.Duration
	switch step {
	case store.StepCreate:
		cmd.Operation, cmd.SpecHash, deadline = busv1.Operation_OPERATION_CREATE, r.SpecHash, e.Timing.CreateDeadline
		cmd.Request = &busv1.Command_Create{Create: &provisionerv1.CreateInstanceRequest{
			Provider:  r.Spec.GetProvider(),
			ProxyUid:  r.UID,
			ProxyName: r.Name,
			Placement: r.Spec.GetPlacement(),
			CloudInit: r.Spec.GetCloudInit(),
			Port:      r.Spec.GetPort(),
			SpecHash:  r.SpecHash,
		}}
	case store.StepPoll, store.StepReplacePoll, store.StepCleanupGet:
		cmd.Operation, cmd.SpecHash, deadline = busv1.Operation_OPERATION_GET, r.InstanceSpecHash, e.Timing.GetDeadline
		cmd.Request = &busv1.Command_Get{Get: &provisionerv1.GetInstanceRequest{
			Provider: r.Spec.GetProvider(), ProviderId: r.ProviderID, ProxyUid: r.UID,
		}}
	default:
		cmd.Operation, cmd.SpecHash, deadline = busv1.Operation_OPERATION_DELETE, r.InstanceSpecHash, e.Timing.DeleteDeadline
		cmd.Request = &busv1.Command_Delete{Delete: &provisionerv1.DeleteInstanceRequest{
			Provider: r.Spec.GetProvider(), ProviderId: r.ProviderID, ProxyUid: r.UID,
		}}
	}
	cmd.Deadline = timestamppb.New(now.Add(deadline))
	r.CommandID = cmd.GetCommandId()
	r.CommandStep = step
	r.CommandSpecHash = cmd.GetSpecHash()
	r.CommandIssueTime = at(now)
	r.CommandDeadline = at(now.Add(deadline))
	r.NextAttemptTime = r.CommandDeadline
	return Decision{Command: cmd}
}

// Outcome says what Apply did with a result.
type Outcome int

// The outcomes.
const (
	// Applied: the row changed; store it.
	Applied Outcome = iota
	// Stale: the result answers a command that is no longer the proxy's
	// current one (superseded after its deadline); nothing changed.
	Stale
	// Released: the proxy is gone; delete the row.
	Released
)

// Apply folds a command result into the proxy it answers.
func (e *Engine) Apply(r *store.Row, res *busv1.CommandResult, now time.Time) Outcome {
	if res.GetCommandId() != r.CommandID {
		return Stale
	}
	step := r.CommandStep
	r.CommandID, r.CommandDeadline, r.CommandIssueTime = "", nil, nil
	r.CommandStep = store.StepNone
	err := errclass.FromCommandError(res.GetError())
	class := errclass.Of(err)

	if err != nil && class != errclass.NotFound {
		return e.applyFailure(r, step, res, err, now)
	}
	r.Attempts = 0
	switch step {
	case store.StepCreate:
		inst := res.GetCreate().GetInstance()
		if err != nil { // NotFound from Create: nothing to record; retry
			return e.applyFailure(r, step, res, err, now)
		}
		r.ProviderID = inst.GetProviderId()
		// The instance has the spec its command was issued for; when the
		// spec changed meanwhile, the next Decide replaces it.
		r.InstanceSpecHash = res.GetSpecHash()
		r.Healthy = false
		e.setInstance(r, inst, now)
	case store.StepPoll:
		if err != nil {
			e.Log.Info("instance gone; creating it again", "proxy", r.Name, "uid", r.UID, "providerID", r.ProviderID)
			e.clearInstance(r)
			r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
			r.Reason, r.Message = "InstanceLost", "the instance disappeared from the provider; creating it again"
			r.NextAttemptTime = at(now)
			break
		}
		e.setInstance(r, res.GetGet().GetInstance(), now)
	case store.StepReplaceDelete, store.StepReplacePoll:
		if err != nil { // gone: create the replacement
			e.clearInstance(r)
			r.NextAttemptTime = at(now)
			break
		}
		r.CommandStep = store.StepReplacePoll
		r.NextAttemptTime = at(now.Add(e.Timing.DeletionPoll))
	case store.StepCleanupGet:
		if err != nil {
			return Released
		}
		r.CommandStep = store.StepCleanupDelete
		r.NextAttemptTime = at(now)
	case store.StepCleanupDelete:
		// Deleted; read it again until the provider says it is gone.
		r.NextAttemptTime = at(now.Add(e.Timing.DeletionPoll))
		r.Reason, r.Message = "Deleting", ""
	case store.StepCleanupDeleteRelease:
		e.Log.Info("instance unreachable but cleanup succeeded; releasing the proxy",
			"proxy", r.Name, "uid", r.UID, "providerID", r.ProviderID, "getError", r.Message)
		return Released
	}
	if r.Deleting() && r.CommandStep == store.StepNone && step != store.StepCleanupDelete {
		r.NextAttemptTime = at(now)
	}
	if !r.Deleting() && r.ObservedGeneration < r.Generation {
		// The proxy was updated while the command was in flight.
		r.NextAttemptTime = at(now)
	}
	return Applied
}

func (e *Engine) applyFailure(r *store.Row, step store.Step, res *busv1.CommandResult, err error, now time.Time) Outcome {
	class := errclass.Of(err)
	r.Message = err.Error()
	if r.Deleting() {
		if step == store.StepCleanupGet && class == errclass.Permanent {
			// Get will never answer for this instance; Delete is idempotent
			// and may still finish, so try it and release when it does.
			r.CommandStep = store.StepCleanupDeleteRelease
			r.Reason = "CleanupGetFailed"
			r.NextAttemptTime = at(now)
			return Applied
		}
		if step == store.StepCleanupDeleteRelease {
			r.Message = "get and delete both failed: " + err.Error()
		}
		// Deletion never gives up on its own: retry with backoff until it
		// succeeds or skip_cleanup abandons the instance.
		r.Attempts++
		r.Reason = "CleanupFailed"
		r.NextAttemptTime = at(now.Add(e.retryDelay(r, class)))
		return Applied
	}
	switch class {
	case errclass.Permanent:
		r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_FAILED, now)
		r.Reason = "ProviderError"
		r.FailedSpecHash = r.SpecHash
		if step == store.StepCreate {
			r.FailedSpecHash = res.GetSpecHash()
		}
		r.Attempts = 0
		if r.FailedSpecHash == r.SpecHash {
			r.NextAttemptTime = nil
		} else {
			r.NextAttemptTime = at(now) // the spec already changed
		}
	case errclass.QuotaExceeded:
		r.Attempts++
		r.Reason = "QuotaExceeded"
		r.NextAttemptTime = at(now.Add(e.retryDelay(r, class)))
	default:
		r.Attempts++
		r.Reason = "Retrying"
		r.NextAttemptTime = at(now.Add(e.retryDelay(r, class)))
	}
	if step == store.StepReplacePoll {
		r.CommandStep = store.StepReplacePoll
	}
	return Applied
}

func (e *Engine) retryDelay(r *store.Row, class errclass.Class) time.Duration {
	if class == errclass.QuotaExceeded {
		return e.backoff(r.Attempts, e.Timing.QuotaBase, e.Timing.QuotaMax)
	}
	return e.backoff(r.Attempts, e.Timing.TransientBase, e.Timing.TransientMax)
}

// stoppedTooLong reports whether r's instance has been stopped for the
// grace period.
func (e *Engine) stoppedTooLong(r *store.Row, now time.Time) bool {
	return e.Timing.StoppedGrace > 0 && r.StoppedSince != nil && now.Sub(*r.StoppedSince) >= e.Timing.StoppedGrace
}

func (e *Engine) clearInstance(r *store.Row) {
	r.StoppedSince = nil
	r.ProviderID, r.IP, r.InstanceSpecHash = "", "", ""
	r.Healthy = false
	r.CommandStep = store.StepNone
}

// setInstance records what the provider reported about a live instance and
// schedules the next read.
func (e *Engine) setInstance(r *store.Row, inst *provisionerv1.Instance, now time.Time) {
	if inst.GetProviderId() != "" {
		r.ProviderID = inst.GetProviderId()
	}
	r.IP = inst.GetIp()
	switch {
	case inst.GetState() == provisionerv1.InstanceState_INSTANCE_STATE_RUNNING && r.IP != "":
		if r.Healthy {
			r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_READY, now)
			r.Reason, r.Message = "Healthy", ""
		} else {
			r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, now)
			r.Reason, r.Message = "Running", ""
		}
		r.NextAttemptTime = at(now.Add(e.Timing.Resync))
	case inst.GetState() == provisionerv1.InstanceState_INSTANCE_STATE_FAILED:
		r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_FAILED, now)
		r.Reason, r.Message = "InstanceFailed", "the provider reports the instance failed"
		r.FailedSpecHash = r.SpecHash
		r.NextAttemptTime = nil
	case inst.GetState() == provisionerv1.InstanceState_INSTANCE_STATE_STOPPED:
		r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
		if r.StoppedSince == nil {
			r.StoppedSince = at(now)
		}
		r.Reason, r.Message = "InstanceStopped", "the instance exists but is not running"
		r.NextAttemptTime = at(now.Add(e.Timing.ProvisioningPoll))
		if e.Timing.StoppedGrace > 0 {
			// The message stays the same while it waits, so polling a
			// stopped instance writes no new revision.
			replaceAt := r.StoppedSince.Add(e.Timing.StoppedGrace)
			r.Message += fmt.Sprintf("; it is replaced at %s unless it starts", replaceAt.UTC().Format(time.RFC3339))
			if replaceAt.Before(*r.NextAttemptTime) {
				r.NextAttemptTime = at(replaceAt)
			}
		}
	default:
		r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
		r.Reason, r.Message = "WaitingForAddress", ""
		r.NextAttemptTime = at(now.Add(e.Timing.ProvisioningPoll))
	}
	if inst.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_STOPPED {
		r.StoppedSince = nil
	}
}

// ApplyHealth folds a health transition into the proxy: Running becomes
// Ready when healthy and back. It reports whether anything changed. A
// verdict about another instance, or older than the last applied, is
// ignored.
func (e *Engine) ApplyHealth(r *store.Row, tr *healthv1.HealthTransition, now time.Time) bool {
	if tr.GetProviderId() != r.ProviderID || tr.GetSequence() <= r.HealthSequence {
		return false
	}
	r.HealthSequence = tr.GetSequence()
	if r.Healthy != tr.GetHealthy() {
		r.Healthy = tr.GetHealthy()
		r.HealthTransitionTime = at(now)
		if tr.GetTransitionTime() != nil {
			r.HealthTransitionTime = at(tr.GetTransitionTime().AsTime())
		}
	}
	r.ProbeLatency = tr.GetLatency().AsDuration()
	switch {
	case r.Healthy && r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING:
		r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_READY, now)
		r.Reason, r.Message = "Healthy", ""
	case !r.Healthy && r.Phase == proxyv1.ProxyPhase_PROXY_PHASE_READY:
		r.SetPhase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, now)
		r.Reason, r.Message = "Unhealthy", tr.GetMessage()
	}
	return true
}
