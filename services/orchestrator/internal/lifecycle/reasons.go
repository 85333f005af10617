package lifecycle

// Reason says why a proxy is in its phase (status.reason): one stable
// CamelCase word that clients, the pool controller and alerts compare;
// status.message says the rest in words. Every reason the orchestrator
// sets is declared here, grouped by the phase it goes with, and listed in
// docs/orchestrator.md (TestReasonsAreDocumented).
type Reason string

// PENDING and PROVISIONING: on the way to a running instance.
const (
	// ReasonProvisioning: a Create is in flight for a proxy without an
	// instance.
	ReasonProvisioning Reason = "Provisioning"
	// ReasonWaitingForAddress: the instance exists and reports no address
	// yet.
	ReasonWaitingForAddress Reason = "WaitingForAddress"
	// ReasonRetrying: the last command failed transiently (or with an
	// unclassified error); retried with the transient backoff.
	ReasonRetrying Reason = "Retrying"
	// ReasonQuotaExceeded: the provider is out of quota; retried with the
	// slower quota backoff. Pools give up such proxies at once.
	ReasonQuotaExceeded Reason = "QuotaExceeded"
	// ReasonReplacing: the spec changed; the instance is deleted and
	// created again.
	ReasonReplacing Reason = "Replacing"
	// ReasonInstanceStopped: the instance exists but is stopped; replaced
	// once stopped for the grace period.
	ReasonInstanceStopped Reason = "InstanceStopped"
	// ReasonInstanceLost: the provider no longer knows the instance; it is
	// created again.
	ReasonInstanceLost Reason = "InstanceLost"
	// ReasonRotatingCredentials: RotateCredentials gave the proxy new
	// credentials; the instance is replaced so that the old ones stop
	// working.
	ReasonRotatingCredentials Reason = "RotatingCredentials"
	// ReasonProviderNotConfigured: the proxy's provider is not in the
	// providers config (also while DELETING: only skip_cleanup frees it).
	ReasonProviderNotConfigured Reason = "ProviderNotConfigured"
)

// RUNNING and READY: the instance serves.
const (
	// ReasonRunning: running with an address; health has not called it
	// healthy.
	ReasonRunning Reason = "Running"
	// ReasonHealthy: READY, health's probes pass.
	ReasonHealthy Reason = "Healthy"
	// ReasonUnhealthy: back to RUNNING from READY, health's probes fail.
	ReasonUnhealthy Reason = "Unhealthy"
	// ReasonExternal: an EXTERNAL proxy, RUNNING at its endpoint from the
	// start; nothing is provisioned.
	ReasonExternal Reason = "External"
)

// FAILED: latched until the spec changes.
const (
	// ReasonProviderError: the provider answered Permanent.
	ReasonProviderError Reason = "ProviderError"
	// ReasonInstanceFailed: the provider reports the instance failed.
	ReasonInstanceFailed Reason = "InstanceFailed"
)

// DELETING: cleaning up the instance; deletion never gives up on its own.
const (
	// ReasonDeleting: deletion was requested; the instance is being
	// deleted and read until it is gone.
	ReasonDeleting Reason = "Deleting"
	// ReasonCleanupGetFailed: reading the instance failed permanently;
	// Delete is tried anyway and releases the proxy when it succeeds.
	ReasonCleanupGetFailed Reason = "CleanupGetFailed"
	// ReasonCleanupFailed: a cleanup command failed; retried with backoff
	// until it succeeds or skip_cleanup abandons the instance.
	ReasonCleanupFailed Reason = "CleanupFailed"
)
