package pool

import (
	"fmt"
	"math"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// Demand is what the lease service reported for a pool: the latest report
// and the recent ones the scale-down stabilisation looks back on.
type Demand struct {
	// Pool is the latest report.
	Pool *proxyv1.PoolDemand
	// LeasesByProxyID counts the leases each proxy of the pool holds
	// (proxies without a lease are absent).
	LeasesByProxyID map[string]int
	// Received is when the latest report arrived.
	Received time.Time
	// History holds the reports of the longest stabilisation window,
	// oldest first; Since is when this replica began to listen, so a
	// window that reaches further back is not complete.
	History []Sample
	Since   time.Time
}

// Sample is one demand report as the autoscaler uses it.
type Sample struct {
	At       time.Time
	Active   int64
	Capacity int64
	Leasable int64
	Refused  int64
}

// MaxStale is how old the latest report may be for the autoscaler to act
// on it: a silent lease service changes nothing.
const MaxStale = time.Minute

// Book keeps every pool's demand as reports arrive (on every replica, so
// whichever replica owns a pool next has its history).
type Book struct {
	mu      sync.Mutex
	pools   map[string]*Demand
	since   time.Time
	keep    time.Duration
	nowFunc func() time.Time
}

// NewBook starts a book that keeps keep of history.
func NewBook(keep time.Duration) *Book {
	return &Book{pools: map[string]*Demand{}, since: time.Now(), keep: keep, nowFunc: time.Now}
}

// Record adds a report for a pool.
func (b *Book) Record(pool string, d *proxyv1.PoolDemand, leases map[string]int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.nowFunc()
	if t := d.GetObserveTime(); t != nil && t.AsTime().Before(now) {
		now = t.AsTime()
	}
	cur := b.pools[pool]
	if cur == nil {
		cur = &Demand{Since: b.since}
		b.pools[pool] = cur
	}
	cur.Pool, cur.LeasesByProxyID, cur.Received = d, leases, now
	cur.History = append(cur.History, Sample{At: now, Active: d.GetActiveLeases(), Capacity: d.GetCapacity(),
		Leasable: d.GetLeasableProxies(), Refused: d.GetRefusedAcquires()})
	cut := 0
	for cut < len(cur.History) && now.Sub(cur.History[cut].At) > b.keep {
		cut++
	}
	cur.History = cur.History[cut:]
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
	out.History = append([]Sample(nil), d.History...)
	return &out
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
// only once this replica has heard a whole window. It returns the count
// and the decision, or a nil decision when the count stays.
func Autoscale(s *proxyv1.ProxyPoolSpec, st *proxyv1.ProxyPoolStatus, d *Demand, now time.Time) (int32, *proxyv1.ScalingDecision) {
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
			return decide(clamped, clampReason(clamped, cur), "replicas outside [min_replicas, max_replicas]")
		}
		return cur, nil
	}
	target := targetFraction(a)
	latest := d.History[len(d.History)-1]
	want := Recommend(latest, target, cur)
	inputs := fmt.Sprintf("active leases %d, capacity %d on %d leasable proxies, %d acquires refused, target utilisation %.0f%%",
		latest.Active, latest.Capacity, latest.Leasable, latest.Refused, target*100)
	if want > cur {
		to := min(want, a.GetMaxReplicas())
		if to == cur {
			return cur, nil
		}
		reason := ScaleDemandUp
		if latest.Refused > 0 {
			reason = ScaleRefusedAcquires
		}
		if to < want {
			inputs += fmt.Sprintf("; %d wanted, capped at max_replicas", want)
		}
		return decide(to, reason, inputs)
	}
	window := Stabilization(a)
	if now.Sub(d.Since) < window {
		return decide2(cur, clamped, decide)
	}
	// The highest recommendation within the window.
	highest := want
	for _, smp := range d.History {
		if now.Sub(smp.At) <= window {
			highest = max(highest, Recommend(smp, target, cur))
		}
	}
	to := max(highest, a.GetMinReplicas())
	if to < cur {
		return decide(to, ScaleDemandDown, fmt.Sprintf("%s; the highest count asked within %s is %d", inputs, window, highest))
	}
	return decide2(cur, clamped, decide)
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
