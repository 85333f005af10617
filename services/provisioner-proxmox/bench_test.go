package main

import (
	"fmt"
	"testing"
	"time"
)

// BenchmarkFiftyCreatesThreeReplicas publishes 50 Create commands to three
// provisioner processes sharing the consumer and waits for the 50 results:
// one op is one batch of 50. The processes start outside the timer.
func BenchmarkFiftyCreatesThreeReplicas(b *testing.B) {
	c := newCluster(b)
	for _, r := range []string{"a", "b", "c"} {
		c.start(b, r)
	}
	var total time.Duration
	b.ResetTimer()
	for i := range b.N {
		start := time.Now()
		for j := range 50 {
			c.publishCreate(b, fmt.Sprintf("bench-%d-%d", i, j), fmt.Sprintf("be0c0000-%04d-4000-8000-%012d", i, j))
		}
		res := c.results(b, 50, 5*time.Minute)
		total += time.Since(start)
		for _, r := range res {
			if r.GetError() != nil {
				b.Fatalf("%s: %v", r.GetCommandId(), r.GetError())
			}
		}
	}
	b.StopTimer()
	if n := len(c.fake.VMs()); n != 50*b.N {
		b.Fatalf("%d VMs, want %d", n, 50*b.N)
	}
	b.ReportMetric(float64(50*b.N)/total.Seconds(), "creates/s")
	b.ReportMetric(float64(c.fake.TotalCalls())/float64(50*b.N), "calls/create")
}
