package lifecycle

import (
	"time"

	"github.com/google/uuid"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/spec"
)

// New is a new proxy, as a client's CreateProxy or a pool makes it, with a
// fresh UID: PENDING and due for reconcile at once, or, for an EXTERNAL
// proxy (nothing to provision), RUNNING at its endpoint from the start.
// want is the normalized spec (spec.Normalize). A MANAGED proxy gets
// random credentials unless its spec says NONE; an EXTERNAL one keeps the
// endpoint credentials its spec carries, which leave the spec.
func New(name string, labels map[string]string, want *proxyv1.ProxySpec, skipCleanup bool, now time.Time) *Proxy {
	p := &Proxy{
		UID:         uuid.NewString(),
		Name:        name,
		Labels:      labels,
		Spec:        want,
		SpecHash:    spec.Hash(want),
		SkipCleanup: skipCleanup,
		Generation:  1,
		CreateTime:  now,
	}
	p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_PENDING, now)
	if want.GetMode() == proxyv1.ProxyMode_PROXY_MODE_EXTERNAL {
		takeEndpointCredentials(p, want, now)
		p.IP, p.Port = want.GetEndpoint().GetHost(), want.GetEndpoint().GetPort()
		p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, now)
		p.Reason, p.ObservedGeneration = ReasonExternal, 1
		return p
	}
	p.Port = want.GetPort()
	if WantsCredentials(want) {
		p.Credentials = GenerateCredentials(now)
	}
	p.NextAttemptTime = &now
	return p
}
