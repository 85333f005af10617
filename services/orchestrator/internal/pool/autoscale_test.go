package pool

import (
	"reflect"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

func TestRecommend(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		s    Sample
		cur  int32
		want int32
	}{
		{"80% of 10 proxies x 10 leases hold 80", Sample{Active: 80, Capacity: 100, Leasable: 10}, 10, 10},
		{"90 leases need 12 at 80%", Sample{Active: 90, Capacity: 100, Leasable: 10}, 10, 12},
		{"idle asks for 0", Sample{Active: 0, Capacity: 100, Leasable: 10}, 10, 0},
		{"refusals add their proxies", Sample{Active: 100, Capacity: 100, Leasable: 10, Refused: 25}, 10, 13},
		{"no leasable proxy: refusals add one each", Sample{Refused: 3}, 0, 3},
		{"unlimited capacity keeps the count", Sample{Active: 500, Leasable: 4}, 4, 4},
	}
	for _, tc := range cases {
		if got := Recommend(tc.s, 0.8, tc.cur); got != tc.want {
			t.Errorf("%s: Recommend = %d, want %d", tc.name, got, tc.want)
		}
	}
}

func TestAutoscale(t *testing.T) {
	t.Parallel()
	spec := poolSpec(func(s *proxyv1.ProxyPoolSpec) {
		s.Autoscaling = &proxyv1.Autoscaling{MinReplicas: 2, MaxReplicas: 20, ScaleDownStabilization: durationpb.New(5 * time.Minute)}
	})
	// history builds the latest report and the pool's history of the
	// reports before it, at the given minutes before t0 with these active
	// leases (10 proxies of 10 leases each, 10 desired); since is how far
	// back the history reaches.
	history := func(since time.Duration, actives map[int]int64) (*Demand, store.ScaleHistory) {
		h := store.ScaleHistory{Since: t0.Add(-since)}
		var d *Demand
		for ago := 30; ago >= 0; ago-- {
			a, ok := actives[ago]
			if !ok {
				continue
			}
			if d != nil {
				h = remember(h, d.Received, Recommend(d.sample(), targetFraction(spec.GetAutoscaling()), 10), Stabilization(spec.GetAutoscaling()))
			}
			d = &Demand{Received: t0.Add(-time.Duration(ago) * time.Minute), Pool: &proxyv1.PoolDemand{ActiveLeases: a, Capacity: 100, LeasableProxies: 10}}
		}
		return d, h
	}
	st := func(desired int32) *proxyv1.ProxyPoolStatus {
		return &proxyv1.ProxyPoolStatus{DesiredReplicas: desired}
	}
	type hd struct {
		d *Demand
		h store.ScaleHistory
	}
	of := func(d *Demand, h store.ScaleHistory) hd { return hd{d, h} }
	cases := []struct {
		name       string
		desired    int32
		demand     hd
		want       int32
		wantReason string
	}{
		{"no demand keeps the count", 10, hd{}, 10, ""},
		{"up at once", 10, of(history(time.Hour, map[int]int64{0: 160})), 20, ScaleDemandUp},
		{"up capped at max", 10, of(history(time.Hour, map[int]int64{0: 400})), 20, ScaleDemandUp},
		{"down waits for the window: a high report 3 minutes ago holds", 10, of(history(time.Hour, map[int]int64{3: 80, 0: 16})), 10, ""},
		{"down after a quiet window, to the highest within it", 10, of(history(time.Hour, map[int]int64{10: 80, 4: 24, 0: 16})), 3, ScaleDemandDown},
		{"down never below min", 10, of(history(time.Hour, map[int]int64{10: 80, 0: 0})), 2, ScaleDemandDown},
		{"no down before the history covers a whole window", 10, of(history(2*time.Minute, map[int]int64{1: 0, 0: 0})), 10, ""},
		{"a stale report changes nothing", 10, of(history(time.Hour, map[int]int64{5: 400})), 10, ""},
		{"below min is raised", 1, hd{}, 2, ScaleClampedToMin},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, d, _ := Autoscale(spec, st(tc.desired), tc.demand.d, tc.demand.h, t0)
			if got != tc.want {
				t.Errorf("count = %d, want %d", got, tc.want)
			}
			if d.GetReason() != tc.wantReason {
				t.Errorf("reason = %q, want %q (%s)", d.GetReason(), tc.wantReason, d.GetMessage())
			}
			if d != nil && (d.GetFromReplicas() != tc.desired || d.GetToReplicas() != got) {
				t.Errorf("decision %d->%d, want %d->%d", d.GetFromReplicas(), d.GetToReplicas(), tc.desired, got)
			}
		})
	}
}

// TestRememberKeepsTheWindow: the history keeps, in decreasing order of
// count, only the steps some part of the window still needs.
func TestRememberKeepsTheWindow(t *testing.T) {
	t.Parallel()
	var h store.ScaleHistory
	at := func(min int) time.Time { return t0.Add(time.Duration(min) * time.Minute) }
	for i, want := range []int32{5, 3, 4, 2, 2, 1} {
		h = remember(h, at(i), want, 3*time.Minute)
	}
	// Minute 5: 5 (minute 0) and 3 (minute 1) are out of the window, 4
	// (minute 2) still in; 2 (minute 3) was covered by the 2 of minute 4.
	want := []store.ScaleStep{{At: at(2), Want: 4}, {At: at(4), Want: 2}, {At: at(5), Want: 1}}
	if !reflect.DeepEqual(h.Steps, want) || !h.Since.Equal(at(0)) || !h.Last.Equal(at(5)) {
		t.Fatalf("history %+v, want steps %+v since minute 0, last minute 5", h, want)
	}
	if again := remember(h, at(5), 9, 3*time.Minute); !reflect.DeepEqual(again, h) {
		t.Errorf("a report recorded twice changed the history: %+v", again)
	}
}

func TestBookKeepsTheLatest(t *testing.T) {
	t.Parallel()
	b := NewBook()
	now := t0
	b.nowFunc = func() time.Time { return now }
	for i := 0; i < 10; i++ {
		b.Record("web", &proxyv1.PoolDemand{ActiveLeases: int64(i)}, map[string]int{"u": i})
		now = now.Add(time.Minute)
	}
	d := b.Get("web")
	if d.Pool.GetActiveLeases() != 9 || d.LeasesByProxyID["u"] != 9 || !d.Received.Equal(t0.Add(9*time.Minute)) {
		t.Fatalf("latest %v received %v", d.Pool, d.Received)
	}
	if b.Get("other") != nil {
		t.Fatal("a pool never reported has demand")
	}
}
