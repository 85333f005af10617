package waittest

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func TestUntilReturnsOnceTheConditionHolds(t *testing.T) {
	var calls atomic.Int32
	err := Until(5*time.Second, func() error {
		if calls.Add(1) < 3 {
			return errors.New("not yet")
		}
		return nil
	})
	if err != nil || calls.Load() != 3 {
		t.Fatalf("Until = %v after %d calls; want nil after 3", err, calls.Load())
	}
}

func TestUntilGivesTheLastErrorAtTheDeadline(t *testing.T) {
	want := errors.New("still down")
	start := time.Now()
	err := Until(50*time.Millisecond, func() error { return want })
	if err != want {
		t.Fatalf("Until = %v; want %v", err, want)
	}
	if el := time.Since(start); el < 50*time.Millisecond {
		t.Fatalf("Until gave up after %s, before its 50ms deadline", el)
	}
}

type recorder struct {
	testing.TB
	failed string
}

func (r *recorder) Helper() {}
func (r *recorder) Fatalf(format string, args ...any) {
	r.failed = fmt.Sprintf(format, args...)
	panic(r)
}

func TestForFailsNamingWhatItAwaited(t *testing.T) {
	r := &recorder{TB: t}
	func() {
		defer func() {
			if p := recover(); p != nil && p != r {
				panic(p)
			}
		}()
		For(r, 20*time.Millisecond, "the proxy to turn Ready", func() bool { return false })
	}()
	if !strings.Contains(r.failed, "the proxy to turn Ready") {
		t.Fatalf("For failed with %q; want the message to name what it awaited", r.failed)
	}
}
