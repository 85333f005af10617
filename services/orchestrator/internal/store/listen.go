package store

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Signal is a broadcast wake-up: Wait returns a channel closed at the next
// Notify after the call.
type Signal struct {
	mu sync.Mutex
	ch chan struct{}
}

// NewSignal returns a ready Signal.
func NewSignal() *Signal { return &Signal{ch: make(chan struct{})} }

// Wait returns a channel closed by the next Notify.
func (s *Signal) Wait() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ch
}

// Notify wakes every waiter.
func (s *Signal) Notify() {
	s.mu.Lock()
	defer s.mu.Unlock()
	close(s.ch)
	s.ch = make(chan struct{})
}

// Listen holds one connection LISTENing on the work and changes channels
// and turns notifications into the signals, until ctx ends. A lost
// connection is re-established; both signals fire after a reconnect, since
// notifications may have been missed meanwhile.
func Listen(ctx context.Context, pool *pgxpool.Pool, work, changes *Signal, log *slog.Logger) error {
	for ctx.Err() == nil {
		err := listenOnce(ctx, pool, work, changes)
		if ctx.Err() != nil {
			return nil
		}
		log.Warn("database notifications lost; reconnecting", "error", err)
		work.Notify()
		changes.Notify()
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
	return nil
}

func listenOnce(ctx context.Context, pool *pgxpool.Pool, work, changes *Signal) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	for _, ch := range []string{WorkChannel, ChangesChannel} {
		if _, err := conn.Exec(ctx, "LISTEN "+ch); err != nil {
			return err
		}
	}
	defer func() {
		// Return the connection to the pool clean.
		c, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, _ = conn.Exec(c, "UNLISTEN *")
	}()
	for {
		n, err := conn.Conn().WaitForNotification(ctx)
		if err != nil {
			return err
		}
		switch n.Channel {
		case WorkChannel:
			work.Notify()
		case ChangesChannel:
			changes.Notify()
		}
	}
}
