package pool

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
)

var t0 = time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)

const (
	ready   = proxyv1.ProxyPhase_PROXY_PHASE_READY
	running = proxyv1.ProxyPhase_PROXY_PHASE_RUNNING
	pending = proxyv1.ProxyPhase_PROXY_PHASE_PENDING
	failed  = proxyv1.ProxyPhase_PROXY_PHASE_FAILED
)

func poolSpec(mut ...func(*proxyv1.ProxyPoolSpec)) *proxyv1.ProxyPoolSpec {
	s := &proxyv1.ProxyPoolSpec{
		Template: &proxyv1.ProxyTemplate{Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED}},
		Spread: []*proxyv1.SpreadTarget{
			{Provider: "a", Weight: 1},
			{Provider: "b", Weight: 1},
		},
	}
	for _, m := range mut {
		m(s)
	}
	return Normalize(s)
}

// member is a compact way to write a proxy: target, phase, age in
// minutes, leases (-1 unknown), and flags: "old" (other template),
// "drain", "del".
func member(name, target string, phase proxyv1.ProxyPhase, ageMin int, leases int, flags ...string) Member {
	m := Member{
		UID: "uid-" + name, Name: name, Target: Target{Provider: target}, Created: t0.Add(-time.Duration(ageMin) * time.Minute),
		Phase: phase, UpToDate: true, Leases: leases, DrainDeadline: t0.Add(time.Hour),
	}
	if phase != ready {
		m.NotReadySince = m.Created
	}
	for _, f := range flags {
		switch f {
		case "old":
			m.UpToDate = false
		case "drain":
			m.Draining = true
		case "del":
			m.Deleting = true
		case "expired":
			m.DrainDeadline = t0.Add(-time.Second)
		case "quota":
			m.Reason = lifecycle.ReasonQuotaExceeded
		}
	}
	return m
}

func targets(ts []Target) string {
	var s []string
	for _, t := range ts {
		s = append(s, t.String())
	}
	return strings.Join(s, ",")
}

func actions(as []Action) string {
	var s []string
	for _, a := range as {
		s = append(s, a.Name+":"+a.Reason)
	}
	slices.Sort(s)
	return strings.Join(s, ",")
}

func TestDistribute(t *testing.T) {
	t.Parallel()
	cases := []struct {
		n       int
		weights []int
		want    []int
	}{
		{0, []int{1, 1}, []int{0, 0}},
		{5, []int{1, 1}, []int{3, 2}},
		{10, []int{3, 1}, []int{8, 2}},
		{3, []int{1, 1, 1}, []int{1, 1, 1}},
		{1, []int{1, 3}, []int{0, 1}},
		{7, []int{2, 2, 1}, []int{3, 3, 1}},
	}
	for _, tc := range cases {
		if got := Distribute(tc.n, tc.weights); !slices.Equal(got, tc.want) {
			t.Errorf("Distribute(%d, %v) = %v, want %v", tc.n, tc.weights, got, tc.want)
		}
	}
}

func TestDecide(t *testing.T) {
	t.Parallel()
	rolling := func(surge, unav int32) func(*proxyv1.ProxyPoolSpec) {
		return func(s *proxyv1.ProxyPoolSpec) { s.MaxSurge, s.MaxUnavailable = surge, unav }
	}
	cases := []struct {
		name        string
		spec        *proxyv1.ProxyPoolSpec
		desired     int
		members     []Member
		notReady    map[string]string
		lastFailure map[Target]time.Time
		deleted     bool

		wantCreate string // targets, in order
		wantDrain  string // name:reason, sorted
		wantDelete string
		wantReady  int
		wantFail   string
	}{
		{
			name: "scale up from zero spreads by weight", spec: poolSpec(), desired: 4,
			wantCreate: "a,b,a,b",
		},
		{
			name: "weights 3:1", spec: poolSpec(func(s *proxyv1.ProxyPoolSpec) { s.Spread[0].Weight = 3 }), desired: 4,
			wantCreate: "a,a,a,b",
		},
		{
			name: "scale up fills the target below its share", spec: poolSpec(), desired: 4,
			members:    []Member{member("p1", "a", ready, 5, 0), member("p2", "a", ready, 5, 0)},
			wantCreate: "b,b", wantReady: 2,
		},
		{
			name: "steady state does nothing", spec: poolSpec(), desired: 2,
			members:   []Member{member("p1", "a", ready, 5, 1), member("p2", "b", ready, 5, 1)},
			wantReady: 2,
		},
		{
			name: "scale down deletes proxies without leases first", spec: poolSpec(), desired: 2,
			members: []Member{
				member("p1", "a", ready, 9, 3), member("p2", "a", ready, 8, 0),
				member("p3", "b", ready, 7, 2), member("p4", "b", ready, 6, 0),
			},
			wantDelete: "p2:ScaleDown,p4:ScaleDown", wantReady: 4,
		},
		{
			name: "scale down drains busy proxies, fewest leases first", spec: poolSpec(), desired: 2,
			members: []Member{
				member("p1", "a", ready, 9, 3), member("p2", "a", ready, 8, 1),
				member("p3", "b", ready, 7, 2), member("p4", "b", ready, 6, 5),
			},
			wantDrain: "p2:ScaleDown,p3:ScaleDown", wantReady: 4,
		},
		{
			// b's share of 1 is 0, so its proxy goes.
			name: "scale down with unknown leases drains (never deletes under a lease)", spec: poolSpec(), desired: 1,
			members:   []Member{member("p1", "a", ready, 9, -1), member("p2", "b", ready, 8, -1)},
			wantDrain: "p2:ScaleDown", wantReady: 2,
		},
		{
			name: "scale down prefers a not-Ready proxy", spec: poolSpec(), desired: 1,
			members:    []Member{member("p1", "a", ready, 9, 0), member("p2", "a", running, 1, 0)},
			wantDelete: "p2:ScaleDown", wantReady: 1,
		},
		{
			name: "draining proxy without leases is deleted, one with leases waits", spec: poolSpec(), desired: 2,
			members: []Member{
				member("p1", "a", ready, 9, 0), member("p2", "b", ready, 9, 0),
				member("d1", "a", ready, 9, 0, "drain"), member("d2", "b", ready, 9, 2, "drain"),
			},
			wantDelete: "d1:DrainedNoLeases", wantReady: 2,
		},
		{
			name: "draining proxy past its deadline is deleted despite leases", spec: poolSpec(), desired: 1,
			members:    []Member{member("p1", "a", ready, 9, 0), member("d1", "a", ready, 9, 4, "drain", "expired")},
			wantDelete: "d1:DrainTimeout", wantReady: 1,
		},
		{
			name: "unhealthy past grace is replaced", spec: poolSpec(), desired: 2,
			members: []Member{
				member("p1", "a", ready, 30, 0),
				member("p2", "b", running, 30, -1), // not Ready for 30m > 5m grace
			},
			wantCreate: "b", wantDrain: "p2:Unhealthy", wantReady: 1,
		},
		{
			name: "unhealthy within grace is kept", spec: poolSpec(), desired: 2,
			members:   []Member{member("p1", "a", ready, 30, 0), member("p2", "b", running, 2, -1)},
			wantReady: 1,
		},
		{
			name: "failed proxy is deleted and its share moves to the healthy target", spec: poolSpec(), desired: 4,
			members: []Member{
				member("p1", "a", ready, 30, 0), member("p2", "a", ready, 30, 0),
				member("p3", "b", ready, 30, 0), member("p4", "b", failed, 1, -1),
			},
			wantCreate: "a", wantDelete: "p4:Failed", wantReady: 3, wantFail: "b",
		},
		{
			name: "quota-exceeded target keeps its ready proxies, the rest goes elsewhere", spec: poolSpec(), desired: 6,
			members: []Member{
				member("p1", "a", ready, 30, 0), member("p2", "b", ready, 30, 0),
				member("p3", "b", pending, 1, -1, "quota"),
			},
			// p3 goes; b keeps p2 (min(share 3, 1 member)); a gets 5.
			wantCreate: "a,a,a,a", wantDelete: "p3:QuotaExceeded", wantReady: 2, wantFail: "b",
		},
		{
			name: "recent failure keeps the target failing", spec: poolSpec(), desired: 2,
			lastFailure: map[Target]time.Time{{Provider: "b"}: t0.Add(-time.Minute)},
			wantCreate:  "a,a", wantFail: "b",
		},
		{
			name: "old failure is forgotten", spec: poolSpec(), desired: 2,
			lastFailure: map[Target]time.Time{{Provider: "b"}: t0.Add(-time.Hour)},
			wantCreate:  "a,b",
		},
		{
			name: "provider not ready moves the share", spec: poolSpec(), desired: 2, notReady: map[string]string{"a": "TargetsNotReady"},
			wantCreate: "b,b", wantFail: "a",
		},
		{
			name: "every target failing still creates by weight", spec: poolSpec(), desired: 2, notReady: map[string]string{"a": "", "b": ""},
			wantCreate: "a,b", wantFail: "a,b",
		},
		{
			name: "recovered target: surplus elsewhere is rebalanced within surge", spec: poolSpec(), desired: 4,
			members: []Member{
				member("p1", "a", ready, 40, 0), member("p2", "a", ready, 30, 0),
				member("p3", "a", ready, 20, 0), member("p4", "a", ready, 10, 0),
			},
			wantCreate: "b", wantReady: 4,
		},
		{
			name: "rollout surge 1 unavailable 0: create one, drain none while new is not Ready", spec: poolSpec(rolling(1, 0)), desired: 2,
			members:    []Member{member("p1", "a", ready, 30, 0, "old"), member("p2", "b", ready, 30, 0, "old")},
			wantCreate: "a", wantReady: 2,
		},
		{
			name: "rollout surge 1: the surge proxy Ready lets one old go", spec: poolSpec(rolling(1, 0)), desired: 2,
			members: []Member{
				member("p1", "a", ready, 30, 0, "old"), member("p2", "b", ready, 30, 2, "old"),
				member("n1", "a", ready, 1, 0),
			},
			wantDelete: "p1:TemplateChanged", wantReady: 3,
		},
		{
			name: "rollout surge 0 unavailable 1: drain one first", spec: poolSpec(rolling(0, 1)), desired: 2,
			members:    []Member{member("p1", "a", ready, 30, 1, "old"), member("p2", "b", ready, 30, 0, "old")},
			wantDelete: "p2:TemplateChanged", wantReady: 2,
		},
		{
			name: "rollout never exceeds surge while surge proxies are not Ready", spec: poolSpec(rolling(2, 0)), desired: 3,
			members: []Member{
				member("p1", "a", ready, 30, 0, "old"), member("p2", "b", ready, 30, 0, "old"), member("p3", "a", ready, 30, 0, "old"),
				member("n1", "b", pending, 0, -1), member("n2", "a", pending, 0, -1),
			},
			wantReady: 3,
		},
		{
			name: "max age rolls the oldest", spec: poolSpec(rolling(1, 0), func(s *proxyv1.ProxyPoolSpec) { s.MaxAge = durationpb.New(time.Hour) }), desired: 2,
			members: []Member{
				member("p1", "a", ready, 90, 0), member("p2", "b", ready, 10, 0),
				member("n1", "a", ready, 1, 0),
			},
			wantDelete: "p1:MaxAge", wantReady: 3,
		},
		{
			name: "max age with busy old proxy drains it", spec: poolSpec(rolling(1, 0), func(s *proxyv1.ProxyPoolSpec) { s.MaxAge = durationpb.New(time.Hour) }), desired: 1,
			members:   []Member{member("p1", "a", ready, 90, 3), member("n1", "a", ready, 1, 0)},
			wantDrain: "p1:MaxAge", wantReady: 2,
		},
		{
			name: "deleting pool drains everything", spec: poolSpec(), desired: 2, deleted: true,
			members:    []Member{member("p1", "a", ready, 9, 2), member("p2", "b", ready, 9, 0)},
			wantDrain:  "p1:ScaleDown",
			wantDelete: "p2:ScaleDown", wantReady: 2,
		},
		{
			name: "proxies being deleted are not counted", spec: poolSpec(), desired: 1,
			members:    []Member{member("p1", "a", ready, 9, 0, "del")},
			wantCreate: "a",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			plan := Decide(Input{
				Pool: "web", Spec: tc.spec, Desired: tc.desired, Members: tc.members, Deleted: tc.deleted,
				LastFailure: tc.lastFailure, ProviderNotReady: tc.notReady, Now: t0,
			})
			if got := targets(plan.Create); got != tc.wantCreate {
				t.Errorf("create = %q, want %q", got, tc.wantCreate)
			}
			if got := actions(plan.Drain); got != tc.wantDrain {
				t.Errorf("drain = %q, want %q", got, tc.wantDrain)
			}
			if got := actions(plan.Delete); got != tc.wantDelete {
				t.Errorf("delete = %q, want %q", got, tc.wantDelete)
			}
			if plan.Ready != tc.wantReady {
				t.Errorf("ready = %d, want %d", plan.Ready, tc.wantReady)
			}
			if got := targets(plan.Failing); got != tc.wantFail {
				t.Errorf("failing = %q, want %q", got, tc.wantFail)
			}
		})
	}
}

// A rollout simulated sync after sync never has more live proxies than
// desired + max_surge nor fewer Ready than desired - max_unavailable, and
// ends with every proxy up to date.
func TestDecideRolloutBounds(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ desired, surge, unav int32 }{{5, 1, 0}, {5, 0, 1}, {6, 2, 1}, {10, 3, 0}, {3, 0, 3}} {
		t.Run(fmt.Sprintf("d%d-s%d-u%d", c.desired, c.surge, c.unav), func(t *testing.T) {
			t.Parallel()
			spec := poolSpec(func(s *proxyv1.ProxyPoolSpec) { s.MaxSurge, s.MaxUnavailable = c.surge, c.unav })
			var ms []Member
			for i := range int(c.desired) {
				ms = append(ms, member(fmt.Sprintf("old%d", i), []string{"a", "b"}[i%2], ready, 60, 1, "old"))
			}
			n := 0
			for step := 0; step < 200; step++ {
				plan := Decide(Input{Pool: "web", Spec: spec, Desired: int(c.desired), Members: ms, Now: t0})
				gone := map[string]bool{}
				for _, a := range append(plan.Drain, plan.Delete...) {
					gone[a.UID] = true
				}
				var next []Member
				for _, m := range ms {
					if gone[m.UID] {
						continue
					}
					// What was created last step is Ready now.
					m.Phase, m.NotReadySince = ready, time.Time{}
					next = append(next, m)
				}
				for _, tg := range plan.Create {
					n++
					next = append(next, Member{UID: fmt.Sprint("new", n), Name: fmt.Sprint("new", n), Target: tg, Created: t0,
						Phase: pending, NotReadySince: t0, UpToDate: true, Leases: 0})
				}
				live, readyN, oldN := 0, 0, 0
				for _, m := range next {
					live++
					if m.Ready() {
						readyN++
					}
					if !m.UpToDate {
						oldN++
					}
				}
				if live > int(c.desired+c.surge) {
					t.Fatalf("step %d: %d live proxies, more than %d + surge %d", step, live, c.desired, c.surge)
				}
				if readyN < int(c.desired-c.unav) {
					t.Fatalf("step %d: %d Ready, fewer than %d - unavailable %d", step, readyN, c.desired, c.unav)
				}
				ms = next
				if oldN == 0 && live == int(c.desired) && len(plan.Create) == 0 {
					return
				}
			}
			t.Fatalf("rollout did not finish in 200 steps: %+v", ms)
		})
	}
}

func TestClampAndSurge(t *testing.T) {
	t.Parallel()
	s := poolSpec(func(s *proxyv1.ProxyPoolSpec) {
		s.Autoscaling = &proxyv1.Autoscaling{MinReplicas: 2, MaxReplicas: 5}
	})
	for in, want := range map[int32]int32{0: 2, 3: 3, 9: 5} {
		if got := Clamp(s, in); got != want {
			t.Errorf("Clamp(%d) = %d, want %d", in, got, want)
		}
	}
	if su, un := Surge(s); su != 1 || un != 0 {
		t.Errorf("Surge of 0/0 = %d/%d, want 1/0", su, un)
	}
}

// The status says why each target fails: its provider's health, or a
// recent failure of one of its proxies.
func TestDecideFailingWhy(t *testing.T) {
	t.Parallel()
	plan := Decide(Input{
		Pool: "web", Spec: poolSpec(), Desired: 2, Now: t0,
		ProviderNotReady: map[string]string{"a": "TargetsNotReady: pve1 Unreachable"},
		LastFailure:      map[Target]time.Time{{Provider: "b"}: t0.Add(-time.Minute)},
	})
	want := map[Target]string{
		{Provider: "a"}: "provider NOT_READY: TargetsNotReady: pve1 Unreachable",
		{Provider: "b"}: "a proxy failed at 2026-01-01T11:59:00Z",
	}
	if len(plan.FailingWhy) != len(want) {
		t.Fatalf("failing why = %v, want %v", plan.FailingWhy, want)
	}
	for tg, w := range want {
		if got := plan.FailingWhy[tg]; got != w {
			t.Errorf("why %s fails = %q, want %q", tg, got, w)
		}
	}
}

// A provider that goes NOT_READY hands its missing share to the others,
// and gets it back when it is READY again: sync after sync, with what a
// plan creates turning Ready at the next sync.
func TestDecideProviderNotReadyAndBack(t *testing.T) {
	t.Parallel()
	spec := poolSpec()
	n := 0
	settle := func(ms []Member, notReady map[string]string) []Member {
		t.Helper()
		for step := 0; step < 50; step++ {
			plan := Decide(Input{Pool: "web", Spec: spec, Desired: 4, Members: ms, ProviderNotReady: notReady, Now: t0})
			gone := map[string]bool{}
			for _, a := range append(plan.Drain, plan.Delete...) {
				gone[a.UID] = true
			}
			var next []Member
			for _, m := range ms {
				if !gone[m.UID] {
					m.Phase, m.NotReadySince = ready, time.Time{}
					next = append(next, m)
				}
			}
			for _, tg := range plan.Create {
				n++
				next = append(next, Member{UID: fmt.Sprint("new", n), Name: fmt.Sprint("new", n), Target: tg, Created: t0,
					Phase: pending, NotReadySince: t0, UpToDate: true, Leases: 0})
			}
			if len(plan.Create)+len(plan.Drain)+len(plan.Delete) == 0 && plan.Ready == len(ms) {
				return next
			}
			ms = next
		}
		t.Fatalf("no settled plan in 50 syncs: %+v", ms)
		return nil
	}
	byProvider := func(ms []Member) string {
		c := map[string]int{}
		for _, m := range ms {
			c[m.Target.Provider]++
		}
		return fmt.Sprintf("a=%d b=%d", c["a"], c["b"])
	}
	ms := settle(nil, map[string]string{"b": "TargetsNotReady"})
	if got := byProvider(ms); got != "a=4 b=0" {
		t.Fatalf("with b NOT_READY: %s, want a=4 b=0", got)
	}
	ms = settle(ms, nil)
	if got := byProvider(ms); got != "a=2 b=2" {
		t.Fatalf("with b READY again: %s, want a=2 b=2", got)
	}
}
