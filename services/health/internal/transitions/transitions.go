// Package transitions moves verdict flips from the engine to everyone who
// needs them: the Recorder stores each one (in order, retrying until the
// database takes it), the Publisher sends stored ones as
// HealthTransitionEvents on NATS (the transitions table is its outbox), and
// the Hub follows the table for WatchProxyHealth streams.
package transitions

import (
	"context"
	"errors"
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
	// Stored is called after each batch of transitions is stored (wakes
	// the publisher and the hub).
	Stored func()
	Log    *slog.Logger

	once sync.Once
	ch   chan engine.Transition
}

// recordBatch is the most transitions the Recorder stores in one
// transaction: what is queued when it takes the next, up to this.
const recordBatch = 256

func (r *Recorder) init() { r.once.Do(func() { r.ch = make(chan engine.Transition, 4096) }) }

// Add queues a transition; it blocks only when thousands are queued.
func (r *Recorder) Add(tr engine.Transition) {
	r.init()
	r.ch <- tr
}

// Run stores queued transitions until ctx ends: each time, all that are
// queued (up to recordBatch) in one transaction.
func (r *Recorder) Run(ctx context.Context) error {
	r.init()
	batch := make([]engine.Transition, 0, recordBatch)
	for {
		select {
		case <-ctx.Done():
			return nil
		case tr := <-r.ch:
			batch = append(batch[:0], tr)
		drain:
			for len(batch) < recordBatch {
				select {
				case tr := <-r.ch:
					batch = append(batch, tr)
				default:
					break drain
				}
			}
			if r.record(ctx, batch) && r.Stored != nil {
				r.Stored()
			}
		}
	}
}

// record stores trs in one transaction, retrying until the database takes
// them or ctx ends, and reports whether it wrote anything. When PostgreSQL
// refuses what one of them holds (store.ErrRejected) they are stored one a
// transaction instead, so that one cannot hold the others back; a single
// refused transition is dropped, loudly: retrying it could never succeed
// and would stop every later one.
func (r *Recorder) record(ctx context.Context, trs []engine.Transition) bool {
	retryIn := &backoff.ExponentialBackOff{InitialInterval: 100 * time.Millisecond, Multiplier: 2, MaxInterval: 5 * time.Second}
	for {
		// The states are read at each attempt: a retry writes the
		// current ones.
		recs := make([]store.Record, len(trs))
		for i, tr := range trs {
			recs[i].Transition = tr
			if r.State != nil {
				if s, ok := r.State(tr.UID); ok && s.Spec.ProviderID == tr.ProviderID {
					recs[i].State = &s
				}
			}
		}
		_, err := r.Store.RecordTransitions(ctx, recs, r.Prober)
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		if errors.Is(err, store.ErrRejected) {
			if len(trs) == 1 {
				r.Log.Warn("WARNING: the database refuses a health transition; it is dropped", "proxy_name", trs[0].Name,
					"proxy_uid", trs[0].UID, "error", err)
				return false
			}
			r.Log.Warn("WARNING: the database refuses a batch of health transitions; storing them one at a time",
				"transitions", len(trs), "error", err)
			stored := false
			for i := range trs {
				if r.record(ctx, trs[i:i+1]) {
					stored = true
				}
			}
			return stored
		}
		wait := retryIn.NextBackOff()
		r.Log.Warn("WARNING: storing health transitions failed; retrying", "transitions", len(trs), "proxy_name", trs[0].Name,
			"error", err, "retry_in", wait)
		if !sleep(ctx, wait) {
			return false
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

// publishPage is the most transitions a sweep publishes at once.
const publishPage = 500

// Sweep publishes every pending transition, a page at a time: the page's
// events are all sent before their acknowledgements are awaited together,
// and the page is marked published only when every one was acknowledged.
// A page holds at most one transition of each proxy (PublishPending), so
// each proxy's events still reach the stream in order. It ends without
// another look when the page was not full and held no proxy with a later
// transition pending.
func (p *Publisher) Sweep(ctx context.Context) error {
	for {
		_, more, err := p.Store.PublishPending(ctx, publishPage, func(page []*healthv1.HealthTransition) error {
			pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			futures := make([]jetstream.PubAckFuture, 0, len(page))
			for _, t := range page {
				m, err := bus.Message(pctx, p.Names.HealthEventSubject(t.GetProxyUid()), &busv1.HealthTransitionEvent{Transition: t})
				if err != nil {
					return err
				}
				f, err := p.JS.PublishMsgAsync(m, jetstream.WithMsgID(fmt.Sprintf("health-transition-%d", t.GetSequence())))
				if err != nil {
					return err
				}
				futures = append(futures, f)
			}
			return bus.WaitAcks(pctx, futures)
		})
		if err != nil || !more {
			// What is stored meanwhile wakes the next sweep.
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
