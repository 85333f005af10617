package store

import (
	"testing"
	"time"
)

// testView builds a view from proxies given in any order.
func testView(ps ...*viewProxy) *view {
	v := newView()
	for _, p := range ps {
		if p.capacity == 0 && p.name != "unlimited" {
			p.capacity = 1
		}
		v.all[p.uid] = p
		if p.leasable {
			v.order.insert(p)
		}
	}
	return v
}

func TestViewPicksInSelectionOrder(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name    string
		proxies []*viewProxy
		want    string
	}{
		{"fewest active leases first", []*viewProxy{
			{uid: "a", leasable: true, capacity: 3, active: 2},
			{uid: "b", leasable: true, capacity: 3, active: 1, lastLease: t0},
		}, "b"},
		{"leases of rounds in flight count", []*viewProxy{
			{uid: "a", leasable: true, capacity: 3, pending: 2},
			{uid: "b", leasable: true, capacity: 3, active: 1, lastLease: t0},
		}, "b"},
		{"never leased before least recently leased", []*viewProxy{
			{uid: "a", leasable: true, lastLease: t0},
			{uid: "b", leasable: true},
		}, "b"},
		{"least recently leased first", []*viewProxy{
			{uid: "a", leasable: true, lastLease: t0.Add(time.Second)},
			{uid: "b", leasable: true, lastLease: t0},
		}, "b"},
		{"then the stable random tie-break", []*viewProxy{
			{uid: "a", leasable: true, tiebreak: 7},
			{uid: "b", leasable: true, tiebreak: -3},
		}, "b"},
		{"at capacity is skipped", []*viewProxy{
			{uid: "a", leasable: true, capacity: 1, active: 1},
			{uid: "b", leasable: true, capacity: 2, active: 1, lastLease: t0},
		}, "b"},
		{"unlimited capacity is never full", []*viewProxy{
			{uid: "a", name: "unlimited", leasable: true, active: 1000},
		}, "a"},
		{"not leasable is never offered", []*viewProxy{
			{uid: "a", leasable: false},
		}, ""},
		{"cooling down for the target is skipped", []*viewProxy{
			{uid: "a", leasable: true, cooldowns: map[string]time.Time{"shop.example.com": t0.Add(time.Minute)}},
			{uid: "b", leasable: true, lastLease: t0},
		}, "b"},
		{"cooling down globally is skipped", []*viewProxy{
			{uid: "a", leasable: true, cooldowns: map[string]time.Time{"": t0.Add(time.Minute)}},
			{uid: "b", leasable: true, lastLease: t0},
		}, "b"},
		{"a cooldown for another target does not matter", []*viewProxy{
			{uid: "a", leasable: true, cooldowns: map[string]time.Time{"other.example.com": t0.Add(time.Minute)}},
			{uid: "b", leasable: true, lastLease: t0},
		}, "a"},
		{"an ended cooldown does not matter", []*viewProxy{
			{uid: "a", leasable: true, cooldowns: map[string]time.Time{"": t0}},
			{uid: "b", leasable: true, lastLease: t0},
		}, "a"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := testView(tc.proxies...)
			pendingBefore := map[string]int{}
			for _, p := range tc.proxies {
				pendingBefore[p.uid] = p.pending
			}
			got := v.pick(Selector{}, "shop.example.com", t0)
			switch {
			case tc.want == "" && got != nil:
				t.Fatalf("picked %s, want none", got.uid)
			case tc.want == "":
			case got == nil:
				t.Fatalf("picked none, want %s", tc.want)
			case got.uid != tc.want:
				t.Fatalf("picked %s, want %s", got.uid, tc.want)
			default:
				if got.pending != pendingBefore[got.uid]+1 || !got.lastLease.Equal(t0) {
					t.Errorf("after the pick: pending %d, last lease %v", got.pending, got.lastLease)
				}
			}
		})
	}
}

func TestViewPendingThenSettle(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	v := testView(&viewProxy{uid: "a", leasable: true, capacity: 2}, &viewProxy{uid: "b", leasable: true, capacity: 2})
	// Four acquires in flight fill both proxies; a fifth finds none.
	for i := range 4 {
		if p := v.pick(Selector{}, "", now); p == nil {
			t.Fatalf("pick %d found nothing", i)
		}
	}
	if p := v.pick(Selector{}, "", now); p != nil {
		t.Fatalf("a fifth pick got %s, want none: both proxies are full with rounds in flight", p.uid)
	}
	// The database granted a's two and refused b's two (another replica
	// holds b): a is full, b has room for none until the count moves.
	v.settle("a", 2, 1)
	v.settle("a", 2, 1)
	v.settle("b", 2, 1)
	v.settle("b", 2, 1)
	if p := v.pick(Selector{}, "", now); p != nil {
		t.Fatalf("picked %s, want none", p.uid)
	}
	v.setActive("b", 1, 2)
	if p := v.pick(Selector{}, "", now); p == nil || p.uid != "b" {
		t.Fatalf("picked %v, want b after its count dropped", p)
	}
}

func TestViewSelectorMatching(t *testing.T) {
	t.Parallel()
	now := time.Now()
	v := testView(
		&viewProxy{uid: "a", leasable: true, provider: "pve", region: "eu", zone: "eu-1", labels: map[string]string{"pool": "x"}},
		&viewProxy{uid: "b", leasable: true, provider: "gce", region: "eu", zone: "eu-2", labels: map[string]string{"pool": "x", "tier": "1"}},
	)
	for _, tc := range []struct {
		sel  Selector
		want string
	}{
		{Selector{Provider: "gce"}, "b"},
		{Selector{Zone: "eu-1"}, "a"},
		{Selector{Region: "eu", Labels: map[string]string{"tier": "1"}}, "b"},
		{Selector{Labels: map[string]string{"pool": "y"}}, ""},
		{Selector{Region: "us"}, ""},
	} {
		v.all["a"].pending, v.all["b"].pending = 0, 0
		got := v.pick(tc.sel, "", now)
		if tc.want == "" && got != nil || tc.want != "" && (got == nil || got.uid != tc.want) {
			t.Errorf("pick(%+v) = %v, want %q", tc.sel, got, tc.want)
		}
		if got != nil {
			v.settle(got.uid, 0, 1)
		}
	}
}

func TestViewUnavailableArithmetic(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	later := now.Add(time.Minute)
	v := testView(
		&viewProxy{uid: "sick", leasable: false, labels: map[string]string{"pool": "x"}},
		&viewProxy{uid: "full", leasable: true, active: 1, labels: map[string]string{"pool": "x"}},
		// counted once, under the first reason: at capacity
		&viewProxy{uid: "full-and-cooling", leasable: true, active: 1, labels: map[string]string{"pool": "x"},
			cooldowns: map[string]time.Time{"": later}},
		&viewProxy{uid: "cool-target", leasable: true, labels: map[string]string{"pool": "x"},
			cooldowns: map[string]time.Time{"shop.example.com": later, "": later}},
		&viewProxy{uid: "cool-global", leasable: true, labels: map[string]string{"pool": "x"},
			cooldowns: map[string]time.Time{"": later}},
		&viewProxy{uid: "elsewhere", leasable: true, labels: map[string]string{"pool": "y"}},
	)
	got := v.unavailable(Selector{Labels: map[string]string{"pool": "x"}}, "shop.example.com", now)
	want := Unavailable{Matching: 5, Unhealthy: 1, AtCapacity: 2, CoolingTarget: 1, CoolingGlobal: 1}
	if got != want {
		t.Errorf("unavailable = %+v, want %+v", got, want)
	}
	if got.available() {
		t.Error("available() = true with every matching proxy ruled out")
	}
	// Without a target, a target cooldown is no reason.
	got = v.unavailable(Selector{Labels: map[string]string{"pool": "x"}}, "", now)
	want = Unavailable{Matching: 5, Unhealthy: 1, AtCapacity: 2, CoolingGlobal: 2}
	if got != want {
		t.Errorf("unavailable without target = %+v, want %+v", got, want)
	}
}

func TestLeaseIDsStartWithTheAcquisitionTime(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	less := func(a, b [16]byte) bool { return string(a[:]) < string(b[:]) }
	for range 100 {
		id := newLeaseID(t0)
		if id.Version() != 7 || id.Variant().String() != "RFC4122" {
			t.Fatalf("%s: version %d, variant %s; want 7, RFC4122", id, id.Version(), id.Variant())
		}
		if less(id, leaseIDBound(t0)) || !less(id, leaseIDBound(t0.Add(time.Millisecond))) {
			t.Fatalf("%s is not within [bound(t0), bound(t0+1ms))", id)
		}
		if !less(newLeaseID(t0.Add(-time.Millisecond)), id) {
			t.Fatal("an id of a millisecond earlier does not sort first")
		}
	}
}

func TestViewAdoptsAReadMadeBesideTheRounds(t *testing.T) {
	t.Parallel()
	t0 := time.Now()
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	v := testView(&viewProxy{uid: "a", leasable: true, capacity: 3}, &viewProxy{uid: "b", leasable: true, capacity: 3})
	v.readStarted = t0
	v.pick(Selector{}, "", now) // a round in flight holds one place on a
	v.setActive("b", 2, 5)      // round 5 told us b holds 2
	v.addCooldown("b", "", now.Add(time.Minute), 5)
	read := func(started time.Time, settled uint64, aActive, bActive int) *snapshot {
		snap := testView(&viewProxy{uid: "a", leasable: true, capacity: 3, active: aActive},
			&viewProxy{uid: "b", leasable: true, capacity: 3, active: bActive})
		return &snapshot{all: snap.all, order: snap.order, settled: settled, started: started}
	}
	// A read begun after round 4 settled: b's count from round 5 is newer.
	v.adopt(read(t0.Add(time.Second), 4, 1, 0))
	a, b := v.all["a"], v.all["b"]
	if a.active != 1 || a.pending != 1 {
		t.Errorf("a: active %d pending %d, want the read's 1 and the round's 1 pending", a.active, a.pending)
	}
	if b.active != 2 || !b.coolingFor("", now) {
		t.Errorf("b: active %d, cooling %v; want round 5's 2 and its cooldown kept", b.active, b.coolingFor("", now))
	}
	// A read that began before the view's last one is ignored.
	v.adopt(read(t0, 9, 0, 0))
	if v.all["a"].active != 1 {
		t.Error("an older read replaced a newer one")
	}
	// A read begun after round 5: its values win.
	v.adopt(read(t0.Add(2*time.Second), 5, 1, 3))
	if v.all["b"].active != 3 {
		t.Errorf("b: active %d, want the newer read's 3", v.all["b"].active)
	}
	// The order follows the adopted counts: a (1 active + 1 pending) has
	// room; b (3 of 3) has none.
	if p := v.pick(Selector{}, "", now); p == nil || p.uid != "a" {
		t.Errorf("pick after adopting = %v, want a", p)
	}
}

func TestViewPicksWithinThePool(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	v := testView(
		&viewProxy{uid: "a", leasable: true, pool: "p1", tiebreak: 1},
		&viewProxy{uid: "b", leasable: true, pool: "p2", tiebreak: 2},
		&viewProxy{uid: "c", leasable: true, tiebreak: 0},
	)
	if p := v.pick(Selector{Pool: "p2"}, "", now); p == nil || p.uid != "b" {
		t.Fatalf("pick(pool p2) = %v, want b", p)
	}
	if p := v.pick(Selector{Pool: "p2"}, "", now); p != nil {
		t.Fatalf("pick(pool p2) with b full = %v, want none", p)
	}
	if p := v.pick(Selector{}, "", now); p == nil || p.uid != "c" {
		t.Fatalf("pick() = %v, want c, first in selection order", p)
	}
	if p := v.pick(Selector{Pool: "none"}, "", now); p != nil {
		t.Fatalf("pick(an unknown pool) = %v, want none", p)
	}
	// b leaves pool p2 for p1 (a change read from the database): it is
	// p1's candidate, no longer p2's.
	v.settle("b", 0, 1)
	v.horizon, v.readStarted = 5, now
	v.adopt(&snapshot{changes: true, since: 5, horizon: 6, started: now.Add(time.Second),
		all: map[string]*viewProxy{"b": {uid: "b", leasable: true, pool: "p1", capacity: 1, tiebreak: 2}}})
	if _, ok := v.order.pools["p2"]; ok {
		t.Error("pool p2 still has candidates")
	}
	if p := v.pick(Selector{Pool: "p1"}, "", now); p == nil || p.uid != "a" {
		t.Fatalf("pick(pool p1) = %v, want a", p)
	}
	if p := v.pick(Selector{Pool: "p1"}, "", now); p == nil || p.uid != "b" {
		t.Fatalf("pick(pool p1) = %v, want b, which moved there", p)
	}
}

func TestViewAdoptsChangesOnly(t *testing.T) {
	t.Parallel()
	t0 := time.Now()
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	v := testView(&viewProxy{uid: "a", leasable: true}, &viewProxy{uid: "b", leasable: true}, &viewProxy{uid: "c", leasable: true})
	v.horizon, v.readStarted = 100, t0
	v.setActive("c", 1, 7) // round 7 told us c holds 1
	changes := func(started time.Time, since int64, all map[string]*viewProxy) *snapshot {
		return &snapshot{changes: true, since: since, horizon: since + 10, settled: 6, started: started, all: all}
	}
	// Changes read from a later horizon than the view's leave a gap.
	if v.adopt(changes(t0.Add(time.Second), 101, map[string]*viewProxy{"b": nil})) {
		t.Fatal("changes from a later horizon adopted")
	}
	// a is now full, b deleted, d new; c's count from round 7 is newer
	// than the read, begun when round 6 had settled.
	if !v.adopt(changes(t0.Add(time.Second), 100, map[string]*viewProxy{
		"a": {uid: "a", leasable: true, capacity: 1, active: 1},
		"b": nil,
		"c": {uid: "c", leasable: true, capacity: 1, active: 0},
		"d": {uid: "d", leasable: true, capacity: 1, tiebreak: 9},
	})) {
		t.Fatal("changes not adopted")
	}
	if _, ok := v.all["b"]; ok {
		t.Error("b, deleted, is still in the view")
	}
	if v.horizon != 110 {
		t.Errorf("horizon %d, want the read's 110", v.horizon)
	}
	if c := v.all["c"]; c.active != 1 {
		t.Errorf("c: active %d, want round 7's 1", c.active)
	}
	if p := v.pick(Selector{}, "", now); p == nil || p.uid != "d" {
		t.Fatalf("pick = %v, want d, the only one with room", p)
	}
	if p := v.pick(Selector{}, "", now); p != nil {
		t.Fatalf("pick = %v, want none", p)
	}
	// An older read is ignored.
	if v.adopt(changes(t0, 110, map[string]*viewProxy{"a": {uid: "a", leasable: true, capacity: 1}})) {
		t.Error("a read begun before the view's last one adopted")
	}
}
