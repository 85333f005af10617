// Package transitions moves verdict flips from the engine to everyone who
// needs them: the Recorder stores each one (in order, retrying until the
// database takes it), the Publisher sends stored ones as
// HealthTransitionEvents on NATS (the transitions table is its outbox), and
// the Hub follows the table for WatchProxyHealth streams.
package transitions

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/nats-io/nats.go/jetstream"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store"
)

// Recorder stores the engine's transitions.
type Recorder struct {
	Store  *store.Store
	Prober string
	// State returns a proxy's current state for the row written with the
	// transition; it may return false.
	State func(uid string) (engine.State, bool)
	// Stored is called after each transition is stored (wakes the
	// publisher and the hub).
	Stored func()
	Log    *slog.Logger

	once sync.Once
	ch   chan engine.Transition
}

func (r *Recorder) init() { r.once.Do(func() { r.ch = make(chan engine.Transition, 4096) }) }

// Add queues a transition; it blocks only when thousands are queued.
func (r *Recorder) Add(tr engine.Transition) {
	r.init()
	r.ch <- tr
}

// Run stores queued transitions until ctx ends.
func (r *Recorder) Run(ctx context.Context) error {
	r.init()
	for {
		select {
		case <-ctx.Done():
			return nil
		case tr := <-r.ch:
			r.record(ctx, tr)
		}
	}
}

func (r *Recorder) record(ctx context.Context, tr engine.Transition) {
	retryIn := &backoff.ExponentialBackOff{InitialInterval: 100 * time.Millisecond, Multiplier: 2, MaxInterval: 5 * time.Second}
	for {
		var st *engine.State
		if r.State != nil {
			if s, ok := r.State(tr.UID); ok && s.Spec.ProviderID == tr.ProviderID {
				st = &s
			}
		}
		_, err := r.Store.RecordTransition(ctx, tr, st, r.Prober)
		if err == nil {
			if r.Stored != nil {
				r.Stored()
			}
			return
		}
		if ctx.Err() != nil {
			return
		}
		wait := retryIn.NextBackOff()
		r.Log.Warn("WARNING: storing a health transition failed; retrying", "proxy_name", tr.Name, "error", err, "retry_in", wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// Publisher sends stored transitions as HealthTransitionEvents.
type Publisher struct {
	Store *store.Store
	JS    jetstream.JetStream
	Names bus.Names
	Log   *slog.Logger
	// Every is the sweep interval that also picks up what other replicas
	// left behind; 0 means 1s.
	Every time.Duration

	once sync.Once
	wake chan struct{}
}

func (p *Publisher) init() { p.once.Do(func() { p.wake = make(chan struct{}, 1) }) }

// Wake asks for a sweep now.
func (p *Publisher) Wake() {
	p.init()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// Run publishes until ctx ends.
func (p *Publisher) Run(ctx context.Context) error {
	p.init()
	every := p.Every
	if every <= 0 {
		every = time.Second
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		if err := p.Sweep(ctx); err != nil && ctx.Err() == nil {
			p.Log.Warn("WARNING: publishing health transitions failed; retrying", "error", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-p.wake:
		case <-tick.C:
		}
	}
}

// Sweep publishes every pending transition.
func (p *Publisher) Sweep(ctx context.Context) error {
	for {
		n, err := p.Store.PublishPending(ctx, 100, func(t *healthv1.HealthTransition) error {
			pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			_, err := bus.Publish(pctx, p.JS, p.Names.HealthEventSubject(t.GetProxyUid()),
				&busv1.HealthTransitionEvent{Transition: t}, jetstream.WithMsgID(fmt.Sprintf("health-transition-%d", t.GetSequence())))
			return err
		})
		if err != nil || n == 0 {
			return err
		}
	}
}

// Hub follows the transitions table and fans new rows out to watchers.
type Hub struct {
	Store *store.Store
	Log   *slog.Logger
	// Every is the poll interval (transitions of other replicas); 0 means
	// 250ms. Wake polls at once.
	Every time.Duration

	once   sync.Once
	wake   chan struct{}
	mu     sync.Mutex
	last   int64
	ready  chan struct{}
	subs   map[chan *healthv1.HealthTransition]struct{}
	closed bool
	// warned throttles the warning of a failing poll to one a minute.
	warned time.Time
}

func (h *Hub) init() {
	h.once.Do(func() {
		h.wake = make(chan struct{}, 1)
		h.ready = make(chan struct{})
		h.subs = map[chan *healthv1.HealthTransition]struct{}{}
	})
}

// Wake polls now.
func (h *Hub) Wake() {
	h.init()
	select {
	case h.wake <- struct{}{}:
	default:
	}
}

// Run polls until ctx ends, then closes every subscription.
func (h *Hub) Run(ctx context.Context) error {
	h.init()
	defer func() {
		h.mu.Lock()
		h.closed = true
		for ch := range h.subs {
			close(ch)
			delete(h.subs, ch)
		}
		h.mu.Unlock()
	}()
	for {
		last, err := h.Store.LastSequence(ctx)
		if err == nil {
			h.mu.Lock()
			h.last = last
			h.mu.Unlock()
			close(h.ready)
			break
		}
		if ctx.Err() != nil {
			return nil
		}
		h.Log.Warn("WARNING: reading the last transition failed; retrying", "error", err)
		if !sleep(ctx, time.Second) {
			return nil
		}
	}
	every := h.Every
	if every <= 0 {
		every = 250 * time.Millisecond
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-h.wake:
		case <-tick.C:
		}
		h.poll(ctx)
	}
}

func (h *Hub) poll(ctx context.Context) {
	for {
		h.mu.Lock()
		after := h.last
		h.mu.Unlock()
		ts, err := h.Store.TransitionsAfter(ctx, after, 500)
		if err != nil {
			if ctx.Err() == nil && time.Since(h.warned) > time.Minute {
				h.warned = time.Now()
				h.Log.Warn("WARNING: reading transitions failed; watches wait (logged once a minute)", "error", err)
			}
			return
		}
		h.mu.Lock()
		for _, t := range ts {
			h.last = t.GetSequence()
			for ch := range h.subs {
				select {
				case ch <- t:
				default:
					// A watcher that cannot keep up is cut off; it can
					// resume from its last sequence.
					close(ch)
					delete(h.subs, ch)
				}
			}
		}
		h.mu.Unlock()
		if len(ts) < 500 {
			return
		}
	}
}

// Subscribe returns a channel of transitions after the hub's current
// position, and that position. The channel is closed when the watcher
// falls too far behind or the hub stops; cancel ends the subscription.
func (h *Hub) Subscribe(ctx context.Context) (ch <-chan *healthv1.HealthTransition, from int64, cancel func(), err error) {
	h.init()
	select {
	case <-h.ready:
	case <-ctx.Done():
		return nil, 0, nil, ctx.Err()
	}
	c := make(chan *healthv1.HealthTransition, 1024)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, 0, nil, fmt.Errorf("shutting down")
	}
	h.subs[c] = struct{}{}
	return c, h.last, func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		if _, ok := h.subs[c]; ok {
			delete(h.subs, c)
			close(c)
		}
	}, nil
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
