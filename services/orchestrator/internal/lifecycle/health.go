package lifecycle

import (
	"time"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// ApplyHealth folds a health transition into p: RUNNING becomes READY when
// healthy, and back (reason Unhealthy); other phases only record the
// verdict. It reports whether p changed. A verdict about another instance,
// or not newer than the last one applied, is ignored.
func ApplyHealth(p *Proxy, tr *healthv1.HealthTransition, now time.Time) bool {
	if tr.GetProviderId() != p.ProviderID || tr.GetSequence() <= p.HealthSequence {
		return false
	}
	p.HealthSequence = tr.GetSequence()
	if p.Healthy != tr.GetHealthy() {
		p.Healthy = tr.GetHealthy()
		p.HealthTransitionTime = at(now)
		if tr.GetTransitionTime() != nil {
			p.HealthTransitionTime = at(tr.GetTransitionTime().AsTime())
		}
	}
	p.ProbeLatency = tr.GetLatency().AsDuration()
	switch {
	case p.Healthy && p.Phase == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING:
		p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_READY, now)
		p.Reason, p.Message = ReasonHealthy, ""
	case !p.Healthy && p.Phase == proxyv1.ProxyPhase_PROXY_PHASE_READY:
		p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, now)
		p.Reason, p.Message = ReasonUnhealthy, tr.GetMessage()
	}
	return true
}
