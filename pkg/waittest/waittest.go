// Package waittest waits in tests for a condition to hold, with a deadline,
// instead of sleeping: the one way the suite's tests synchronise with
// something that happens in another goroutine or process.
package waittest

import (
	"testing"
	"time"
)

// For polls cond until it returns true, failing t after timeout with what
// was awaited. The poll starts at 5ms and backs off to 100ms, so a fast
// condition is seen at once and a slow one costs little CPU.
func For(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	ForErr(t, timeout, what, func() error {
		if cond() {
			return nil
		}
		return errNotYet
	})
}

// ForErr polls cond until it returns nil, failing t after timeout with
// what was awaited and the last error cond returned.
func ForErr(t testing.TB, timeout time.Duration, what string, cond func() error) {
	t.Helper()
	if err := Until(timeout, cond); err != nil {
		if err == errNotYet {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		t.Fatalf("timed out after %s waiting for %s: %v", timeout, what, err)
	}
}

// Until polls cond until it returns nil or timeout passes, and returns
// cond's last error (nil when it held). For harnesses that report a
// failure their own way.
func Until(timeout time.Duration, cond func() error) error {
	deadline := time.Now().Add(timeout)
	wait := 5 * time.Millisecond
	for {
		err := cond()
		if err == nil || !time.Now().Before(deadline) {
			return err
		}
		time.Sleep(min(wait, time.Until(deadline)))
		wait = min(2*wait, 100*time.Millisecond)
	}
}

type notYet struct{}

func (notYet) Error() string { return "condition not met" }

var errNotYet error = notYet{}
