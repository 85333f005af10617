package lifecycle

import (
	"fmt"
	"time"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// Outcome says what Apply did with a result.
type Outcome int

// The outcomes.
const (
	// Applied: the proxy changed; store it.
	Applied Outcome = iota
	// Stale: the result answers a command that is no longer the proxy's
	// current one (superseded after its deadline, or delivered twice);
	// nothing changed.
	Stale
	// Released: the proxy is gone; delete it.
	Released
)

// Apply folds a provisioner's result into the proxy whose command it
// answers (docs/orchestrator.md, the result table). A proxy left due
// (NextAttemptTime at or before now) is to be decided again at once.
func (m *Machine) Apply(p *Proxy, res *busv1.CommandResult, now time.Time) Outcome {
	if res.GetCommandId() != p.CommandID {
		return Stale
	}
	step := p.CommandStep
	p.CommandID, p.CommandDeadline, p.CommandIssueTime = "", nil, nil
	p.CommandStep = StepNone
	err := errclass.FromCommandError(res.GetError())
	class := errclass.Of(err)

	if err != nil && class != errclass.NotFound {
		return m.applyFailure(p, step, res, err, now)
	}
	p.Attempts = 0
	switch step {
	case StepCreate:
		inst := res.GetCreate().GetInstance()
		if err != nil { // NotFound from Create: nothing to record; retry
			return m.applyFailure(p, step, res, err, now)
		}
		p.ProviderID = inst.GetProviderId()
		// The instance has the spec its command was issued for; when the
		// spec changed meanwhile, the next Decide replaces it.
		p.InstanceSpecHash = res.GetSpecHash()
		p.Healthy = false
		m.setInstance(p, inst, now)
	case StepPoll:
		if err != nil {
			m.Log.Info("instance gone; creating it again", "proxy_name", p.Name, "proxy_uid", p.UID, "provider_id", p.ProviderID)
			clearInstance(p)
			renewCredentials(p, now)
			p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
			p.Reason, p.Message = ReasonInstanceLost, "the instance disappeared from the provider; creating it again"
			p.NextAttemptTime = at(now)
			break
		}
		m.setInstance(p, res.GetGet().GetInstance(), now)
	case StepUpdateCredentials:
		if err != nil { // gone meanwhile: create it again, with new ones
			clearInstance(p)
			renewCredentials(p, now)
			p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
			p.Reason, p.Message = ReasonInstanceLost, "the instance disappeared from the provider; creating it again"
			p.NextAttemptTime = at(now)
			break
		}
		p.CredentialsStale = false
		p.Healthy = false // probed again, with the new credentials
		m.setInstance(p, res.GetUpdateCredentials().GetInstance(), now)
	case StepReplaceDelete, StepReplacePoll:
		if err != nil { // gone: create the replacement, with new credentials
			clearInstance(p)
			renewCredentials(p, now)
			p.NextAttemptTime = at(now)
			break
		}
		p.CommandStep = StepReplacePoll
		p.NextAttemptTime = at(now.Add(m.Timing.DeletionPoll))
	case StepCleanupGet:
		if err != nil {
			return Released
		}
		p.CommandStep = StepCleanupDelete
		p.NextAttemptTime = at(now)
	case StepCleanupDelete:
		// Deleted; read it again until the provider says it is gone.
		p.NextAttemptTime = at(now.Add(m.Timing.DeletionPoll))
		p.Reason, p.Message = ReasonDeleting, ""
	case StepCleanupDeleteRelease:
		m.Log.Info("instance unreachable but cleanup succeeded; releasing the proxy",
			"proxy_name", p.Name, "proxy_uid", p.UID, "provider_id", p.ProviderID, "getError", p.Message)
		return Released
	}
	if p.Deleting() && p.CommandStep == StepNone && step != StepCleanupDelete {
		p.NextAttemptTime = at(now)
	}
	if !p.Deleting() && p.ObservedGeneration < p.Generation {
		// The proxy was updated while the command was in flight.
		p.NextAttemptTime = at(now)
	}
	return Applied
}

func (m *Machine) applyFailure(p *Proxy, step Step, res *busv1.CommandResult, err error, now time.Time) Outcome {
	class := errclass.Of(err)
	p.Message = err.Error()
	if step == StepUpdateCredentials && class == errclass.Unsupported && !p.Deleting() {
		// The provider cannot change them in place: replace the instance.
		p.CommandStep = StepReplaceDelete
		p.Reason, p.Message = ReasonRotatingCredentials, rotatingMessage
		p.NextAttemptTime = at(now)
		return Applied
	}
	if p.Deleting() {
		if step == StepCleanupGet && class == errclass.Permanent {
			// Get will never answer for this instance; Delete is idempotent
			// and may still finish, so try it and release when it does.
			p.CommandStep = StepCleanupDeleteRelease
			p.Reason = ReasonCleanupGetFailed
			p.NextAttemptTime = at(now)
			return Applied
		}
		if step == StepCleanupDeleteRelease {
			p.Message = "get and delete both failed: " + err.Error()
		}
		// Deletion never gives up on its own: retry with backoff until it
		// succeeds or skip_cleanup abandons the instance.
		p.Attempts++
		p.Reason = ReasonCleanupFailed
		p.NextAttemptTime = at(now.Add(m.retryDelay(p, class)))
		return Applied
	}
	switch class {
	case errclass.Permanent:
		p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_FAILED, now)
		p.Reason = ReasonProviderError
		p.FailedSpecHash = p.SpecHash
		if step == StepCreate {
			p.FailedSpecHash = res.GetSpecHash()
		}
		p.Attempts = 0
		if p.FailedSpecHash == p.SpecHash {
			p.NextAttemptTime = nil
		} else {
			p.NextAttemptTime = at(now) // the spec already changed
		}
	case errclass.QuotaExceeded:
		p.Attempts++
		p.Reason = ReasonQuotaExceeded
		p.NextAttemptTime = at(now.Add(m.retryDelay(p, class)))
	default:
		p.Attempts++
		p.Reason = ReasonRetrying
		p.NextAttemptTime = at(now.Add(m.retryDelay(p, class)))
	}
	if step == StepReplacePoll {
		p.CommandStep = StepReplacePoll
	}
	return Applied
}

// clearInstance forgets p's instance: the next decision creates one.
func clearInstance(p *Proxy) {
	p.StoppedSince = nil
	p.ProviderID, p.IP, p.InstanceSpecHash = "", "", ""
	p.Healthy = false
	p.CommandStep = StepNone
}

// setInstance records what the provider reported about a live instance and
// schedules the next read.
func (m *Machine) setInstance(p *Proxy, inst *provisionerv1.Instance, now time.Time) {
	if inst.GetProviderId() != "" {
		p.ProviderID = inst.GetProviderId()
	}
	p.IP = inst.GetIp()
	switch {
	case inst.GetState() == provisionerv1.InstanceState_INSTANCE_STATE_RUNNING && p.IP != "":
		if p.Healthy {
			p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_READY, now)
			p.Reason, p.Message = ReasonHealthy, ""
		} else {
			p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, now)
			p.Reason, p.Message = ReasonRunning, ""
		}
		p.NextAttemptTime = at(now.Add(m.Timing.Resync))
	case inst.GetState() == provisionerv1.InstanceState_INSTANCE_STATE_FAILED:
		p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_FAILED, now)
		p.Reason, p.Message = ReasonInstanceFailed, "the provider reports the instance failed"
		p.FailedSpecHash = p.SpecHash
		p.NextAttemptTime = nil
	case inst.GetState() == provisionerv1.InstanceState_INSTANCE_STATE_STOPPED:
		p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
		if p.StoppedSince == nil {
			p.StoppedSince = at(now)
		}
		p.Reason, p.Message = ReasonInstanceStopped, "the instance exists but is not running"
		p.NextAttemptTime = at(now.Add(m.Timing.ProvisioningPoll))
		if m.Timing.StoppedGrace > 0 {
			// The message stays the same while it waits, so polling a
			// stopped instance writes no new revision.
			replaceAt := p.StoppedSince.Add(m.Timing.StoppedGrace)
			p.Message += fmt.Sprintf("; it is replaced at %s unless it starts", replaceAt.UTC().Format(time.RFC3339))
			if replaceAt.Before(*p.NextAttemptTime) {
				p.NextAttemptTime = at(replaceAt)
			}
		}
	default:
		p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
		p.Reason, p.Message = ReasonWaitingForAddress, ""
		p.NextAttemptTime = at(now.Add(m.Timing.ProvisioningPoll))
	}
	if inst.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_STOPPED {
		p.StoppedSince = nil
	}
}
