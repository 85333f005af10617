package pool

import (
	"fmt"
	"math"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// Demand is what the lease service last reported for a pool.
type Demand struct {
	// Pool is the latest report.
	Pool *proxyv1.PoolDemand
	// LeasesByProxyID counts the leases each proxy of the pool holds
	// (proxies without a lease are absent).
	LeasesByProxyID map[string]int
	// Received is when the latest report arrived (its observe time when
	// that is earlier).
	Received time.Time
}

// Sample is one demand report as the autoscaler uses it.
type Sample struct {
	Active   int64
	Capacity int64
	Leasable int64
	Refused  int64
}

// sample is the latest report as a Sample.
func (d *Demand) sample() Sample {
	p := d.Pool
	return Sample{Active: p.GetActiveLeases(), Capacity: p.GetCapacity(), Leasable: p.GetLeasableProxies(), Refused: p.GetRefusedAcquires()}
}

// MaxStale is how old the latest report may be for the autoscaler to act
// on it: a silent lease service changes nothing.
const MaxStale = time.Minute

// Book keeps every pool's latest demand as reports arrive (on every
// replica, so whichever replica owns a pool next has it). What the
// scale-downs look back on is kept with the pool (store.ScaleHistory).
type Book struct {
	mu      sync.Mutex
	pools   map[string]*Demand
	nowFunc func() time.Time
}

// NewBook starts an empty book.
func NewBook() *Book {
	return &Book{pools: map[string]*Demand{}, nowFunc: time.Now}
}

// Record replaces a pool's latest report.
func (b *Book) Record(pool string, d *proxyv1.PoolDemand, leases map[string]int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.nowFunc()
	if t := d.GetObserveTime(); t != nil && t.AsTime().Before(now) {
		now = t.AsTime()
	}
	b.pools[pool] = &Demand{Pool: d, LeasesByProxyID: leases, Received: now}
}

// Get returns a copy of a pool's demand, nil when none was reported.
func (b *Book) Get(pool string) *Demand {
	b.mu.Lock()
	defer b.mu.Unlock()
	d := b.pools[pool]
	if d == nil {
		return nil
	}
	out := *d
	out.Pool = proto.Clone(d.Pool).(*proxyv1.PoolDemand)
	return &out
}

// remember adds the count a report received at asked for to h, and drops
// what the window no longer covers. Steps stay in decreasing order of
// count: a step is dropped once a later one asks for as many, since the
// later one covers every window the earlier one is in.
func remember(h store.ScaleHistory, at time.Time, want int32, window time.Duration) store.ScaleHistory {
	if h.Since.IsZero() {
		h.Since = at
	}
	if at.After(h.Last) {
		h.Last = at
		steps := append([]store.ScaleStep(nil), h.Steps...)
		for len(steps) > 0 && steps[len(steps)-1].Want <= want {
			steps = steps[:len(steps)-1]
		}
		h.Steps = append(steps, store.ScaleStep{At: at, Want: want})
	}
	cut := 0
	for cut < len(h.Steps)-1 && at.Sub(h.Steps[cut].At) > window {
		cut++
	}
	h.Steps = h.Steps[cut:]
	return h
}

// Target is the autoscaling's utilisation target as a fraction.
func targetFraction(a *proxyv1.Autoscaling) float64 {
	p := a.GetTargetUtilizationPercent()
	if p == 0 {
		p = DefaultTargetUtilization
	}
	return float64(p) / 100
}

// Stabilization is the scale-down window of a spec.
func Stabilization(a *proxyv1.Autoscaling) time.Duration {
	if a.GetScaleDownStabilization() == nil {
		return DefaultStabilization
	}
	return a.GetScaleDownStabilization().AsDuration()
}

// Recommend is the count one sample asks for: enough proxies for the
// active leases at the target utilisation, plus room for the refused
// acquires. cur is the count the pool has now.
func Recommend(s Sample, target float64, cur int32) int32 {
	if s.Leasable <= 0 || s.Capacity <= 0 {
		// Nothing to measure against (no leasable proxy, or unlimited
		// capacity): only refusals ask for more.
		if s.Refused > 0 {
			return cur + int32(s.Refused)
		}
		return cur
	}
	perProxy := float64(s.Capacity) / float64(s.Leasable)
	want := int32(math.Ceil(float64(s.Active) / (perProxy * target)))
	if s.Refused > 0 {
		want = max(want, cur+int32(math.Ceil(float64(s.Refused)/perProxy)))
	}
	return want
}

// Autoscale decides the desired count of an autoscaled pool from its
// demand: up at once to what the latest report asks for, down only to the
// highest count any report of the stabilisation window asked for, and
// only once the pool's history covers a whole window. It returns the
// count and the decision (nil when the count stays), and the history with
// the latest report in it.
func Autoscale(s *proxyv1.ProxyPoolSpec, st *proxyv1.ProxyPoolStatus, d *Demand, h store.ScaleHistory, now time.Time) (int32, *proxyv1.ScalingDecision, store.ScaleHistory) {
	a := s.GetAutoscaling()
	cur := st.GetDesiredReplicas()
	clamped := Clamp(s, cur)
	decide := func(to int32, reason, msg string) (int32, *proxyv1.ScalingDecision) {
		return to, &proxyv1.ScalingDecision{
			Time: timestamppb.New(now), FromReplicas: cur, ToReplicas: to, Reason: reason, Message: msg,
			Demand: d.GetPoolOrNil(),
		}
	}
	if d == nil || d.Pool == nil || now.Sub(d.Received) > MaxStale {
		if clamped != cur {
			to, dec := decide(clamped, clampReason(clamped, cur), "replicas outside [min_replicas, max_replicas]")
			return to, dec, h
		}
		return cur, nil, h
	}
	target := targetFraction(a)
	latest := d.sample()
	want := Recommend(latest, target, cur)
	window := Stabilization(a)
	h = remember(h, d.Received, want, window)
	inputs := fmt.Sprintf("active leases %d, capacity %d on %d leasable proxies, %d acquires refused, target utilisation %.0f%%",
		latest.Active, latest.Capacity, latest.Leasable, latest.Refused, target*100)
	if want > cur {
		to := min(want, a.GetMaxReplicas())
		if to == cur {
			return cur, nil, h
		}
		reason := ScaleDemandUp
		if latest.Refused > 0 {
			reason = ScaleRefusedAcquires
		}
		if to < want {
			inputs += fmt.Sprintf("; %d wanted, capped at max_replicas", want)
		}
		to, dec := decide(to, reason, inputs)
		return to, dec, h
	}
	if now.Sub(h.Since) < window {
		to, dec := decide2(cur, clamped, decide)
		return to, dec, h
	}
	// The highest count asked within the window: its first step.
	highest := want
	for _, step := range h.Steps {
		if now.Sub(step.At) <= window {
			highest = max(highest, step.Want)
			break
		}
	}
	to := max(highest, a.GetMinReplicas())
	if to < cur {
		to, dec := decide(to, ScaleDemandDown, fmt.Sprintf("%s; the highest count asked within %s is %d", inputs, window, highest))
		return to, dec, h
	}
	to, dec := decide2(cur, clamped, decide)
	return to, dec, h
}

func decide2(cur, clamped int32, decide func(int32, string, string) (int32, *proxyv1.ScalingDecision)) (int32, *proxyv1.ScalingDecision) {
	if clamped != cur {
		return decide(clamped, clampReason(clamped, cur), "replicas outside [min_replicas, max_replicas]")
	}
	return cur, nil
}

func clampReason(to, from int32) string {
	if to > from {
		return ScaleClampedToMin
	}
	return ScaleClampedToMax
}

// GetPoolOrNil is the latest report, nil-safe.
func (d *Demand) GetPoolOrNil() *proxyv1.PoolDemand {
	if d == nil {
		return nil
	}
	return d.Pool
}
