// Package pool is the proxy pool: the rules of its spec, the pure
// decisions its controller takes (how many proxies where, which to create,
// drain or delete, the autoscaler's count) and the loop that applies them
// to the store with one owner per pool across orchestrator replicas.
package pool

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/spec"
)

// LabelKey is the label every proxy of a pool carries, its value the
// pool's name.
const LabelKey = "pool"

// Defaults of the knobs a spec leaves unset.
const (
	DefaultUnhealthyGrace       = 5 * time.Minute
	DefaultDrainTimeout         = 10 * time.Minute
	DefaultStabilization        = 5 * time.Minute
	DefaultTargetUtilization    = 80
	DefaultMaxSurgeWhenBothZero = 1
)

// Validate checks what the contract's annotations cannot: the template's
// mode and providers, the spread's providers and duplicates, the
// autoscaling bounds.
func Validate(v *spec.Violations, s *proxyv1.ProxyPoolSpec, configured func(string) bool, known []string) {
	if s == nil {
		v.Add("spec", "required")
		return
	}
	tmpl := s.GetTemplate().GetSpec()
	if tmpl == nil {
		v.Add("spec.template.spec", "required")
		return
	}
	if tmpl.GetMode() != proxyv1.ProxyMode_PROXY_MODE_MANAGED {
		v.Add("spec.template.spec.mode", "must be MANAGED: a pool provisions its proxies")
		return
	}
	if _, ok := s.GetTemplate().GetLabels()[LabelKey]; ok {
		v.Add(fmt.Sprintf("spec.template.labels[%q]", LabelKey), "is set by the pool to its name; leave it out")
	}
	spec.ValidateLabels(v, "spec.template.labels", s.GetTemplate().GetLabels())
	if len(s.GetSpread()) == 0 {
		// The template names the one provider.
		var tv spec.Violations
		spec.Validate(&tv, tmpl, configured, known)
		for _, x := range tv {
			v.Add("spec.template."+x.Field, "%s", x.Description)
		}
	} else {
		if p := tmpl.GetProvider(); p != "" {
			v.Add("spec.template.spec.provider", "leave it empty when spread names the providers")
		}
		seen := map[string]bool{}
		for i, t := range s.GetSpread() {
			field := fmt.Sprintf("spec.spread[%d]", i)
			if !configured(t.GetProvider()) {
				v.Add(field+".provider", "%q is not configured (configured: %s)", t.GetProvider(), strings.Join(known, ", "))
			}
			key := t.GetProvider() + "\x00" + t.GetZone()
			if seen[key] {
				v.Add(field, "provider %q zone %q appears twice", t.GetProvider(), t.GetZone())
			}
			seen[key] = true
		}
		// The rest of the template's rules, with a provider filled in.
		withProvider := proto.Clone(tmpl).(*proxyv1.ProxySpec)
		withProvider.Provider = s.GetSpread()[0].GetProvider()
		var tv spec.Violations
		spec.Validate(&tv, withProvider, func(string) bool { return true }, known)
		for _, x := range tv {
			v.Add("spec.template."+x.Field, "%s", x.Description)
		}
	}
	if a := s.GetAutoscaling(); a != nil && a.GetMinReplicas() > a.GetMaxReplicas() {
		v.Add("spec.autoscaling.min_replicas", "%d is more than max_replicas %d", a.GetMinReplicas(), a.GetMaxReplicas())
	}
}

// Normalize returns a copy of s in the form that is stored and compared:
// the template's spec with its defaults, weights of 0 made 1.
func Normalize(s *proxyv1.ProxyPoolSpec) *proxyv1.ProxyPoolSpec {
	out := proto.Clone(s).(*proxyv1.ProxyPoolSpec)
	out.Template.Spec = spec.Normalize(out.GetTemplate().GetSpec())
	for _, t := range out.Spread {
		if t.Weight == 0 {
			t.Weight = 1
		}
	}
	return out
}

// Target is one place of the spread: a provider and an optional zone.
type Target struct {
	Provider string
	Zone     string
}

func (t Target) String() string {
	if t.Zone == "" {
		return t.Provider
	}
	return t.Provider + "/" + t.Zone
}

// Targets lists the spread's targets with their weights; without a spread,
// the template's provider with weight 1.
func Targets(s *proxyv1.ProxyPoolSpec) ([]Target, []int) {
	if len(s.GetSpread()) == 0 {
		return []Target{{Provider: s.GetTemplate().GetSpec().GetProvider()}}, []int{1}
	}
	ts := make([]Target, len(s.GetSpread()))
	ws := make([]int, len(s.GetSpread()))
	for i, t := range s.GetSpread() {
		ts[i] = Target{Provider: t.GetProvider(), Zone: t.GetZone()}
		ws[i] = max(1, int(t.GetWeight()))
	}
	return ts, ws
}

// ProxySpec is the spec of a pool proxy on target: the template's, with
// the target's provider and zone.
func ProxySpec(s *proxyv1.ProxyPoolSpec, t Target) *proxyv1.ProxySpec {
	out := proto.Clone(s.GetTemplate().GetSpec()).(*proxyv1.ProxySpec)
	out.Provider = t.Provider
	if t.Zone != "" {
		if out.Placement == nil {
			out.Placement = &proxyv1.Placement{}
		}
		out.Placement.Zone = t.Zone
	}
	return spec.Normalize(out)
}

// ProxyLabels are the labels of a pool proxy: the template's plus
// pool=<name>.
func ProxyLabels(s *proxyv1.ProxyPoolSpec, pool string) map[string]string {
	out := maps.Clone(s.GetTemplate().GetLabels())
	if out == nil {
		out = map[string]string{}
	}
	out[LabelKey] = pool
	return out
}

// TemplateHash covers what makes a proxy of the pool up to date: the
// template (labels and spec). Proxies made from another template are
// rolled.
func TemplateHash(s *proxyv1.ProxyPoolSpec) string {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(s.GetTemplate())
	if err != nil {
		panic(err)
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

// UpToDate reports whether a proxy with spec have and labels matches the
// pool's template on its target.
func UpToDate(s *proxyv1.ProxyPoolSpec, pool string, have *proxyv1.ProxySpec, labels map[string]string) bool {
	t := Target{Provider: have.GetProvider(), Zone: have.GetPlacement().GetZone()}
	if len(s.GetSpread()) > 0 && !slices.ContainsFunc(s.GetSpread(), func(x *proxyv1.SpreadTarget) bool {
		return x.GetProvider() == t.Provider && (x.GetZone() == "" || x.GetZone() == t.Zone)
	}) {
		return false
	}
	want := ProxySpec(s, targetOf(s, t))
	return proto.Equal(want, have) && maps.Equal(ProxyLabels(s, pool), labels)
}

// targetOf maps a proxy's provider and zone to its spread target (a
// target without a zone matches any zone of its provider).
func targetOf(s *proxyv1.ProxyPoolSpec, t Target) Target {
	targets, _ := Targets(s)
	for _, x := range targets {
		if x == t {
			return x
		}
	}
	for _, x := range targets {
		if x.Provider == t.Provider && x.Zone == "" {
			return x
		}
	}
	return t
}

// TargetOf is the spread target a proxy with spec have belongs to.
func TargetOf(s *proxyv1.ProxyPoolSpec, have *proxyv1.ProxySpec) Target {
	return targetOf(s, Target{Provider: have.GetProvider(), Zone: have.GetPlacement().GetZone()})
}
