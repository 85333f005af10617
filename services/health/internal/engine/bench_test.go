package engine

import (
	"fmt"
	"testing"
	"time"
)

// BenchmarkSchedule measures the engine's own cost per probe — the heap,
// the verdict, the bookkeeping — without any network: 1,000 and 100,000
// proxies at 1 Hz driven by a fake clock in 1ms steps, every probe
// completing at once.
//
//	go test -run '^$' -bench Schedule -benchtime 5x ./internal/engine/
func BenchmarkSchedule(b *testing.B) {
	for _, n := range []int{1000, 100_000} {
		b.Run(fmt.Sprintf("proxies=%d", n), func(b *testing.B) {
			clock := &fakeClock{now: t0}
			e := New(Config{Now: clock.Now})
			for i := range n {
				e.Upsert(spec(fmt.Sprint(i)))
			}
			probes := 0
			b.ResetTimer()
			for b.Loop() {
				for range 1000 { // one second
					now := clock.Add(time.Millisecond)
					for _, j := range e.Due(now) {
						e.Complete(j, pass)
						probes++
					}
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(probes), "ns/probe")
			b.ReportMetric(float64(probes)/float64(b.N), "probes/op")
		})
	}
}

// BenchmarkCadence measures what the adaptive cadence does at 100,000
// proxies, on the engine's real scheduling and a fake clock (no network):
// 35 simulated seconds in which 1% of the proxies fail from +12s to +22s.
// Side by side: the fixed cadence at 1s (the baseline); the adaptive one
// at the same 1s bound with a 250ms fast interval; and the adaptive one
// with its bound raised to 2.5s, where its slowest detection of a failure
// matches the fixed cadence's (1s + 2 fast probes vs 3 probes 1s apart).
// Per variant: probes per second with nothing failing, the probes of the
// whole run relative to the baseline's, and the slowest time from a
// failure (or a recovery) to its transition.
//
//	go test -run '^$' -bench Cadence -benchtime 1x ./internal/engine/
func BenchmarkCadence(b *testing.B) {
	const proxies, failing = 100_000, 1_000
	variants := []struct {
		name           string
		interval, fast time.Duration
	}{
		{"fixed-1s", time.Second, 0},
		{"adaptive-1s", time.Second, 250 * time.Millisecond},
		{"adaptive-2.5s", 2500 * time.Millisecond, 250 * time.Millisecond},
	}
	var baseline float64
	for b.Loop() {
		for i, v := range variants {
			steady, total, detect, recover := simulateCadence(proxies, failing, v.interval, v.fast)
			if i == 0 {
				baseline = float64(total)
			}
			b.ReportMetric(steady, v.name+"-probes/s")
			b.ReportMetric(float64(total)/baseline, v.name+"-probes/baseline")
			b.ReportMetric(detect.Seconds(), v.name+"-detect-s")
			b.ReportMetric(recover.Seconds(), v.name+"-recover-s")
		}
	}
}

func simulateCadence(proxies, failing int, interval, fast time.Duration) (steady float64, total int, detect, recover time.Duration) {
	clock := &fakeClock{now: t0}
	down := map[string]time.Time{} // failing proxy -> when its failure was flipped to
	up := map[string]time.Time{}   // failing proxy -> when its recovery was flipped to
	failStart, failEnd := t0.Add(12*time.Second), t0.Add(22*time.Second)
	e := New(Config{Now: clock.Now, FastInterval: fast, OnTransition: func(tr Transition) {
		if !tr.Time.Before(failEnd) {
			up[tr.UID] = tr.Time
		} else if !tr.Time.Before(failStart) {
			down[tr.UID] = tr.Time
		}
	}})
	for i := range proxies {
		s := spec(fmt.Sprint(i))
		s.Interval, s.Timeout = interval, time.Second
		e.Upsert(s)
	}
	failingSet := make(map[string]bool, failing)
	for i := range failing {
		failingSet[fmt.Sprint(i)] = true
	}
	isFailing := func(uid string) bool { return failingSet[uid] }
	steadyFrom, steadyTo := t0.Add(4*time.Second), t0.Add(12*time.Second)
	steadyProbes := 0
	for now := clock.Now(); now.Before(t0.Add(35 * time.Second)); now = clock.Add(5 * time.Millisecond) {
		broken := !now.Before(failStart) && now.Before(failEnd)
		for _, j := range e.Due(now) {
			total++
			if !now.Before(steadyFrom) && now.Before(steadyTo) {
				steadyProbes++
			}
			r := pass
			if broken && isFailing(j.Spec.UID) {
				r = fail
			}
			e.Complete(j, r)
		}
	}
	for uid, at := range down {
		if isFailing(uid) {
			detect = max(detect, at.Sub(failStart))
		}
	}
	for _, at := range up {
		recover = max(recover, at.Sub(failEnd))
	}
	if len(down) < failing {
		detect = -1 // not all detected
	}
	return float64(steadyProbes) / steadyTo.Sub(steadyFrom).Seconds(), total, detect, recover
}
