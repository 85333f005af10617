package lifecycle

import (
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/spec"
)

// Update gives p a client's new spec (normalized), labels and
// skip_cleanup, as a new generation. The caller has checked what the
// request may change: the generation or etag, that p is not being deleted,
// that the mode is the same, and that something differs.
//
// An EXTERNAL proxy's address follows its endpoint at once. A managed one
// is reconciled now — a replacement when the spec hash changed, the end of
// a Failed latch, or only a new observed generation — unless a command is
// in flight, whose result makes it due (Machine.Apply). An EXTERNAL
// proxy's endpoint credentials are replaced when the new spec carries
// some, and kept when it carries none.
func Update(p *Proxy, want *proxyv1.ProxySpec, labels map[string]string, skipCleanup bool, traceParent string, now time.Time) {
	p.Spec, p.Labels, p.SkipCleanup = want, labels, skipCleanup
	p.Generation++
	p.SpecHash = spec.Hash(want)
	p.TraceParent = traceParent
	switch {
	case want.GetMode() == proxyv1.ProxyMode_PROXY_MODE_EXTERNAL:
		takeEndpointCredentials(p, want, now)
		p.IP, p.Port = want.GetEndpoint().GetHost(), want.GetEndpoint().GetPort()
		p.ObservedGeneration = p.Generation
	case p.CommandID == "":
		p.NextAttemptTime = &now
		p.Attempts = 0
	}
}
