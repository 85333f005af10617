package upstream

import (
	"context"
	"sync"
)

// batcher makes one call for requests with the same key that wait
// together, and never answers a request with a call that began before the
// request arrived: while a key's call runs, the requests that arrive wait
// and then share the next call, which begins after all of them arrived.
// So every answer is as fresh as a call of the request's own would have
// been, and a key costs at most one call in flight and one batch waiting,
// however many requests arrive at once.
type batcher struct {
	mu   sync.Mutex
	keys map[string]*keyCalls
}

// keyCalls is a key's call in flight and the batch that waits for the
// next one.
type keyCalls struct {
	next *batch
}

// batch is the requests that share one call.
type batch struct {
	done  chan struct{}
	call  func() (*Lease, error)
	n     int // the requests in it
	lease *Lease
	err   error
}

// do returns the lease of a call of fn (or of the fn of another request
// with the same key that waited with this one) begun after do was called.
// A lease answered to more than one request is a copy for each, marked
// Joined for all but the request that opened the batch. A request whose
// ctx ends stops waiting; the call still answers the others.
func (b *batcher) do(ctx context.Context, key string, fn func() (*Lease, error)) (*Lease, error) {
	b.mu.Lock()
	if b.keys == nil {
		b.keys = map[string]*keyCalls{}
	}
	kc, running := b.keys[key]
	if !running {
		// Nothing in flight: call now.
		b.keys[key] = &keyCalls{}
		b.mu.Unlock()
		lease, err := fn()
		b.next(key)
		return lease, err
	}
	bt := kc.next
	opened := bt == nil
	if opened {
		bt = &batch{done: make(chan struct{}), call: fn}
		kc.next = bt
	}
	bt.n++
	b.mu.Unlock()
	select {
	case <-bt.done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if bt.err != nil {
		return nil, bt.err
	}
	cp := *bt.lease
	cp.Joined = !opened
	return &cp, nil
}

// next starts the call of key's waiting batch, if any, once the call
// before it ended; with none waiting, the key is idle.
func (b *batcher) next(key string) {
	b.mu.Lock()
	kc := b.keys[key]
	bt := kc.next
	if bt == nil {
		delete(b.keys, key)
		b.mu.Unlock()
		return
	}
	kc.next = nil
	b.mu.Unlock()
	go func() {
		bt.lease, bt.err = bt.call()
		close(bt.done)
		b.next(key)
	}()
}
