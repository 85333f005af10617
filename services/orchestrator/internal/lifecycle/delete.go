package lifecycle

import (
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// RequestDelete moves p to DELETING (keeping an earlier request's time;
// skip_cleanup once set stays set) and reports whether it is released at
// once: there is nothing to clean up and no command in flight. Otherwise
// the caller stores it and the reconciler cleans up (Machine.Decide), now,
// or when the in-flight command's result arrives.
func RequestDelete(p *Proxy, skipCleanup bool, traceParent string, now time.Time) (release bool) {
	if p.DeleteTime == nil {
		p.DeleteTime = &now
	}
	p.SkipCleanup = p.SkipCleanup || skipCleanup
	p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_DELETING, now)
	p.Reason, p.Message = ReasonDeleting, ""
	p.TraceParent = traceParent
	if p.CommandID != "" {
		// A Create in flight may yet record an instance: wait for its
		// result, which decides again.
		return false
	}
	if nothingToCleanUp(p) {
		return true
	}
	p.NextAttemptTime, p.Attempts = &now, 0
	return false
}

// nothingToCleanUp is the release rule of a deleting proxy, the same at
// the request and at every later decision: no instance was recorded
// (orphan GC reaps a stray one that a cut-off Create left behind), or
// skip_cleanup abandons it. It is checked before the provider lookup, so it
// also frees a proxy whose provider is gone from the config.
func nothingToCleanUp(p *Proxy) bool { return p.ProviderID == "" || p.SkipCleanup }
