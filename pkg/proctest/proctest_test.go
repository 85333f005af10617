package proctest

import (
	"debug/elf"
	"os"
	"os/exec"
	"strings"
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

// A shipped build is a static binary without symbols, built once per set
// of tags, apart from the plain build of the same package.
func TestBuildShipped(t *testing.T) {
	t.Parallel()
	shipped := BuildShipped(t, "testdata/hello")
	if again := BuildShipped(t, "testdata/hello"); again != shipped {
		t.Errorf("second BuildShipped built again: %s, then %s", shipped, again)
	}
	if plain := Build(t, "testdata/hello"); plain == shipped {
		t.Errorf("Build and BuildShipped gave the same binary %s", plain)
	}
	f, err := elf.Open(shipped)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if p := f.Section(".interp"); p != nil {
		t.Error("the shipped binary has a dynamic loader (.interp): cgo was on")
	}
	if s := f.Section(".symtab"); s != nil {
		t.Error("the shipped binary has a symbol table: -s was not given")
	}
	out, err := exec.Command(shipped).Output()
	if err != nil || strings.TrimSpace(string(out)) != "hello" {
		t.Errorf("running the shipped binary: %q, %v", out, err)
	}
}
