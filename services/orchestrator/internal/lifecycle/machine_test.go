package lifecycle

import (
	"testing"
	"time"
)

// The retry schedule: base·2^(attempt-1) capped at max, with ±20% jitter.
func TestBackoffSchedule(t *testing.T) {
	t.Parallel()
	cases := []struct {
		attempt   int32
		base, max time.Duration
		want      time.Duration
	}{
		{1, time.Second, 5 * time.Minute, time.Second},
		{2, time.Second, 5 * time.Minute, 2 * time.Second},
		{5, time.Second, 5 * time.Minute, 16 * time.Second},
		{9, time.Second, 5 * time.Minute, 256 * time.Second},
		{10, time.Second, 5 * time.Minute, 5 * time.Minute},
		{100000, time.Second, 5 * time.Minute, 5 * time.Minute},
		{3, 30 * time.Second, 30 * time.Minute, 2 * time.Minute},
		{7, 30 * time.Second, 30 * time.Minute, 30 * time.Minute},
	}
	for _, tc := range cases {
		if got := machine().backoff(tc.attempt, tc.base, tc.max); got != tc.want {
			t.Errorf("backoff(%d, %s, %s) = %s, want %s", tc.attempt, tc.base, tc.max, got, tc.want)
		}
		jittered := &Machine{}
		for range 200 {
			got := jittered.backoff(tc.attempt, tc.base, tc.max)
			lo, hi := time.Duration(float64(tc.want)*0.8), time.Duration(float64(tc.want)*1.2)
			if got < lo || got > hi+time.Nanosecond {
				t.Fatalf("jittered backoff(%d) = %s, want within [%s, %s]", tc.attempt, got, lo, hi)
			}
		}
	}
}
