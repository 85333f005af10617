package lifecycle

import (
	"fmt"
	"time"

	"github.com/google/uuid"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// Decision is what Decide concluded.
type Decision struct {
	// Command to publish once the proxy is stored; nil for none.
	Command *busv1.Command
	// Release means the proxy is gone: delete it.
	Release bool
}

// Decide runs the state machine on a proxy claimed from the queue at now
// (docs/orchestrator.md, "The state machine"): it picks the next command,
// records it as in flight, and schedules the next look.
func (m *Machine) Decide(p *Proxy, now time.Time) Decision {
	if p.CommandID != "" {
		if p.CommandDeadline != nil && p.CommandDeadline.After(now) {
			p.NextAttemptTime = p.CommandDeadline
			return Decision{}
		}
		m.Log.Warn("command unanswered past its deadline; issuing it again",
			"proxy_name", p.Name, "proxy_uid", p.UID, "step", p.CommandStep.String(), "command", p.CommandID)
		p.CommandID, p.CommandDeadline = "", nil
		p.Attempts++
	}
	if p.Deleting() {
		return m.decideDelete(p, now)
	}
	if p.Spec.GetMode() == proxyv1.ProxyMode_PROXY_MODE_EXTERNAL {
		p.NextAttemptTime, p.CommandStep = nil, StepNone
		return Decision{}
	}
	if !m.Configured(p.Spec.GetProvider()) {
		p.Reason = ReasonProviderNotConfigured
		p.Message = fmt.Sprintf("provider %q is not in the providers config", p.Spec.GetProvider())
		p.NextAttemptTime = at(now.Add(m.Timing.UnconfiguredRetry))
		return Decision{}
	}
	if p.Phase == proxyv1.ProxyPhase_PROXY_PHASE_FAILED && p.FailedSpecHash == p.SpecHash {
		// Latched until the spec changes.
		p.NextAttemptTime = nil
		return Decision{}
	}
	p.ObservedGeneration = p.Generation
	switch {
	case p.CommandStep == StepReplacePoll && p.ProviderID != "":
		return m.issue(p, StepReplacePoll, now)
	case p.ProviderID == "":
		p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
		if p.Reason != ReasonRetrying && p.Reason != ReasonQuotaExceeded {
			p.Reason, p.Message = ReasonProvisioning, ""
		}
		return m.issue(p, StepCreate, now)
	case p.InstanceSpecHash != p.SpecHash:
		p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
		p.Reason, p.Message = ReasonReplacing, "the spec changed; replacing the instance"
		return m.issue(p, StepReplaceDelete, now)
	case p.CredentialsStale:
		p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
		if p.CommandStep == StepReplaceDelete {
			// The provider said it cannot change them in place.
			p.Reason, p.Message = ReasonRotatingCredentials, rotatingMessage
			return m.issue(p, StepReplaceDelete, now)
		}
		p.Reason, p.Message = ReasonRotatingCredentials, rotatingInPlaceMessage
		return m.issue(p, StepUpdateCredentials, now)
	case m.stoppedTooLong(p, now):
		// It cannot serve and nobody started it again (a Proxmox VM whose
		// guest agent was switched off can never report an address):
		// replace it, as a spec change would.
		m.Log.Warn("WARNING: instance stopped for longer than the grace period; replacing it",
			"proxy_name", p.Name, "proxy_uid", p.UID, "provider_id", p.ProviderID, "stoppedSince", *p.StoppedSince, "grace", m.Timing.StoppedGrace)
		p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
		p.Reason = ReasonInstanceStopped
		p.Message = fmt.Sprintf("the instance has been stopped since %s, longer than the %s grace period; replacing it",
			p.StoppedSince.UTC().Format(time.RFC3339), m.Timing.StoppedGrace)
		return m.issue(p, StepReplaceDelete, now)
	default:
		return m.issue(p, StepPoll, now)
	}
}

// decideDelete applies the deletion rules (docs/orchestrator.md, Deletion).
func (m *Machine) decideDelete(p *Proxy, now time.Time) Decision {
	p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_DELETING, now)
	switch {
	case nothingToCleanUp(p):
		if p.ProviderID != "" {
			m.Log.Info("skip_cleanup set; abandoning the instance", "proxy_name", p.Name, "proxy_uid", p.UID,
				"provider", p.Spec.GetProvider(), "provider_id", p.ProviderID)
		}
		return Decision{Release: true}
	case !m.Configured(p.Spec.GetProvider()):
		p.Reason = ReasonProviderNotConfigured
		p.Message = fmt.Sprintf("provider %q is not configured; cannot clean up instance %s; delete again with skip_cleanup to abandon it",
			p.Spec.GetProvider(), p.ProviderID)
		p.NextAttemptTime = at(now.Add(m.Timing.UnconfiguredRetry))
		return Decision{}
	}
	switch p.CommandStep {
	case StepCleanupDelete, StepCleanupDeleteRelease:
		return m.issue(p, p.CommandStep, now)
	default:
		return m.issue(p, StepCleanupGet, now)
	}
}

// stoppedTooLong reports whether p's instance has been stopped for the
// grace period.
func (m *Machine) stoppedTooLong(p *Proxy, now time.Time) bool {
	return m.Timing.StoppedGrace > 0 && p.StoppedSince != nil && now.Sub(*p.StoppedSince) >= m.Timing.StoppedGrace
}

// issue records step as p's in-flight command and builds it.
func (m *Machine) issue(p *Proxy, step Step, now time.Time) Decision {
	cmd := &busv1.Command{
		CommandId: uuid.NewString(),
		ProxyUid:  p.UID,
		Provider:  p.Spec.GetProvider(),
		IssueTime: timestamppb.New(now),
		Attempt:   uint32(p.Attempts + 1),
		Purpose:   busv1.CommandPurpose_COMMAND_PURPOSE_RECONCILE,
	}
	var deadline time.Duration
	switch step {
	case StepCreate:
		if p.Credentials == nil && WantsCredentials(p.Spec) {
			// A proxy from before credentials gets its first ones with
			// its next instance.
			p.Credentials = GenerateCredentials(now)
		}
		p.CredentialsStale = false
		cmd.Operation, cmd.SpecHash, deadline = busv1.Operation_OPERATION_CREATE, p.SpecHash, m.Timing.CreateDeadline
		cmd.Request = &busv1.Command_Create{Create: &provisionerv1.CreateInstanceRequest{
			Provider:  p.Spec.GetProvider(),
			ProxyUid:  p.UID,
			ProxyName: p.Name,
			Placement: p.Spec.GetPlacement(),
			CloudInit: p.Spec.GetCloudInit(),
			Port:      p.Spec.GetPort(),
			SpecHash:  p.SpecHash,

			Installation: m.Installation,
		}}
		// The instance listens where its Create says, whatever the spec
		// says by the time the result arrives.
		p.Port = p.Spec.GetPort()
	case StepUpdateCredentials:
		cmd.Operation, cmd.SpecHash, deadline = busv1.Operation_OPERATION_UPDATE_CREDENTIALS, p.InstanceSpecHash, m.Timing.GetDeadline
		cmd.Request = &busv1.Command_UpdateCredentials{UpdateCredentials: &provisionerv1.UpdateCredentialsRequest{
			Provider: p.Spec.GetProvider(), ProviderId: p.ProviderID, ProxyUid: p.UID, Installation: m.Installation,
		}}
	case StepPoll, StepReplacePoll, StepCleanupGet:
		cmd.Operation, cmd.SpecHash, deadline = busv1.Operation_OPERATION_GET, p.InstanceSpecHash, m.Timing.GetDeadline
		cmd.Request = &busv1.Command_Get{Get: &provisionerv1.GetInstanceRequest{
			Provider: p.Spec.GetProvider(), ProviderId: p.ProviderID, ProxyUid: p.UID, Installation: m.Installation,
		}}
	default:
		cmd.Operation, cmd.SpecHash, deadline = busv1.Operation_OPERATION_DELETE, p.InstanceSpecHash, m.Timing.DeleteDeadline
		cmd.Request = &busv1.Command_Delete{Delete: &provisionerv1.DeleteInstanceRequest{
			Provider: p.Spec.GetProvider(), ProviderId: p.ProviderID, ProxyUid: p.UID, Installation: m.Installation,
		}}
	}
	cmd.Deadline = timestamppb.New(now.Add(deadline))
	p.CommandID = cmd.GetCommandId()
	p.CommandStep = step
	p.CommandSpecHash = cmd.GetSpecHash()
	p.CommandIssueTime = at(now)
	p.CommandDeadline = at(now.Add(deadline))
	p.NextAttemptTime = p.CommandDeadline
	return Decision{Command: cmd}
}

// Unsent takes back p's command, which never reached JetStream (NATS
// refused or could not store it): it counts as a failed attempt and the
// step is decided again after the transient backoff, instead of at the
// command's deadline (up to 20 minutes for a Create).
func (m *Machine) Unsent(p *Proxy, now time.Time) {
	p.CommandID, p.CommandDeadline = "", nil
	p.Attempts++
	p.NextAttemptTime = at(now.Add(m.backoff(p.Attempts, m.Timing.TransientBase, m.Timing.TransientMax)))
}

// settled reports whether the reconciler waits for nothing but the next
// resync or a spec change: no command in flight, not being deleted, and
// RUNNING, READY or FAILED.
func settled(p *Proxy) bool {
	switch p.Phase {
	case proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, proxyv1.ProxyPhase_PROXY_PHASE_READY, proxyv1.ProxyPhase_PROXY_PHASE_FAILED:
		return p.CommandID == "" && !p.Deleting()
	}
	return false
}

// EndSettledTrace ends the trace of the change p's reconciler worked on
// once p settled: later resyncs start traces of their own. Dispatch calls
// it on every proxy it stores after a decision or a result.
func EndSettledTrace(p *Proxy) {
	if settled(p) {
		p.TraceParent = ""
	}
}
