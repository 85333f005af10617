package postgres

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// LockKey is the advisory lock key of one of a service's locks: the
// 64-bit FNV-1a hash of "egress/<schema>/<name>", its top bit cleared so
// that it reads the same as a signed bigint everywhere. Every advisory
// lock of the suite (singletons, transaction locks, migrations) takes its
// key from here, so keys never collide across services and every lock is
// found by its name. Advisory locks are per database, which is what keeps
// two installations, or two tests, apart.
func LockKey(schema, name string) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("egress/" + schema + "/" + name))
	return int64(h.Sum64() >> 1)
}

// Singleton runs work on one replica at a time across every process that
// shares a database: the holder of a session advisory lock. The lock is
// held on a dedicated connection (not one of the pool's, so the pool's
// health checks and limits never touch it), which is pinged every Watch;
// when the ping fails — the connection broke, or its backend was
// terminated, which releases the lock on the server — the holder's context
// is cancelled with the cause, and Run tries to take the lock again.
//
// There is a window of at most Watch (plus the ping's timeout, at least
// 5s) in which a
// holder that lost its connection still runs while another replica has
// already taken the lock: work run this way must stay safe when, rarely,
// two runs overlap (orchestrator GC and the event outbox are idempotent;
// a provider check is only a read).
type Singleton struct {
	// Pool supplies the connection settings; the lock's connection is
	// opened from them.
	Pool *pgxpool.Pool
	// Key is the advisory lock key (LockKey).
	Key int64
	// Name says what the singleton does, in logs.
	Name string
	Log  *slog.Logger
	// Retry is how often a replica without the lock tries to take it;
	// 0 means 5s.
	Retry time.Duration
	// Watch is how often the holder pings its lock connection; 0 means 5s.
	Watch time.Duration
}

// pingTimeout is the least time a watch ping may take before the holder
// gives up its lead, so a busy database or machine does not end it.
const pingTimeout = 5 * time.Second

// ErrLeadershipLost is the cause of the holder's context ending when its
// lock connection failed.
var ErrLeadershipLost = errors.New("the advisory lock's connection failed; leadership lost")

func (s *Singleton) retry() time.Duration {
	if s.Retry > 0 {
		return s.Retry
	}
	return 5 * time.Second
}

func (s *Singleton) watch() time.Duration {
	if s.Watch > 0 {
		return s.Watch
	}
	return 5 * time.Second
}

func (s *Singleton) log() *slog.Logger {
	if s.Log != nil {
		return s.Log
	}
	return slog.Default()
}

// Run calls lead whenever this replica holds the lock, until ctx ends. A
// replica without it tries again every Retry. lead's context ends when ctx
// does or when the lock is lost (context.Cause is then ErrLeadershipLost);
// when lead returns, by itself or with an error, the lock is released and
// taken again later (lead's error is logged).
func (s *Singleton) Run(ctx context.Context, lead func(context.Context) error) error {
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			_ = conn.Close(context.Background())
		}
	}()
	for ctx.Err() == nil {
		if conn == nil || conn.IsClosed() {
			c, err := pgx.ConnectConfig(ctx, s.Pool.Config().ConnConfig.Copy())
			if err != nil {
				if ctx.Err() == nil {
					s.log().Warn("WARNING: "+s.Name+": cannot connect to take the lock; retrying", "error", err, "retry_in", s.retry())
				}
				conn = nil
				sleep(ctx, s.retry())
				continue
			}
			conn = c
		}
		held, err := s.holdAndLead(ctx, conn, lead)
		if err != nil && ctx.Err() == nil {
			s.log().Warn("WARNING: "+s.Name+": "+err.Error(), "retry_in", s.retry())
			// The session may still hold the lock (lead failed, unlock
			// failed): closing it releases the lock for certain.
			_ = conn.Close(context.Background())
			conn = nil
		}
		if held && err == nil && ctx.Err() == nil {
			s.log().Info(s.Name + ": released the lock")
		}
		sleep(ctx, s.retry())
	}
	return nil
}

// holdAndLead tries the lock once; holding it, it runs lead under a
// watched context and releases it afterwards.
func (s *Singleton) holdAndLead(ctx context.Context, conn *pgx.Conn, lead func(context.Context) error) (held bool, err error) {
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", s.Key).Scan(&held); err != nil {
		return false, fmt.Errorf("taking the lock: %w", err)
	}
	if !held {
		return false, nil
	}
	s.log().Info(s.Name + ": this replica holds the lock")
	lctx, cancel := context.WithCancelCause(ctx)
	watchDone := make(chan struct{})
	go func() {
		defer close(watchDone)
		t := time.NewTicker(s.watch())
		defer t.Stop()
		for {
			select {
			case <-lctx.Done():
				return
			case <-t.C:
			}
			// A slow answer is not a lost lock: only a ping that fails or
			// hangs for pingTimeout ends the lead.
			pctx, pcancel := context.WithTimeout(lctx, max(s.watch(), pingTimeout))
			perr := conn.Ping(pctx)
			pcancel()
			if perr != nil && lctx.Err() == nil {
				cancel(fmt.Errorf("%w: %v", ErrLeadershipLost, perr))
				return
			}
		}
	}()
	leadErr := lead(lctx)
	lost := context.Cause(lctx)
	cancel(nil)
	<-watchDone
	if errors.Is(lost, ErrLeadershipLost) {
		return true, lost
	}
	if leadErr != nil {
		return true, fmt.Errorf("leading failed: %w", leadErr)
	}
	if ctx.Err() != nil {
		return true, nil // closing the connection releases the lock
	}
	uctx, ucancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer ucancel()
	if _, err := conn.Exec(uctx, "SELECT pg_advisory_unlock($1)", s.Key); err != nil {
		return true, fmt.Errorf("releasing the lock: %w", err)
	}
	return true, nil
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
