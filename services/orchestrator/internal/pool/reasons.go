package pool

import "github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"

// Why the controller drains or deletes a proxy: Action.Reason, the
// reason label of egress_pool_actions_total and of the controller's log
// lines.
const (
	// RemoveFailed: the proxy is FAILED.
	RemoveFailed = "Failed"
	// RemoveQuotaExceeded: its provider is out of quota (the proxy's
	// reason is lifecycle.ReasonQuotaExceeded).
	RemoveQuotaExceeded = string(lifecycle.ReasonQuotaExceeded)
	// RemoveUnhealthy: not Ready for longer than unhealthy_grace.
	RemoveUnhealthy = "Unhealthy"
	// RemoveNotInSpread: its provider and zone are no spread target now.
	RemoveNotInSpread = "NotInSpread"
	// RemoveScaleDown: more proxies than desired.
	RemoveScaleDown = "ScaleDown"
	// RemoveTemplateChanged: made from an older template.
	RemoveTemplateChanged = "TemplateChanged"
	// RemoveMaxAge: older than max_age.
	RemoveMaxAge = "MaxAge"
	// RemoveRebalance: beyond its target's share while another target
	// lacks proxies.
	RemoveRebalance = "Rebalance"
	// RemoveDrainedNoLeases: draining, and its leases ended.
	RemoveDrainedNoLeases = "DrainedNoLeases"
	// RemoveDrainTimeout: draining past its drain deadline.
	RemoveDrainTimeout = "DrainTimeout"
)

// Why the pool's desired count changed: ScalingDecision.reason, in the
// pool's status.last_scaling_decision.
const (
	// ScaleScaled: spec.replicas was set, at creation or by a client
	// (UpdateProxyPool, ScaleProxyPool), on a pool without autoscaling.
	ScaleScaled = "Scaled"
	// ScaleDemandUp: autoscaling asked for more proxies for the active
	// leases.
	ScaleDemandUp = "DemandUp"
	// ScaleRefusedAcquires: autoscaling asked for more proxies because
	// acquires were refused.
	ScaleRefusedAcquires = "RefusedAcquires"
	// ScaleDemandDown: the highest count asked within the stabilisation
	// window is below the current one.
	ScaleDemandDown = "DemandDown"
	// ScaleClampedToMin and ScaleClampedToMax: the count was outside
	// [min_replicas, max_replicas].
	ScaleClampedToMin = "ClampedToMin"
	ScaleClampedToMax = "ClampedToMax"
)

// The pool's conditions (status.conditions): each type with the reasons
// it holds (TRUE) or not (FALSE) for.
const (
	// ConditionAvailable: at least desired minus max_unavailable proxies
	// are READY.
	ConditionAvailable      = "Available"
	ReasonMinimumReady      = "MinimumReady"
	ReasonBelowMinimumReady = "BelowMinimumReady"
	// ConditionProgressing: proxies are being created, replaced or
	// removed.
	ConditionProgressing = "Progressing"
	ReasonProgressing    = "Progressing"
	ReasonSettled        = "Settled"
	// ConditionProviderDegraded: a spread target's provider is NOT_READY
	// or failing.
	ConditionProviderDegraded = "ProviderDegraded"
	ReasonProviderFailing     = "ProviderFailing"
	ReasonAllProvidersHealthy = "AllProvidersHealthy"
)
