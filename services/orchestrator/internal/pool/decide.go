package pool

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
)

func ts(t time.Time) *timestamppb.Timestamp { return timestamppb.New(t) }

// Member is what the decisions need to know of one proxy of a pool.
type Member struct {
	UID    string
	Name   string
	Target Target
	// Created is when the proxy was created (its age for max_age).
	Created time.Time
	Phase   proxyv1.ProxyPhase
	Reason  lifecycle.Reason
	// NotReadySince is when the proxy last stopped being Ready (or was
	// created); zero while it is Ready.
	NotReadySince time.Time
	// UpToDate: made from the pool's current template.
	UpToDate bool
	Draining bool
	// DrainDeadline is when a draining proxy goes regardless of leases.
	DrainDeadline time.Time
	Deleting      bool
	// Leases is the number of leases the proxy holds as the lease service
	// last reported; -1 when unknown.
	Leases int
}

// Ready reports whether the member is leasable.
func (m *Member) Ready() bool { return m.Phase == proxyv1.ProxyPhase_PROXY_PHASE_READY }

// neverServed reports whether the proxy cannot hold a lease: it never got
// an address or it failed, so it is deleted without draining.
func (m *Member) neverServed() bool {
	switch m.Phase {
	case proxyv1.ProxyPhase_PROXY_PHASE_PENDING, proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, proxyv1.ProxyPhase_PROXY_PHASE_FAILED:
		return true
	}
	return false
}

// failed reports whether the member shows its target failing.
func (m *Member) failed() bool {
	return m.Phase == proxyv1.ProxyPhase_PROXY_PHASE_FAILED || m.Reason == lifecycle.ReasonQuotaExceeded
}

// Input is everything one decision about a pool is made from.
type Input struct {
	Pool    string
	Spec    *proxyv1.ProxyPoolSpec
	Deleted bool
	// Desired is the count to aim at (spec.replicas or the autoscaler's).
	Desired int
	Members []Member
	// LastFailure is, per target, when a proxy there last failed (from the
	// previous status); a target is failing within FailureHold of it.
	LastFailure map[Target]time.Time
	// ProviderNotReady lists providers whose backend health is NOT_READY,
	// each with why (the health service's reason and failing targets).
	ProviderNotReady map[string]string
	Now              time.Time
	// FailureHold is how long a target counts as failing after its last
	// failure; 0 means the unhealthy grace.
	FailureHold time.Duration
}

// Action is one change the controller makes to a proxy.
type Action struct {
	UID    string
	Name   string
	Reason string
}

// Plan is what the controller does in one sync of a pool.
type Plan struct {
	// Create lists the targets of the proxies to create, one entry each.
	Create []Target
	// Drain lists proxies to mark draining.
	Drain []Action
	// Delete lists proxies to delete now.
	Delete []Action

	// The status the plan leads to, as counted before it is applied.
	Current, Ready, Updated, Draining int
	Spread                            []*proxyv1.SpreadStatus
	// Failing lists the failing targets; FailingWhy says why each fails.
	Failing    []Target
	FailingWhy map[Target]string
	// Progressing says why the pool is still moving; empty when settled.
	Progressing string
	// Available: at least desired - max_unavailable proxies are Ready.
	Available bool
}

func durOr(d interface{ AsDuration() time.Duration }, isNil bool, def time.Duration) time.Duration {
	if isNil {
		return def
	}
	return d.AsDuration()
}

// Surge returns max_surge and max_unavailable as counts, max_surge 1 when
// both are 0 (a rollout must be able to move).
func Surge(s *proxyv1.ProxyPoolSpec) (surge, unavailable int) {
	surge, unavailable = int(s.GetMaxSurge()), int(s.GetMaxUnavailable())
	if surge == 0 && unavailable == 0 {
		surge = DefaultMaxSurgeWhenBothZero
	}
	return surge, unavailable
}

// UnhealthyGrace is the spec's grace or its default.
func UnhealthyGrace(s *proxyv1.ProxyPoolSpec) time.Duration {
	return durOr(s.GetUnhealthyGrace(), s.GetUnhealthyGrace() == nil, DefaultUnhealthyGrace)
}

// DrainTimeout is the spec's drain timeout or its default.
func DrainTimeout(s *proxyv1.ProxyPoolSpec) time.Duration {
	return durOr(s.GetDrainTimeout(), s.GetDrainTimeout() == nil, DefaultDrainTimeout)
}

// Clamp bounds n by the autoscaling limits (none without autoscaling).
func Clamp(s *proxyv1.ProxyPoolSpec, n int32) int32 {
	if a := s.GetAutoscaling(); a != nil {
		return min(max(n, a.GetMinReplicas()), a.GetMaxReplicas())
	}
	return n
}

// Distribute splits n over weights by largest remainder; ties go to the
// earlier entry.
func Distribute(n int, weights []int) []int {
	out := make([]int, len(weights))
	total := 0
	for _, w := range weights {
		total += w
	}
	if total == 0 || n <= 0 {
		return out
	}
	type rem struct{ i, r int }
	rems := make([]rem, len(weights))
	given := 0
	for i, w := range weights {
		out[i] = n * w / total
		given += out[i]
		rems[i] = rem{i, n * w % total}
	}
	slices.SortStableFunc(rems, func(a, b rem) int { return cmp.Compare(b.r, a.r) })
	for k := 0; given < n; k++ {
		out[rems[k%len(rems)].i]++
		given++
	}
	return out
}

// Decide computes one sync of a pool. It is pure: the same input gives the
// same plan.
func Decide(in Input) Plan {
	var plan Plan
	s := in.Spec
	targets, weights := Targets(s)
	grace := UnhealthyGrace(s)
	hold := in.FailureHold
	if hold <= 0 {
		hold = grace
	}
	surge, unavailable := Surge(s)
	desired := in.Desired
	if in.Deleted {
		desired = 0
	}
	maxAge := time.Duration(0)
	if s.GetMaxAge() != nil {
		maxAge = s.GetMaxAge().AsDuration()
	}

	idx := map[Target]int{}
	for i, t := range targets {
		idx[t] = i
	}
	// Failing targets: a recent failure, a failed member now, or the
	// provider's backend not ready.
	failing := make([]bool, len(targets))
	why := make([]string, len(targets))
	lastFailure := make([]time.Time, len(targets))
	for i, t := range targets {
		lastFailure[i] = in.LastFailure[t]
		if reason, ok := in.ProviderNotReady[t.Provider]; ok {
			failing[i] = true
			why[i] = "provider NOT_READY"
			if reason != "" {
				why[i] += ": " + reason
			}
		}
	}
	for i := range in.Members {
		m := &in.Members[i]
		if j, ok := idx[m.Target]; ok && m.failed() && !m.Deleting {
			lastFailure[j] = in.Now
		}
	}
	for i := range targets {
		if !lastFailure[i].IsZero() && in.Now.Sub(lastFailure[i]) < hold {
			failing[i] = true
			if why[i] == "" {
				why[i] = "a proxy failed at " + lastFailure[i].UTC().Format(time.RFC3339)
			}
		}
	}

	// Sort members: draining/deleting aside; the live ones judged.
	var live []*Member
	for i := range in.Members {
		m := &in.Members[i]
		switch {
		case m.Deleting:
		case m.Draining:
			plan.Draining++
			leasesDone := m.Leases == 0 || (m.Leases < 0 && m.neverServed())
			if leasesDone || !in.Now.Before(m.DrainDeadline) {
				why := RemoveDrainedNoLeases
				if !leasesDone {
					why = RemoveDrainTimeout
				}
				plan.Delete = append(plan.Delete, Action{m.UID, m.Name, why})
			}
		default:
			live = append(live, m)
		}
	}

	// Bad members go at once: failed, or not Ready for longer than grace.
	var keep []*Member
	remove := func(m *Member, why string) { remove2(&plan, m, why) }
	for _, m := range live {
		switch {
		case m.Phase == proxyv1.ProxyPhase_PROXY_PHASE_FAILED:
			remove(m, RemoveFailed)
		case m.Reason == lifecycle.ReasonQuotaExceeded:
			remove(m, RemoveQuotaExceeded)
		case !m.Ready() && !m.NotReadySince.IsZero() && in.Now.Sub(m.NotReadySince) > grace:
			remove(m, RemoveUnhealthy)
		case !slices.Contains(targets, m.Target):
			remove(m, RemoveNotInSpread)
		default:
			keep = append(keep, m)
		}
	}

	// Each target's share: a failing target keeps what it has (up to its
	// share), the rest goes to the healthy ones by weight.
	perTarget := make([][]*Member, len(targets))
	for _, m := range keep {
		j := idx[m.Target]
		perTarget[j] = append(perTarget[j], m)
	}
	base := Distribute(desired, weights)
	share := make([]int, len(targets))
	var healthyW []int
	var healthyI []int
	rest := desired
	for i := range targets {
		if failing[i] {
			share[i] = min(base[i], len(perTarget[i]))
			rest -= share[i]
		} else {
			healthyI = append(healthyI, i)
			healthyW = append(healthyW, weights[i])
		}
	}
	if len(healthyI) == 0 {
		copy(share, base)
	} else {
		for k, n := range Distribute(rest, healthyW) {
			share[healthyI[k]] = n
		}
	}

	// Old members: another template, past max_age, or beyond their
	// target's share while another target lacks proxies.
	old := map[*Member]bool{}
	deficit := 0
	for i := range targets {
		deficit += max(0, share[i]-len(perTarget[i]))
	}
	for i := range targets {
		ms := perTarget[i]
		// Newest first, so the oldest are the excess.
		slices.SortStableFunc(ms, func(a, b *Member) int { return b.Created.Compare(a.Created) })
		for k, m := range ms {
			if !m.UpToDate || (maxAge > 0 && in.Now.Sub(m.Created) >= maxAge) || (k >= share[i] && deficit > 0 && !failing[i]) {
				old[m] = true
			}
		}
	}

	readyKeep := 0
	for _, m := range keep {
		if m.Ready() {
			readyKeep++
		}
	}
	// Counts per target of the members that stay (not old), plus what
	// this plan creates there.
	fresh := make([]int, len(targets))
	for _, m := range keep {
		if !old[m] {
			fresh[idx[m.Target]]++
		}
	}
	nOld := len(old)
	liveN := len(keep)
	create := func(n int) {
		for ; n > 0; n-- {
			best, bestGap := -1, 0
			for i := range targets {
				if failing[i] && len(healthyI) > 0 {
					continue
				}
				if gap := share[i] - fresh[i]; best < 0 || gap > bestGap {
					best, bestGap = i, gap
				}
			}
			fresh[best]++
			liveN++
			plan.Create = append(plan.Create, targets[best])
		}
	}

	// 1. Up to the desired count of fresh members (replacing the bad
	// ones and scaling up); old members still count as live for surge.
	freshN := liveN - nOld
	if need := desired - freshN; need > 0 {
		room := desired + surge - liveN
		if nOld == 0 {
			room = desired - liveN
		}
		create(min(need, max(0, room)))
	}

	// 2. Drain old members while Ready stays at desired - max_unavailable,
	// preferring the not Ready, then those without leases.
	minReady := desired - unavailable
	olds := make([]*Member, 0, nOld)
	for m := range old {
		olds = append(olds, m)
	}
	slices.SortFunc(olds, drainOrder)
	readyAfter := readyKeep
	for _, m := range olds {
		if m.Ready() {
			if readyAfter-1 < minReady {
				continue
			}
			readyAfter--
		}
		remove2(&plan, m, oldReason(m, maxAge, in.Now))
		nOld--
	}

	// 3. Scale down: more live fresh members than desired.
	var fresher []*Member
	for _, m := range keep {
		if !old[m] {
			fresher = append(fresher, m)
		}
	}
	if excess := len(fresher) + len(plan.Create) - desired; excess > 0 && len(plan.Create) == 0 {
		// Prefer the target most over its share, then drainOrder.
		over := make([]int, len(targets))
		for i := range targets {
			over[i] = fresh[i] - share[i]
		}
		for ; excess > 0; excess-- {
			var pick *Member
			for _, m := range fresher {
				if m == nil {
					continue
				}
				if pick == nil || over[idx[m.Target]] > over[idx[pick.Target]] ||
					(over[idx[m.Target]] == over[idx[pick.Target]] && drainOrder(m, pick) < 0) {
					pick = m
				}
			}
			if pick == nil {
				break
			}
			over[idx[pick.Target]]--
			fresh[idx[pick.Target]]--
			for k := range fresher {
				if fresher[k] == pick {
					fresher[k] = nil
				}
			}
			remove2(&plan, pick, RemoveScaleDown)
		}
	}

	// Status.
	for _, m := range keep {
		plan.Current++
		if m.Ready() {
			plan.Ready++
		}
		if m.UpToDate {
			plan.Updated++
		}
	}
	for _, m := range live {
		if !slices.Contains(keep, m) {
			plan.Current++ // still there until the plan is applied
		}
	}
	for i, t := range targets {
		st := &proxyv1.SpreadStatus{Provider: t.Provider, Zone: t.Zone, Desired: int32(share[i]), Failing: failing[i]}
		for _, m := range keep {
			if m.Target == t {
				st.Current++
				if m.Ready() {
					st.Ready++
				}
			}
		}
		if !lastFailure[i].IsZero() {
			st.LastFailureTime = ts(lastFailure[i])
		}
		plan.Spread = append(plan.Spread, st)
		if failing[i] {
			plan.Failing = append(plan.Failing, t)
			if plan.FailingWhy == nil {
				plan.FailingWhy = map[Target]string{}
			}
			plan.FailingWhy[t] = why[i]
		}
	}
	plan.Available = plan.Ready >= desired-unavailable
	switch {
	case len(plan.Create) > 0 || len(plan.Drain) > 0 || len(plan.Delete) > 0:
		plan.Progressing = fmt.Sprintf("creating %d, draining %d, deleting %d", len(plan.Create), len(plan.Drain), len(plan.Delete))
	case nOld > 0:
		plan.Progressing = fmt.Sprintf("%d proxies wait to be replaced", nOld)
	case plan.Ready < desired:
		plan.Progressing = fmt.Sprintf("%d of %d proxies Ready", plan.Ready, desired)
	case plan.Draining > 0:
		plan.Progressing = fmt.Sprintf("%d proxies draining", plan.Draining)
	}
	return plan
}

// remove2 drains a member that may hold leases and deletes one that
// cannot.
func remove2(plan *Plan, m *Member, why string) {
	if m.neverServed() || m.Leases == 0 {
		plan.Delete = append(plan.Delete, Action{m.UID, m.Name, why})
		return
	}
	plan.Drain = append(plan.Drain, Action{m.UID, m.Name, why})
}

func oldReason(m *Member, maxAge time.Duration, now time.Time) string {
	switch {
	case !m.UpToDate:
		return RemoveTemplateChanged
	case maxAge > 0 && now.Sub(m.Created) >= maxAge:
		return RemoveMaxAge
	}
	return RemoveRebalance
}

// drainOrder sorts the members a pool gives up first: not Ready before
// Ready, no leases before some, fewer leases before more, older before
// newer.
func drainOrder(a, b *Member) int {
	if a.Ready() != b.Ready() {
		if !a.Ready() {
			return -1
		}
		return 1
	}
	la, lb := a.Leases, b.Leases
	if la < 0 {
		la = 1 << 30 // unknown: as if busy
	}
	if lb < 0 {
		lb = 1 << 30
	}
	if c := cmp.Compare(la, lb); c != 0 {
		return c
	}
	if c := a.Created.Compare(b.Created); c != 0 {
		return c
	}
	return cmp.Compare(a.Name, b.Name)
}
