package store

import "testing"

func TestUnavailableReason(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		u    Unavailable
		want string
	}{
		{Unavailable{}, "no_matching_proxy"},
		{Unavailable{Matching: 3, Unhealthy: 3}, "unhealthy"},
		{Unavailable{Matching: 3, Unhealthy: 1, AtCapacity: 2}, "at_capacity"},
		{Unavailable{Matching: 2, Unhealthy: 1, AtCapacity: 1}, "unhealthy"},
		{Unavailable{Matching: 4, AtCapacity: 1, CoolingTarget: 3}, "cooling_down_target"},
		{Unavailable{Matching: 4, CoolingTarget: 2, CoolingGlobal: 2}, "cooling_down_target"},
		{Unavailable{Matching: 5, AtCapacity: 1, CoolingGlobal: 4}, "cooling_down_global"},
	} {
		if got := tc.u.Reason(); got != tc.want {
			t.Errorf("%+v.Reason() = %q, want %q", tc.u, got, tc.want)
		}
	}
}

func TestTiebreakIsStable(t *testing.T) {
	t.Parallel()
	a, b := "00000000-0000-4000-8000-00000000000a", "00000000-0000-4000-8000-00000000000b"
	if Tiebreak(a) != Tiebreak(a) || Tiebreak(a) == Tiebreak(b) {
		t.Errorf("Tiebreak(a)=%d twice, Tiebreak(b)=%d", Tiebreak(a), Tiebreak(b))
	}
	// Pinned: the same on every replica and every release.
	if got := Tiebreak("p"); got != int64(fnv64("p")) {
		t.Errorf("Tiebreak(p) = %d", got)
	}
}
