package pool

import (
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
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
	// history builds a demand whose reports came at the given minutes
	// before t0 with these active leases (10 proxies of 10 leases each).
	history := func(listening time.Duration, actives map[int]int64) *Demand {
		d := &Demand{Since: t0.Add(-listening)}
		for ago := 30; ago >= 0; ago-- {
			if a, ok := actives[ago]; ok {
				at := t0.Add(-time.Duration(ago) * time.Minute)
				d.History = append(d.History, Sample{At: at, Active: a, Capacity: 100, Leasable: 10})
				d.Received = at
				d.Pool = &proxyv1.PoolDemand{ActiveLeases: a, Capacity: 100, LeasableProxies: 10}
			}
		}
		return d
	}
	st := func(desired int32) *proxyv1.ProxyPoolStatus {
		return &proxyv1.ProxyPoolStatus{DesiredReplicas: desired}
	}
	cases := []struct {
		name       string
		desired    int32
		demand     *Demand
		want       int32
		wantReason string
	}{
		{"no demand keeps the count", 10, nil, 10, ""},
		{"up at once", 10, history(time.Hour, map[int]int64{0: 160}), 20, ScaleDemandUp},
		{"up capped at max", 10, history(time.Hour, map[int]int64{0: 400}), 20, ScaleDemandUp},
		{"down waits for the window: a high report 3 minutes ago holds", 10, history(time.Hour, map[int]int64{3: 80, 0: 16}), 10, ""},
		{"down after a quiet window, to the highest within it", 10, history(time.Hour, map[int]int64{10: 80, 4: 24, 0: 16}), 3, ScaleDemandDown},
		{"down never below min", 10, history(time.Hour, map[int]int64{10: 80, 0: 0}), 2, ScaleDemandDown},
		{"no down before this replica heard a whole window", 10, history(2*time.Minute, map[int]int64{1: 0, 0: 0}), 10, ""},
		{"a stale report changes nothing", 10, history(time.Hour, map[int]int64{5: 400}), 10, ""},
		{"below min is raised", 1, nil, 2, ScaleClampedToMin},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, d := Autoscale(spec, st(tc.desired), tc.demand, t0)
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

func TestBookKeepsTheWindow(t *testing.T) {
	t.Parallel()
	b := NewBook(5 * time.Minute)
	now := t0
	b.nowFunc = func() time.Time { return now }
	for i := 0; i < 10; i++ {
		b.Record("web", &proxyv1.PoolDemand{ActiveLeases: int64(i)}, map[string]int{"u": i})
		now = now.Add(time.Minute)
	}
	d := b.Get("web")
	if len(d.History) != 6 || d.History[0].Active != 4 || d.Pool.GetActiveLeases() != 9 || d.LeasesByProxyID["u"] != 9 {
		t.Fatalf("history %+v, latest %v", d.History, d.Pool)
	}
	if b.Get("other") != nil {
		t.Fatal("a pool never reported has demand")
	}
}
