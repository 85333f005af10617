// Package spec holds the rules for a Proxy's desired state: the part of
// validation the contract's annotations cannot express (rules that depend
// on the mode, on the providers config, or span several fields; every
// violation names its field), the defaults, and the spec hash that decides
// when an instance must be replaced. Formats, lengths and ranges are
// buf.validate rules in proxy.proto, enforced by pkg/validate before a
// handler runs.
package spec

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"regexp"
	"strings"

	"google.golang.org/protobuf/proto"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/validate"
)

// DefaultPort is the port of a MANAGED proxy whose spec leaves it 0.
const DefaultPort = 3128

var hostRE = regexp.MustCompile(`^[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*$`)

// Violations collects field errors in the suite's one validation shape.
type Violations = validate.Violations

// ValidateLabels checks what the contract's label pattern cannot: a key's
// DNS-subdomain prefix is at most 253 characters.
func ValidateLabels(v *Violations, field string, labels map[string]string) {
	for k := range labels {
		if prefix, _, ok := strings.Cut(k, "/"); ok && len(prefix) > 253 {
			v.Add(fmt.Sprintf("%s[%q]", field, k), "key prefix must be a DNS subdomain of at most 253 characters")
		}
	}
}

// Validate checks a spec against the rules of its mode. configured reports
// whether a provider name is in the providers config; known lists them for
// the message.
func Validate(v *Violations, s *proxyv1.ProxySpec, configured func(string) bool, known []string) {
	if s == nil {
		v.Add("spec", "required")
		return
	}
	switch s.GetMode() {
	case proxyv1.ProxyMode_PROXY_MODE_MANAGED:
		switch {
		case s.GetProvider() == "":
			v.Add("spec.provider", "required for MANAGED proxies")
		case !configured(s.GetProvider()):
			v.Add("spec.provider", "%q is not configured (configured: %s)", s.GetProvider(), strings.Join(known, ", "))
		}
		if s.GetEndpoint() != nil {
			v.Add("spec.endpoint", "only EXTERNAL proxies have an endpoint")
		}
		if s.GetEndpointCredentials() != nil {
			v.Add("spec.endpoint_credentials", "only EXTERNAL proxies carry their own credentials; a MANAGED proxy's are generated")
		}
	case proxyv1.ProxyMode_PROXY_MODE_EXTERNAL:
		ep := s.GetEndpoint()
		if ep == nil {
			v.Add("spec.endpoint", "required for EXTERNAL proxies")
		} else {
			if ep.GetHost() == "" {
				v.Add("spec.endpoint.host", "required")
			} else if net.ParseIP(ep.GetHost()) == nil && !hostRE.MatchString(ep.GetHost()) {
				v.Add("spec.endpoint.host", "%q is neither an IP address nor a host name", ep.GetHost())
			}
		}
		if s.GetProvider() != "" {
			v.Add("spec.provider", "EXTERNAL proxies are not provisioned; leave it empty")
		}
		if s.GetPlacement() != nil && proto.Size(s.GetPlacement()) > 0 {
			v.Add("spec.placement", "EXTERNAL proxies are not provisioned; leave it empty")
		}
		if s.GetCloudInit() != "" {
			v.Add("spec.cloud_init", "EXTERNAL proxies are not provisioned; leave it empty")
		}
		if s.GetPort() != 0 {
			v.Add("spec.port", "EXTERNAL proxies use spec.endpoint.port")
		}
		if s.GetCredentials() != proxyv1.CredentialsPolicy_CREDENTIALS_POLICY_UNSPECIFIED {
			v.Add("spec.credentials", "EXTERNAL proxies carry spec.endpoint_credentials instead; leave it unset")
		}
	default:
		v.Add("spec.mode", "required: MANAGED or EXTERNAL")
	}
	validateHealth(v, s.GetHealthCheck())
}

// validateHealth checks the probe timeout against the interval; each alone
// is a contract rule.
func validateHealth(v *Violations, h *proxyv1.HealthCheckSpec) {
	if h.GetInterval() == nil || h.GetTimeout() == nil {
		return
	}
	interval, timeout := h.GetInterval().AsDuration(), h.GetTimeout().AsDuration()
	if interval > 0 && timeout > interval {
		v.Add("spec.health_check.timeout", "%s is longer than the interval %s", timeout, interval)
	}
}

// Normalize returns a copy of s with defaults applied, the form that is
// stored and compared.
func Normalize(s *proxyv1.ProxySpec) *proxyv1.ProxySpec {
	out := proto.Clone(s).(*proxyv1.ProxySpec)
	if out.GetMode() == proxyv1.ProxyMode_PROXY_MODE_MANAGED && out.GetPort() == 0 {
		out.Port = DefaultPort
	}
	if out.GetPlacement() != nil && proto.Size(out.GetPlacement()) == 0 {
		out.Placement = nil
	}
	return out
}

// Hash covers what shapes a MANAGED instance — provider, placement,
// cloud-init and port — so a change of any of them replaces the instance,
// and nothing else does. EXTERNAL proxies have no instance and no hash.
func Hash(s *proxyv1.ProxySpec) string {
	if s.GetMode() != proxyv1.ProxyMode_PROXY_MODE_MANAGED {
		return ""
	}
	shape := &proxyv1.ProxySpec{
		Provider:  s.GetProvider(),
		Placement: s.GetPlacement(),
		CloudInit: s.GetCloudInit(),
		Port:      s.GetPort(),
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(shape)
	if err != nil {
		panic(err) // a ProxySpec always marshals
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}
