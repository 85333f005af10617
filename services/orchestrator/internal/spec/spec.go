// Package spec holds the rules for a Proxy's desired state: validation of
// what clients send (every violation names its field), the defaults, and
// the spec hash that decides when an instance must be replaced.
package spec

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"regexp"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// Limits and defaults.
const (
	DefaultPort      = 3128
	MaxCloudInitSize = 64 << 10
	MaxLabels        = 64
	MinProbeInterval = 100 * time.Millisecond
	MaxThreshold     = 100
)

var (
	nameRE       = regexp.MustCompile(`^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$`)
	labelNameRE  = regexp.MustCompile(`^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$`)
	labelValueRE = regexp.MustCompile(`^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$`)
	dnsSubRE     = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
	hostRE       = regexp.MustCompile(`^[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*$`)
)

// Violations collects field errors; Err turns them into one InvalidArgument
// status whose message names every field and whose BadRequest detail lists
// them.
type Violations []*errdetails.BadRequest_FieldViolation

// Add records a violation of field.
func (v *Violations) Add(field, format string, args ...any) {
	*v = append(*v, &errdetails.BadRequest_FieldViolation{Field: field, Description: fmt.Sprintf(format, args...)})
}

// Err is nil without violations.
func (v Violations) Err() error {
	if len(v) == 0 {
		return nil
	}
	parts := make([]string, len(v))
	for i, f := range v {
		parts[i] = f.GetField() + ": " + f.GetDescription()
	}
	st := status.New(codes.InvalidArgument, "invalid request: "+strings.Join(parts, "; "))
	if d, err := st.WithDetails(&errdetails.BadRequest{FieldViolations: v}); err == nil {
		st = d
	}
	return st.Err()
}

// ValidateName checks a proxy name.
func ValidateName(v *Violations, field, name string) {
	switch {
	case name == "":
		v.Add(field, "required")
	case !nameRE.MatchString(name):
		v.Add(field, "%q is not a DNS label: 1-63 lowercase letters, digits and '-', starting with a letter, not ending with '-'", name)
	}
}

// ValidateLabels checks label keys and values.
func ValidateLabels(v *Violations, field string, labels map[string]string) {
	if len(labels) > MaxLabels {
		v.Add(field, "at most %d labels", MaxLabels)
	}
	for k, val := range labels {
		name := k
		if prefix, rest, ok := strings.Cut(k, "/"); ok {
			name = rest
			if len(prefix) > 253 || !dnsSubRE.MatchString(prefix) {
				v.Add(field+"["+k+"]", "key prefix %q must be a DNS subdomain", prefix)
			}
		}
		if !labelNameRE.MatchString(name) {
			v.Add(field+"["+k+"]", "key name %q must be 1-63 letters, digits, '-', '_' or '.', starting and ending alphanumeric", name)
		}
		if !labelValueRE.MatchString(val) {
			v.Add(field+"["+k+"]", "value %q must be empty or 1-63 letters, digits, '-', '_' or '.', starting and ending alphanumeric", val)
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
		if s.GetPort() > 65535 {
			v.Add("spec.port", "%d is not a TCP port (1-65535, or 0 for %d)", s.GetPort(), DefaultPort)
		}
		if len(s.GetCloudInit()) > MaxCloudInitSize {
			v.Add("spec.cloud_init", "%d bytes; at most %d", len(s.GetCloudInit()), MaxCloudInitSize)
		}
	case proxyv1.ProxyMode_PROXY_MODE_EXTERNAL:
		ep := s.GetEndpoint()
		if ep == nil {
			v.Add("spec.endpoint", "required for EXTERNAL proxies")
		} else {
			if ep.GetHost() == "" {
				v.Add("spec.endpoint.host", "required")
			} else if net.ParseIP(ep.GetHost()) == nil && (len(ep.GetHost()) > 253 || !hostRE.MatchString(ep.GetHost())) {
				v.Add("spec.endpoint.host", "%q is neither an IP address nor a host name", ep.GetHost())
			}
			if ep.GetPort() == 0 || ep.GetPort() > 65535 {
				v.Add("spec.endpoint.port", "%d is not a TCP port (1-65535)", ep.GetPort())
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
	default:
		v.Add("spec.mode", "required: MANAGED or EXTERNAL")
	}
	validateHealth(v, s.GetHealthCheck())
	if l := s.GetLease(); l != nil && l.MaxLeases != nil && l.GetMaxLeases() > 1_000_000 {
		v.Add("spec.lease.max_leases", "%d is more than 1000000", l.GetMaxLeases())
	}
}

func validateHealth(v *Violations, h *proxyv1.HealthCheckSpec) {
	if h == nil {
		return
	}
	var interval, timeout time.Duration
	if d := h.GetInterval(); d != nil {
		if err := d.CheckValid(); err != nil || d.AsDuration() < MinProbeInterval {
			v.Add("spec.health_check.interval", "must be at least %s", MinProbeInterval)
		}
		interval = d.AsDuration()
	}
	if d := h.GetTimeout(); d != nil {
		if err := d.CheckValid(); err != nil || d.AsDuration() <= 0 {
			v.Add("spec.health_check.timeout", "must be positive")
		}
		timeout = d.AsDuration()
	}
	if interval > 0 && timeout > interval {
		v.Add("spec.health_check.timeout", "%s is longer than the interval %s", timeout, interval)
	}
	if d := h.GetLatencyThreshold(); d != nil {
		if err := d.CheckValid(); err != nil || d.AsDuration() <= 0 {
			v.Add("spec.health_check.latency_threshold", "must be positive")
		}
	}
	if h.GetSuccessThreshold() > MaxThreshold {
		v.Add("spec.health_check.success_threshold", "at most %d", MaxThreshold)
	}
	if h.GetFailureThreshold() > MaxThreshold {
		v.Add("spec.health_check.failure_threshold", "at most %d", MaxThreshold)
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
