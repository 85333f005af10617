package postgres_test

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// emptyDB is a database of the test's own; advisory locks are per
// database, so tests cannot take each other's locks.
func emptyDB(t *testing.T) *pgxpool.Pool {
	t.Helper()
	dsn := pgtest.NewDatabase(t, pgtest.Template{Name: "empty", Fingerprint: "0",
		Migrate: func(context.Context, string) error { return nil }})
	pool, err := postgres.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// holderPID is the backend holding advisory lock key, 0 when none does.
func holderPID(t *testing.T, pool *pgxpool.Pool, key int64) int32 {
	t.Helper()
	var pid int32
	err := pool.QueryRow(context.Background(), `SELECT coalesce(max(pid), 0) FROM pg_locks
		WHERE locktype = 'advisory' AND granted AND objsubid = 1
		  AND classid = ($1::bigint >> 32)::oid AND objid = ($1::bigint & 4294967295)::oid`, key).Scan(&pid)
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// leader records what one replica's lead calls saw.
type leader struct {
	terms  atomic.Int32 // lead calls started
	active atomic.Int32 // lead calls running now
	mu     sync.Mutex
	causes []error // why each term's context ended
}

// overlaps measures how long two leads ran at once, at the longest.
type overlaps struct {
	mu      sync.Mutex
	running int
	since   time.Time
	max     time.Duration
}

func (o *overlaps) start() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.running++; o.running == 2 {
		o.since = time.Now()
	}
}

func (o *overlaps) stop() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.running == 2 {
		o.max = max(o.max, time.Since(o.since))
	}
	o.running--
}

func (o *overlaps) longest() time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.running >= 2 {
		return max(o.max, time.Since(o.since))
	}
	return o.max
}

func (l *leader) lead(running *atomic.Int32, ov *overlaps) func(context.Context) error {
	return func(ctx context.Context) error {
		l.terms.Add(1)
		l.active.Add(1)
		running.Add(1)
		ov.start()
		<-ctx.Done()
		ov.stop()
		running.Add(-1)
		l.active.Add(-1)
		l.mu.Lock()
		l.causes = append(l.causes, context.Cause(ctx))
		l.mu.Unlock()
		return nil
	}
}

// Killing the holder's backend (pg_terminate_backend) ends its lead with
// ErrLeadershipLost; the lock is then taken again — by the other replica
// or, after reconnecting, by the same one. Two leads overlap at most for
// the documented window: the killed holder's Watch plus its ping timeout.
func TestSingletonLosesAndRetakesLeadershipWhenItsConnectionIsKilled(t *testing.T) {
	t.Parallel()
	for _, replicas := range []int{1, 2} {
		t.Run(map[int]string{1: "alone", 2: "two replicas"}[replicas], func(t *testing.T) {
			t.Parallel()
			pool := emptyDB(t)
			const key = int64(0x65677265_7373ff01)
			logs := &logtest.Buffer{}
			ctx, cancel := context.WithCancel(context.Background())
			var running atomic.Int32
			var ov overlaps
			leaders := make([]*leader, replicas)
			var wg sync.WaitGroup
			for i := range leaders {
				leaders[i] = &leader{}
				// Retry well above Watch: the killed holder notices its loss before
				// another replica tries the lock again (the documented window).
				s := &postgres.Singleton{Pool: pool, Key: key, Name: "test singleton", Retry: 300 * time.Millisecond,
					Watch: 20 * time.Millisecond, Log: slog.New(slog.NewTextHandler(logs, nil))}
				wg.Go(func() { _ = s.Run(ctx, leaders[i].lead(&running, &ov)) })
			}
			defer func() { cancel(); wg.Wait() }()
			terms := func() (n int32) {
				for _, l := range leaders {
					n += l.terms.Load()
				}
				return n
			}

			waittest.For(t, 20*time.Second, "led", func() bool { return running.Load() == 1 && holderPID(t, pool, key) != 0 })
			first := -1
			for i, l := range leaders {
				if l.active.Load() == 1 {
					first = i
				}
			}
			if first < 0 {
				t.Fatal("no replica leads although one was leading a moment ago")
			}
			pid := holderPID(t, pool, key)
			var killed bool
			if err := pool.QueryRow(context.Background(), "SELECT pg_terminate_backend($1)", pid).Scan(&killed); err != nil || !killed {
				t.Fatalf("pg_terminate_backend(%d) = %v, %v", pid, killed, err)
			}
			waittest.For(t, 20*time.Second, "lost by the killed holder", func() bool {
				l := leaders[first]
				l.mu.Lock()
				defer l.mu.Unlock()
				return len(l.causes) == 1
			})
			if cause := leaders[first].causes[0]; !errors.Is(cause, postgres.ErrLeadershipLost) {
				t.Errorf("the killed holder's lead ended with %v, want ErrLeadershipLost", cause)
			}
			waittest.For(t, 20*time.Second, "led again", func() bool {
				p := holderPID(t, pool, key)
				return terms() == 2 && running.Load() == 1 && p != 0 && p != pid
			})
			// The documented window: Watch, plus the ping's timeout.
			if d := ov.longest(); d > 20*time.Millisecond+5*time.Second {
				t.Errorf("two replicas led at once for %s, longer than the window", d)
			}
			cancel()
			wg.Wait()
			if running.Load() != 0 {
				t.Error("a lead still runs after Run returned")
			}
			waittest.For(t, 20*time.Second, "released after Run returned", func() bool { return holderPID(t, pool, key) == 0 })
		})
	}
}

// Only one of several replicas leads, and when the leader's lead returns
// on its own, the lock is released and another replica takes it.
func TestSingletonHandsOverWhenLeadReturns(t *testing.T) {
	t.Parallel()
	pool := emptyDB(t)
	const key = int64(0x65677265_7373ff02)
	ctx, cancel := context.WithCancel(context.Background())
	var running, total atomic.Int32
	var overlap atomic.Bool
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	for range 3 {
		s := &postgres.Singleton{Pool: pool, Key: key, Name: "test", Retry: 10 * time.Millisecond, Watch: time.Second,
			Log: slog.New(slog.NewTextHandler(&logtest.Buffer{}, nil))}
		wg.Go(func() {
			_ = s.Run(ctx, func(ctx context.Context) error {
				if running.Add(1) > 1 {
					overlap.Store(true)
				}
				defer running.Add(-1)
				total.Add(1)
				select {
				case <-ctx.Done():
				case <-time.After(30 * time.Millisecond): // one short term of work
				}
				return nil
			})
		})
	}
	waittest.For(t, 20*time.Second, "led 10 terms", func() bool { return total.Load() >= 10 })
	if overlap.Load() {
		t.Error("two replicas led at once")
	}
}

// Every lock of the suite has a key of its own, the same on every replica
// and every release (a replica of another release holding another key
// would not exclude this one), and non-negative.
func TestLockKey(t *testing.T) {
	t.Parallel()
	locks := [][2]string{
		{"orchestrator", "migrate"}, {"orchestrator", "outbox"}, {"orchestrator", "orphan-gc"},
		{"lease", "migrate"}, {"lease", "sweep"}, {"lease", "demand"},
		{"health", "migrate"}, {"health", "provider-checks"}, {"health", "transitions"},
	}
	seen := map[int64]string{}
	for _, l := range locks {
		k := postgres.LockKey(l[0], l[1])
		if k < 0 {
			t.Errorf("LockKey(%q, %q) = %d, negative", l[0], l[1], k)
		}
		if other, dup := seen[k]; dup {
			t.Errorf("LockKey(%q, %q) = LockKey of %s", l[0], l[1], other)
		}
		seen[k] = l[0] + "/" + l[1]
	}
	// The scheme itself, computed apart (FNV-1a 64 of "egress/lease/sweep",
	// shifted right once): a changed key is a changed lock.
	if got, want := postgres.LockKey("lease", "sweep"), int64(0x328a886fa12c6d28); got != want {
		t.Errorf("LockKey(lease, sweep) = %#x, want %#x", got, want)
	}
}
