package proxytest

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// failingTB records a harness's failure instead of failing the test, so a
// test can check how the harness fails. Fatal ends the calling goroutine,
// as testing.T's does; cleanups run when the caller asks.
type failingTB struct {
	testing.TB // only for the interface's unexported method; never called

	mu       sync.Mutex
	failure  string
	cleanups []func()
}

func (f *failingTB) Helper()      {}
func (f *failingTB) Name() string { return "failingTB" }
func (f *failingTB) Logf(string, ...any) {
}

func (f *failingTB) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.failure = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

func (f *failingTB) Fatal(args ...any) { f.Fatalf("%s", fmt.Sprint(args...)) }

func (f *failingTB) Cleanup(fn func()) {
	f.mu.Lock()
	f.cleanups = append(f.cleanups, fn)
	f.mu.Unlock()
}

// runCleanups runs the cleanups last first, as testing does.
func (f *failingTB) runCleanups() {
	f.mu.Lock()
	fns := f.cleanups
	f.cleanups = nil
	f.mu.Unlock()
	for i := len(fns) - 1; i >= 0; i-- {
		fns[i]()
	}
}

// within runs fn on its own goroutine and fails t if it has not returned
// after d: the harness under test must fail fast, not hang.
func within(t *testing.T, d time.Duration, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s still running after %s", what, d)
	}
}

// A squid that exits before it listens (here: a configuration line it
// cannot parse) fails StartSquid at once with squid's own log, and the
// cleanup reaps it instead of waiting on an exit already taken.
func TestStartSquid_exitBeforeListeningFailsWithItsLog(t *testing.T) {
	SquidBinary(t)
	ftb := &failingTB{}
	var got *Squid
	within(t, 20*time.Second, "StartSquid with a squid that exits at once", func() {
		got = StartSquid(ftb, SquidOptions{Extra: "http_port 127.0.0.1:notaport"})
	})
	within(t, 20*time.Second, "StartSquid's cleanup", ftb.runCleanups)
	if got != nil {
		t.Fatalf("StartSquid returned %v for a squid that cannot start", got.Addr())
	}
	if !strings.Contains(ftb.failure, "squid exited") || !strings.Contains(ftb.failure, "Bungled") {
		t.Fatalf("failure = %q, want squid's exit with its log (the Bungled line)", ftb.failure)
	}
}

func TestStartSquid_servesAndStops(t *testing.T) {
	sq := StartSquid(t, SquidOptions{})
	if sq.Addr() == "" {
		t.Fatal("no address")
	}
}
