package lifecycle

import (
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// The health table: what a verdict of the health service does.
func TestApplyHealthTable(t *testing.T) {
	t.Parallel()
	const ours = "vms/101/proxy-u1"
	verdict := func(seq int64, providerID string, healthy bool) *healthv1.HealthTransition {
		return &healthv1.HealthTransition{Sequence: seq, ProviderId: providerID, Healthy: healthy, Message: "connect timed out",
			TransitionTime: timestamppb.New(t0.Add(-time.Second)), Latency: durationpb.New(40 * time.Millisecond)}
	}
	seq := func(n int64) opt { return func(p *Proxy) { p.HealthSequence = n } }
	cases := []struct {
		name        string
		proxy       *Proxy
		tr          *healthv1.HealthTransition
		wantChanged bool
		wantPhase   proxyv1.ProxyPhase
		wantReason  Reason
		wantHealthy bool
	}{
		{"running and healthy: ready", proxy(withInstance), verdict(1, ours, true), true, ready, ReasonHealthy, true},
		{"ready and unhealthy: back to running", proxy(withInstance, healthy, seq(1)), verdict(2, ours, false), true, running, ReasonUnhealthy, false},
		{"ready and healthy again: stays ready", proxy(withInstance, healthy, seq(1)), verdict(2, ours, true), true, ready, ReasonHealthy, true},
		{"about another instance: ignored", proxy(withInstance), verdict(1, "vms/999/other", true), false, running, ReasonRunning, false},
		{"older than the last applied: ignored", proxy(withInstance, healthy, seq(5)), verdict(4, ours, false), false, ready, ReasonHealthy, true},
		{"the same sequence again: ignored", proxy(withInstance, healthy, seq(5)), verdict(5, ours, false), false, ready, ReasonHealthy, true},
		{"provisioning: recorded, not ready", proxy(withInstance, func(p *Proxy) { p.Phase, p.Reason = provisioning, ReasonWaitingForAddress }),
			verdict(1, ours, true), true, provisioning, ReasonWaitingForAddress, true},
		{"deleting: recorded, still deleting", proxy(withInstance, deleting, func(p *Proxy) { p.Phase = deletingP }),
			verdict(1, ours, true), true, deletingP, ReasonDeleting, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := tc.proxy
			wasHealthy := p.Healthy
			if got := ApplyHealth(p, tc.tr, t0); got != tc.wantChanged {
				t.Errorf("changed = %v, want %v", got, tc.wantChanged)
			}
			if p.Phase != tc.wantPhase || p.Reason != tc.wantReason || p.Healthy != tc.wantHealthy {
				t.Errorf("phase/reason/healthy = %v/%q/%v, want %v/%q/%v", p.Phase, p.Reason, p.Healthy, tc.wantPhase, tc.wantReason, tc.wantHealthy)
			}
			if !tc.wantChanged {
				return
			}
			if p.HealthSequence != tc.tr.GetSequence() || p.ProbeLatency != 40*time.Millisecond {
				t.Errorf("sequence %d latency %v, want %d and 40ms", p.HealthSequence, p.ProbeLatency, tc.tr.GetSequence())
			}
			if tc.wantReason == ReasonUnhealthy && p.Message != "connect timed out" {
				t.Errorf("message %q, want the verdict's", p.Message)
			}
			switch flipped := p.Healthy != wasHealthy; {
			case flipped && (p.HealthTransitionTime == nil || !p.HealthTransitionTime.Equal(t0.Add(-time.Second))):
				t.Errorf("health transition at %v, want the verdict's time", p.HealthTransitionTime)
			case !flipped && p.HealthTransitionTime != nil:
				t.Errorf("health transition at %v without a change of verdict", p.HealthTransitionTime)
			}
		})
	}
}
