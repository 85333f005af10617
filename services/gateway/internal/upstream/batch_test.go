package upstream

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"
)

// calls is a function for the batcher whose calls block until released,
// each answering a lease named after its number and recording when it
// began.
type calls struct {
	mu      sync.Mutex
	started []time.Time
	release chan error
}

func newCalls() *calls { return &calls{release: make(chan error)} }

func (c *calls) fn() (*Lease, error) {
	c.mu.Lock()
	c.started = append(c.started, time.Now())
	n := len(c.started)
	c.mu.Unlock()
	if err := <-c.release; err != nil {
		return nil, err
	}
	return &Lease{ID: fmt.Sprint(n)}, nil
}

func (c *calls) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.started)
}

func (c *calls) startOf(id string) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	var n int
	_, _ = fmt.Sscan(id, &n)
	return c.started[n-1]
}

// waitFor polls cond (the batcher's state moves in other goroutines).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond) // polling the batcher's state
	}
}

func (b *batcher) waiting(key string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if kc := b.keys[key]; kc != nil && kc.next != nil {
		return kc.next.n
	}
	return 0
}

// Requests that arrive while their key's call is in flight wait for the
// next call, which begins after all of them arrived, and share it: one
// call for ten requests, one of them not Joined (it counts a move).
func TestBatcherSharesTheNextCallNeverAnEarlierOne(t *testing.T) {
	t.Parallel()
	var b batcher
	c := newCalls()
	type answer struct {
		arrived time.Time
		lease   *Lease
		err     error
	}
	first := make(chan answer, 1)
	go func() {
		at := time.Now()
		l, err := b.do(context.Background(), "s", c.fn)
		first <- answer{at, l, err}
	}()
	waitFor(t, "the first call", func() bool { return c.count() == 1 })

	const n = 10
	answers := make(chan answer, n)
	for range n {
		go func() {
			at := time.Now()
			l, err := b.do(context.Background(), "s", c.fn)
			answers <- answer{at, l, err}
		}()
	}
	waitFor(t, "ten waiting requests", func() bool { return b.waiting("s") == n })
	if got := c.count(); got != 1 {
		t.Fatalf("%d calls while the first is in flight, want 1", got)
	}
	c.release <- nil
	a := <-first
	if a.err != nil || a.lease.ID != "1" || a.lease.Joined {
		t.Fatalf("first request: %+v %v", a.lease, a.err)
	}
	waitFor(t, "the batch's call", func() bool { return c.count() == 2 })
	c.release <- nil
	opened := 0
	for range n {
		a := <-answers
		if a.err != nil {
			t.Fatal(a.err)
		}
		if a.lease.ID != "2" {
			t.Errorf("a waiting request got lease %s, want the batch's call (2)", a.lease.ID)
		}
		if start := c.startOf(a.lease.ID); start.Before(a.arrived) {
			t.Errorf("answered by a call that began %v before the request arrived", a.arrived.Sub(start))
		}
		if !a.lease.Joined {
			opened++
		}
	}
	if opened != 1 {
		t.Errorf("%d requests of the batch not Joined, want 1", opened)
	}
	// Idle again: the next request calls at once.
	go func() { c.release <- nil }()
	if l, err := b.do(context.Background(), "s", c.fn); err != nil || l.ID != "3" || l.Joined {
		t.Fatalf("after the batch: %+v %v", l, err)
	}
	b.mu.Lock()
	left := len(b.keys)
	b.mu.Unlock()
	if left != 0 {
		t.Errorf("%d keys kept after every call ended", left)
	}
}

// Different keys never wait for each other; a batch's error reaches each
// of its requests; a request whose context ends stops waiting.
func TestBatcherKeysErrorsAndCancel(t *testing.T) {
	t.Parallel()
	var b batcher
	ca, cb := newCalls(), newCalls()
	doneA := make(chan error, 1)
	go func() { _, err := b.do(context.Background(), "a", ca.fn); doneA <- err }()
	waitFor(t, "key a's call", func() bool { return ca.count() == 1 })
	doneB := make(chan error, 1)
	go func() { _, err := b.do(context.Background(), "b", cb.fn); doneB <- err }()
	waitFor(t, "key b's call while a's is in flight", func() bool { return cb.count() == 1 })

	errs := make(chan error, 2)
	for range 2 {
		go func() { _, err := b.do(context.Background(), "a", ca.fn); errs <- err }()
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancelled := make(chan error, 1)
	go func() { _, err := b.do(ctx, "a", ca.fn); cancelled <- err }()
	waitFor(t, "three waiting on a", func() bool { return b.waiting("a") == 3 })
	cancel()
	if err := <-cancelled; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled request: %v", err)
	}
	ca.release <- nil
	if err := <-doneA; err != nil {
		t.Fatal(err)
	}
	boom := errors.New("no proxy")
	waitFor(t, "a's batch call", func() bool { return ca.count() == 2 })
	ca.release <- boom
	for range 2 {
		if err := <-errs; !errors.Is(err, boom) {
			t.Fatalf("batch error: %v", err)
		}
	}
	cb.release <- nil
	if err := <-doneB; err != nil {
		t.Fatal(err)
	}
}
