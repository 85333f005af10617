package engine

import (
	"fmt"
	"testing"
	"time"
)

// BenchmarkSchedule measures the engine's own cost per probe — the heap,
// the verdict, the bookkeeping — without any network: 1,000 proxies at
// 1 Hz driven by a fake clock in 1ms steps, every probe completing at once.
func BenchmarkSchedule(b *testing.B) {
	clock := &fakeClock{now: t0}
	e := New(Config{Now: clock.Now})
	for i := range 1000 {
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
}
