package lifecycle

import (
	"testing"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/spec"
)

// The rules of the requests a client (or a pool) makes: create, update,
// delete, drain.

func TestNew(t *testing.T) {
	t.Parallel()
	managed := &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve", Port: 3128}
	ext := &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "203.0.113.7", Port: 8080}}
	cases := []struct {
		name       string
		spec       *proxyv1.ProxySpec
		wantPhase  proxyv1.ProxyPhase
		wantReason Reason
		wantIP     string
		wantPort   uint32
		wantDue    bool
		wantObs    int64
	}{
		{"managed: pending and due at once", managed, pending, "", "", 3128, true, 0},
		{"external: running at its endpoint, nothing to do", ext, running, ReasonExternal, "203.0.113.7", 8080, false, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := New("p1", map[string]string{"k": "v"}, tc.spec, true, t0)
			if p.UID == "" || p.Name != "p1" || p.Labels["k"] != "v" || !p.SkipCleanup || p.Generation != 1 || !p.CreateTime.Equal(t0) {
				t.Errorf("identity: %+v", p)
			}
			if p.SpecHash != spec.Hash(tc.spec) {
				t.Errorf("spec hash %q, want %q", p.SpecHash, spec.Hash(tc.spec))
			}
			if p.Phase != tc.wantPhase || p.Reason != tc.wantReason || p.PhaseTransitionTime == nil || !p.PhaseTransitionTime.Equal(t0) {
				t.Errorf("phase/reason = %v/%q at %v, want %v/%q at t0", p.Phase, p.Reason, p.PhaseTransitionTime, tc.wantPhase, tc.wantReason)
			}
			if p.IP != tc.wantIP || p.Port != tc.wantPort || p.ObservedGeneration != tc.wantObs {
				t.Errorf("ip %q port %d observed %d, want %q %d %d", p.IP, p.Port, p.ObservedGeneration, tc.wantIP, tc.wantPort, tc.wantObs)
			}
			if due := p.NextAttemptTime != nil && !p.NextAttemptTime.After(t0); due != tc.wantDue {
				t.Errorf("due = %v, want %v", due, tc.wantDue)
			}
		})
	}
	if a, b := New("a", nil, managed, false, t0), New("a", nil, managed, false, t0); a.UID == b.UID {
		t.Error("two new proxies share a UID")
	}
}

func TestUpdate(t *testing.T) {
	t.Parallel()
	larger := &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve", Port: 3128,
		Placement: &proxyv1.Placement{MachineType: "large"}}
	moved := &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "198.51.100.2", Port: 3129}}
	cases := []struct {
		name        string
		proxy       *Proxy
		want        *proxyv1.ProxySpec
		wantDue     bool
		wantIP      string
		wantObs     int64
		wantAttempt int32
	}{
		{"managed, idle: reconciled at once, attempts reset", proxy(withInstance, attempts(4)), larger, true, "10.0.0.9", 0, 0},
		{"managed, failed latch: reconciled at once", proxy(failedLatch), larger, true, "", 0, 0},
		{"managed, command in flight: its result makes it due", proxy(withInstance, inFlight(StepPoll, t0.Add(time.Minute)), attempts(2)), larger, false, "10.0.0.9", 0, 2},
		{"external: the address follows the endpoint, observed at once", proxy(external), moved, false, "198.51.100.2", 2, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := tc.proxy
			p.TraceParent = ""
			Update(p, tc.want, map[string]string{"tier": "b"}, true, "00-trace-01", t0)
			if p.Generation != 2 || p.SpecHash != spec.Hash(tc.want) || p.Labels["tier"] != "b" || !p.SkipCleanup || p.TraceParent != "00-trace-01" {
				t.Errorf("generation %d hash %q labels %v skip %v trace %q", p.Generation, p.SpecHash, p.Labels, p.SkipCleanup, p.TraceParent)
			}
			if due := p.NextAttemptTime != nil && !p.NextAttemptTime.After(t0); due != tc.wantDue {
				t.Errorf("due = %v, want %v", due, tc.wantDue)
			}
			if p.IP != tc.wantIP || p.ObservedGeneration != tc.wantObs || p.Attempts != tc.wantAttempt {
				t.Errorf("ip %q observed %d attempts %d, want %q %d %d", p.IP, p.ObservedGeneration, p.Attempts, tc.wantIP, tc.wantObs, tc.wantAttempt)
			}
		})
	}
}

func TestRequestDelete(t *testing.T) {
	t.Parallel()
	earlier := t0.Add(-time.Hour)
	cases := []struct {
		name        string
		proxy       *Proxy
		skipCleanup bool
		wantRelease bool
		wantDue     bool
		wantSkip    bool
	}{
		{"nothing created: released at once", proxy(), false, true, false, false},
		{"an instance: cleaned up, due now", proxy(withInstance, attempts(3)), false, false, true, false},
		{"an instance, skip_cleanup: released at once", proxy(withInstance), true, true, false, true},
		{"skip_cleanup set on the proxy before: released at once", proxy(withInstance, skipCleanup), false, true, false, true},
		{"a create in flight: wait for its result", proxy(inFlight(StepCreate, t0.Add(time.Minute))), false, false, false, false},
		{"a create in flight, skip_cleanup: still waits for the result", proxy(inFlight(StepCreate, t0.Add(time.Minute))), true, false, false, true},
		{"deleting already: the first request's time stays", proxy(withInstance, func(p *Proxy) { p.DeleteTime = &earlier }), false, false, true, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := tc.proxy
			firstTime := p.DeleteTime
			release := RequestDelete(p, tc.skipCleanup, "00-trace-01", t0)
			if release != tc.wantRelease {
				t.Errorf("release = %v, want %v", release, tc.wantRelease)
			}
			if p.Phase != deletingP || p.Reason != ReasonDeleting || p.Message != "" || p.SkipCleanup != tc.wantSkip || p.TraceParent != "00-trace-01" {
				t.Errorf("phase %v reason %q message %q skip %v trace %q", p.Phase, p.Reason, p.Message, p.SkipCleanup, p.TraceParent)
			}
			switch {
			case p.DeleteTime == nil:
				t.Error("no delete time")
			case firstTime != nil && !p.DeleteTime.Equal(*firstTime):
				t.Errorf("delete time %v, want the first request's %v", p.DeleteTime, firstTime)
			case firstTime == nil && !p.DeleteTime.Equal(t0):
				t.Errorf("delete time %v, want now", p.DeleteTime)
			}
			if due := p.NextAttemptTime != nil && !p.NextAttemptTime.After(t0); !release && due != tc.wantDue {
				t.Errorf("due = %v, want %v", due, tc.wantDue)
			}
			if tc.wantDue && p.Attempts != 0 {
				t.Errorf("attempts %d, want a fresh start", p.Attempts)
			}
		})
	}
}

// The release rule is one: a deleting proxy with no command in flight is
// released at the request exactly when the reconciler would release it.
func TestReleaseRuleIsTheSameAtRequestAndDecision(t *testing.T) {
	t.Parallel()
	for _, providerID := range []string{"", "vms/101/proxy-u1"} {
		for _, skip := range []bool{false, true} {
			for _, configured := range []string{"pve", "retired"} {
				requested := proxy(provider(configured), func(p *Proxy) { p.ProviderID = providerID })
				atRequest := RequestDelete(requested, skip, "", t0)
				decided := proxy(provider(configured), func(p *Proxy) { p.ProviderID, p.SkipCleanup, p.DeleteTime = providerID, skip, &t0 })
				atDecision := machine().Decide(decided, t0).Release
				if atRequest != atDecision {
					t.Errorf("providerID %q skip_cleanup %v provider %s: released at the request %v, by the reconciler %v",
						providerID, skip, configured, atRequest, atDecision)
				}
			}
		}
	}
}

func TestDrain(t *testing.T) {
	t.Parallel()
	p := proxy(withInstance)
	Drain(p, t0, time.Minute)
	if !p.Draining() || !p.DrainTime.Equal(t0) || !p.DrainDeadline.Equal(t0.Add(time.Minute)) {
		t.Fatalf("drain time %v deadline %v", p.DrainTime, p.DrainDeadline)
	}
	Drain(p, t0.Add(time.Second), time.Hour)
	if !p.DrainDeadline.Equal(t0.Add(time.Minute)) {
		t.Errorf("draining again moved the deadline to %v", p.DrainDeadline)
	}
	if pr := p.Proto(false); !pr.GetDraining() || !pr.GetDrainDeadline().AsTime().Equal(t0.Add(time.Minute)) {
		t.Errorf("the API shows draining %v deadline %v", pr.GetDraining(), pr.GetDrainDeadline())
	}
	Undrain(p)
	if p.Draining() || p.DrainDeadline != nil || p.Proto(false).GetDraining() {
		t.Errorf("still draining after Undrain: %v %v", p.DrainTime, p.DrainDeadline)
	}
}
