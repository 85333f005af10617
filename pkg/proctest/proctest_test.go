package proctest

import (
	"os"
	"testing"
	"time"
)

// The sizes and CPU read from /proc are this process's own, in bytes and
// growing with the work done.
func TestStatusBytesAndCPUTime(t *testing.T) {
	t.Parallel()
	pid := os.Getpid()
	rss, anon := StatusBytes(t, pid, "VmRSS"), StatusBytes(t, pid, "RssAnon")
	if rss < 1<<20 || anon <= 0 || anon > rss {
		t.Errorf("VmRSS %d B, RssAnon %d B: want a resident set of at least 1 MiB holding the anonymous part", rss, anon)
	}
	before := CPUTime(t, pid)
	deadline := time.Now().Add(10 * time.Second)
	for CPUTime(t, pid) == before {
		if time.Now().After(deadline) {
			t.Fatalf("CPU time stayed %s over 10 s of spinning", before)
		}
		for i := 0; i < 1_000_000; i++ {
			_ = i * i
		}
	}
}
