package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// These tests run the committer against a real PostgreSQL: rounds, the
// database refusing a stale view's choice, and a bad operation failing
// alone.

func testDatabase(t *testing.T) string {
	t.Helper()
	return pgtest.NewDatabase(t, pgtest.Template{
		Name:        "lease",
		Fingerprint: pgtest.Fingerprint(Migrations()),
		Migrate:     func(ctx context.Context, dsn string) error { return Migrate(ctx, dsn, nil) },
	})
}

type rounds struct {
	mu    sync.Mutex
	sizes []int
}

func (r *rounds) observe(n int, _ time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sizes = append(r.sizes, n)
}

func (r *rounds) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.sizes)
}

// startStore runs a store (one replica) on dsn until the test ends.
func startStore(t *testing.T, dsn string, cfg Config) (*Store, *rounds) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	db, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	r := &rounds{}
	cfg.OnRound = r.observe
	if cfg.DefaultMaxLeases == 0 {
		cfg.DefaultMaxLeases = 1
	}
	if cfg.Rounds == 0 {
		cfg.Rounds = 1 // the tests that hold a round rely on one at a time
	}
	if cfg.RefreshInterval == 0 {
		cfg.RefreshInterval = time.Hour // views go stale unless told
	}
	st := New(db, cfg)
	done := make(chan struct{})
	go func() { defer close(done); _ = st.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; db.Close() })
	return st, r
}

func seedPool(t *testing.T, st *Store, n int) []string {
	t.Helper()
	var uids []string
	for _, p := range seedProxies(t, st, n, nil) {
		uids = append(uids, p.UID)
	}
	return uids
}

// checkCounts asserts that every proxy's active_leases matches its active
// lease rows and stays within capacity 1.
func checkCounts(t *testing.T, st *Store) {
	t.Helper()
	checkCountsCapacity(t, st, 1)
}

// checkCountsCapacity is checkCounts for proxies of capacity n.
func checkCountsCapacity(t *testing.T, st *Store, n int) {
	t.Helper()
	rows, err := st.Pool().Query(context.Background(), `
		SELECT p.uid, p.active_leases, (SELECT count(*) FROM lease.leases l WHERE l.proxy_uid = p.uid AND l.end_time IS NULL)
		FROM lease.proxies p`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var uid string
		var counted, rowsActive int
		if err := rows.Scan(&uid, &counted, &rowsActive); err != nil {
			t.Fatal(err)
		}
		if counted != rowsActive || counted > n {
			t.Errorf("proxy %s: active_leases %d, active lease rows %d, capacity %d", uid, counted, rowsActive, n)
		}
	}
}

func TestConcurrentAcquiresShareRounds(t *testing.T) {
	t.Parallel()
	for _, inFlight := range []int{1, 3} {
		t.Run(fmt.Sprintf("rounds=%d", inFlight), func(t *testing.T) {
			t.Parallel()
			testConcurrentAcquires(t, inFlight)
		})
	}
}

func testConcurrentAcquires(t *testing.T, inFlight int) {
	st, r := startStore(t, testDatabase(t), Config{Rounds: inFlight})
	seedPool(t, st, 100)
	ctx := context.Background()
	leases := make([]Lease, 100)
	var wg sync.WaitGroup
	errs := make(chan error, 100)
	for i := range leases {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g, err := st.Acquire(ctx, AcquireRequest{ClientID: "crawler", TTL: time.Minute})
			if err != nil {
				errs <- err
			}
			leases[i] = g.Lease
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("acquire: %v", err)
	}
	seen := map[string]bool{}
	for _, l := range leases {
		if seen[l.ProxyUID] {
			t.Fatalf("proxy %s leased twice with capacity 1", l.ProxyUID)
		}
		seen[l.ProxyUID] = true
	}
	if n := r.count(); n >= 100 {
		t.Errorf("100 concurrent acquires took %d rounds; want them to share rounds", n)
	}
	checkCounts(t, st)
	// The pool is full now: the 101st is refused with the arithmetic.
	_, err := st.Acquire(ctx, AcquireRequest{ClientID: "crawler", TTL: time.Minute})
	var none *NoProxyError
	if !errors.As(err, &none) || none.Matching != 100 || none.AtCapacity != 100 {
		t.Fatalf("101st acquire: %v, want no proxy: 100 matching, 100 at capacity", err)
	}
}

func TestStaleViewIsRefusedByTheDatabase(t *testing.T) {
	t.Parallel()
	dsn := testDatabase(t)
	a, aRounds := startStore(t, dsn, Config{})
	b, _ := startStore(t, dsn, Config{})
	seedPool(t, a, 2)
	ctx := context.Background()
	req := AcquireRequest{ClientID: "crawler", TTL: time.Minute}

	// Replica a learns the pool and leases one proxy once, so the other
	// (never leased) comes first in its order.
	warm, err := a.Acquire(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Release(ctx, "crawler", warm.ID); err != nil {
		t.Fatal(err)
	}
	// Replica b leases that never-leased proxy; a's view does not know.
	taken, err := b.Acquire(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if taken.ProxyUID == warm.ProxyUID {
		t.Fatalf("b leased %s, the proxy a leased last; want the never-leased one first", taken.ProxyUID)
	}
	before := aRounds.count()
	got, err := a.Acquire(ctx, req)
	if err != nil {
		t.Fatalf("a's acquire with a stale view: %v", err)
	}
	if got.ProxyUID != warm.ProxyUID {
		t.Fatalf("a leased %s, want %s (the other is b's)", got.ProxyUID, warm.ProxyUID)
	}
	if n := aRounds.count() - before; n < 2 {
		t.Errorf("a's acquire took %d round(s); want the refused choice and the retry", n)
	}
	_, err = a.Acquire(ctx, req)
	var none *NoProxyError
	if !errors.As(err, &none) || none.AtCapacity != 2 {
		t.Fatalf("third acquire: %v, want no proxy: 2 at capacity", err)
	}
	checkCounts(t, a)
}

func TestCooldownFromAnotherReplicaIsHonoured(t *testing.T) {
	t.Parallel()
	dsn := testDatabase(t)
	a, _ := startStore(t, dsn, Config{})
	b, _ := startStore(t, dsn, Config{})
	seedPool(t, a, 1)
	ctx := context.Background()
	req := AcquireRequest{ClientID: "crawler", TargetHost: "shop.example.com", TTL: time.Minute}
	warm, err := a.Acquire(ctx, req) // a's view now holds the pool
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Release(ctx, "crawler", warm.ID); err != nil {
		t.Fatal(err)
	}
	l, err := b.Acquire(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	c, err := b.Report(ctx, ReportRequest{ClientID: "crawler", LeaseID: l.ID, Outcome: 3, Cooldown: time.Hour})
	if err != nil || c == nil || c.TargetHost != "shop.example.com" {
		t.Fatalf("report: %+v, %v", c, err)
	}
	if _, err := b.Release(ctx, "crawler", l.ID); err != nil {
		t.Fatal(err)
	}
	_, err = a.Acquire(ctx, req)
	var none *NoProxyError
	if !errors.As(err, &none) || none.CoolingTarget != 1 {
		t.Fatalf("a's acquire for the cooling target: %v, want no proxy: 1 cooling down for the target", err)
	}
	// Another target is fine.
	if _, err := a.Acquire(ctx, AcquireRequest{ClientID: "crawler", TargetHost: "news.example.com", TTL: time.Minute}); err != nil {
		t.Fatalf("acquire for another target: %v", err)
	}
}

// holdProxies locks every proxy row until the returned func is called, so
// that the committer's next round waits in the database and the operations
// submitted meanwhile queue up for the round after.
func holdProxies(t *testing.T, st *Store) (release func()) {
	t.Helper()
	ctx := context.Background()
	tx, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT 1 FROM lease.proxies FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { _ = tx.Rollback(ctx) }) }
	t.Cleanup(release) // a failing test must not leave the committer blocked
	return release
}

// waitBlocked waits until a round waits for the locks holdProxies took.
// waitBlocked waits until n statements of the test's database wait for a
// lock.
func waitBlocked(t *testing.T, st *Store, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		err := st.Pool().QueryRow(context.Background(), `
			SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		if waiting >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("no round waits for the held proxies after 10s")
		}
		time.Sleep(5 * time.Millisecond) // polling pg_stat_activity
	}
}

func waitQueued(t *testing.T, st *Store, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for st.Queued() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d operations queued after 10s, want %d", st.Queued(), n)
		}
		time.Sleep(5 * time.Millisecond) // polling the queue length
	}
}

func TestBadOperationFailsAlone(t *testing.T) {
	t.Parallel()
	st, r := startStore(t, testDatabase(t), Config{})
	seedPool(t, st, 30)
	ctx := context.Background()
	unblock := holdProxies(t, st)
	first := make(chan error, 1)
	go func() {
		_, err := st.Acquire(ctx, AcquireRequest{ClientID: "crawler", TTL: time.Minute})
		first <- err
	}()
	waitBlocked(t, st, 1)
	var wg sync.WaitGroup
	goodErrs := make(chan error, 20)
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := st.Acquire(ctx, AcquireRequest{ClientID: "crawler", TTL: time.Minute}); err != nil {
				goodErrs <- err
			}
		}()
	}
	bad := make(chan error, 1)
	go func() {
		// PostgreSQL text cannot hold NUL: this statement fails.
		_, err := st.Acquire(ctx, AcquireRequest{ClientID: "bad\x00client", TTL: time.Minute})
		bad <- err
	}()
	waitQueued(t, st, 21)
	unblock()
	if err := <-first; err != nil {
		t.Fatalf("first acquire: %v", err)
	}
	wg.Wait()
	close(goodErrs)
	for err := range goodErrs {
		t.Errorf("a good acquire in the round with the bad one: %v", err)
	}
	if err := <-bad; err == nil {
		t.Error("the acquire with a NUL byte in its client id succeeded")
	}
	var leases int
	if err := st.Pool().QueryRow(ctx, `SELECT count(*) FROM lease.leases`).Scan(&leases); err != nil {
		t.Fatal(err)
	}
	if leases != 21 {
		t.Errorf("%d lease rows, want 21 (the first and the 20 good ones)", leases)
	}
	checkCounts(t, st)
	if r.count() < 21 {
		t.Errorf("%d rounds committed; want the failed round of 21 retried one by one", r.count())
	}
}

func TestTwoReportsOnOneLeaseInOneQueue(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	seedPool(t, st, 2)
	ctx := context.Background()
	l, err := st.Acquire(ctx, AcquireRequest{ClientID: "crawler", TargetHost: "shop.example.com", TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	unblock := holdProxies(t, st)
	blocked := make(chan error, 1)
	go func() {
		_, err := st.Acquire(ctx, AcquireRequest{ClientID: "crawler", TTL: time.Minute})
		blocked <- err
	}()
	waitBlocked(t, st, 1)
	type result struct {
		c   *Cooldown
		err error
	}
	short, long := make(chan result, 1), make(chan result, 1)
	go func() {
		c, err := st.Report(ctx, ReportRequest{ClientID: "crawler", LeaseID: l.ID, Outcome: 2, Cooldown: time.Minute})
		short <- result{c, err}
	}()
	waitQueued(t, st, 1)
	go func() {
		c, err := st.Report(ctx, ReportRequest{ClientID: "crawler", LeaseID: l.ID, Outcome: 3, Cooldown: time.Hour})
		long <- result{c, err}
	}()
	waitQueued(t, st, 2)
	unblock()
	if err := <-blocked; err != nil {
		t.Fatal(err)
	}
	s, lg := <-short, <-long
	if s.err != nil || lg.err != nil {
		t.Fatalf("reports: %v, %v", s.err, lg.err)
	}
	if s.c == nil || lg.c == nil || lg.c.Outcome != 3 || !lg.c.ExpireTime.After(s.c.ExpireTime) {
		t.Fatalf("cooldowns: first %+v, second %+v; want the second (1h, outcome 3) to outlast the first", s.c, lg.c)
	}
}

func TestSweepReadsAWindowAndAFullSweepCatchesUp(t *testing.T) {
	t.Parallel()
	t0 := time.Now().UTC().Truncate(time.Second)
	var mu sync.Mutex
	now := t0
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); defer mu.Unlock(); now = now.Add(d) }
	st, _ := startStore(t, testDatabase(t), Config{Now: clock})
	seedPool(t, st, 2)
	ctx := context.Background()
	sweep := func() SweepResult {
		t.Helper()
		res, err := st.Sweep(ctx)
		if err != nil || res.Skipped {
			t.Fatalf("sweep: %+v, %v", res, err)
		}
		return res
	}
	if _, err := st.Acquire(ctx, AcquireRequest{ClientID: "crawler", TTL: time.Minute}); err != nil {
		t.Fatal(err)
	}
	sweep() // the first sweep is a full one
	advance(10 * time.Second)
	if _, err := st.Acquire(ctx, AcquireRequest{ClientID: "crawler", TTL: 5 * time.Second}); err != nil {
		t.Fatal(err)
	}
	// 35s after the second lease expired: outside the window, and the
	// last full sweep was 50s ago.
	advance(40 * time.Second)
	if res := sweep(); res.Expired != 0 {
		t.Fatalf("windowed sweep ended %d leases, want 0 (the expired one is older than the window)", res.Expired)
	}
	// A minute after the last full sweep the next one is full again.
	advance(20 * time.Second)
	if res := sweep(); res.Expired != 2 {
		t.Fatalf("full sweep ended %d leases, want 2", res.Expired)
	}
	checkCounts(t, st)
	// Within the window, a sweep ends a lease as soon as it expired.
	if _, err := st.Acquire(ctx, AcquireRequest{ClientID: "crawler", TTL: 5 * time.Second}); err != nil {
		t.Fatal(err)
	}
	advance(6 * time.Second)
	if res := sweep(); res.Expired != 1 {
		t.Fatalf("windowed sweep ended %d leases, want the one that just expired", res.Expired)
	}
}

func TestSweepRemovesOldTombstones(t *testing.T) {
	t.Parallel()
	now := time.Now().UTC()
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	st, _ := startStore(t, testDatabase(t), Config{Now: clock})
	uids := seedPool(t, st, 2)
	ctx := context.Background()
	mark, err := st.TakeResyncMark(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// uids[0] is deleted; uids[1] stays.
	if n, err := st.DeleteMissing(ctx, uids[1:], mark, 2); err != nil || n != 1 {
		t.Fatalf("DeleteMissing: %d, %v", n, err)
	}
	count := func() (n int) {
		if err := st.Pool().QueryRow(ctx, `SELECT count(*) FROM lease.proxies`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if res, err := st.Sweep(ctx); err != nil || res.Tombstones != 0 || count() != 2 {
		t.Fatalf("sweep right after the delete: %+v, %v, %d rows; want the tombstone kept", res, err, count())
	}
	mu.Lock()
	now = now.Add(TombstoneRetention + time.Minute)
	mu.Unlock()
	res, err := st.Sweep(ctx)
	if err != nil || res.Tombstones != 1 || count() != 1 {
		t.Fatalf("sweep after the retention: %+v, %v, %d rows; want the tombstone gone and the live proxy kept", res, err, count())
	}
	// An event older than the tombstone was cannot arrive any more; a new
	// one for the same uid brings the proxy back.
	p := ProxyState{UID: uids[0], Name: "back", Host: "10.9.9.9", Port: 3128, ProviderID: "test/" + uids[0], Ready: true, Healthy: true}
	if applied, err := st.ApplyProxy(ctx, p, 3); err != nil || !applied {
		t.Fatalf("applying a newer event: %v, %v", applied, err)
	}
}

// A proxy applied after the resync's mark (its event arrived while the
// listing was read, or another replica applied it) is newer than the
// listing and stays, whatever its revision; one applied before the mark
// and missing from the listing goes, whatever its revision.
func TestDeleteMissingKeepsWhatWasAppliedDuringTheListing(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	ctx := context.Background()
	uids := seedPool(t, st, 1)
	old := ProxyState{UID: "0c0c0000-0000-4000-8000-100000000000", Name: "old", Host: "10.9.1.1", Port: 3128, ProviderID: "test/old", Ready: true, Healthy: true}
	if _, err := st.ApplyProxy(ctx, old, 900); err != nil {
		t.Fatal(err)
	}
	mark, err := st.TakeResyncMark(ctx)
	if err != nil {
		t.Fatal(err)
	}
	late := ProxyState{UID: "0c0c0000-0000-4000-8000-200000000000", Name: "late", Host: "10.9.2.2", Port: 3128, ProviderID: "test/late", Ready: true, Healthy: true}
	if _, err := st.ApplyProxy(ctx, late, 1); err != nil {
		t.Fatal(err)
	}
	if n, err := st.DeleteMissing(ctx, uids, mark, 5); err != nil || n != 1 {
		t.Fatalf("DeleteMissing: %d, %v; want only the old proxy deleted", n, err)
	}
	rows, err := st.Pool().Query(ctx, `SELECT name, deleted, revision FROM lease.proxies ORDER BY name`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		deleted  bool
		revision int64
	}
	got := map[string]row{}
	for rows.Next() {
		var name string
		var r row
		if err := rows.Scan(&name, &r.deleted, &r.revision); err != nil {
			t.Fatal(err)
		}
		got[name] = r
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want := map[string]row{"late": {false, 1}, "old": {true, 900}, "p-000": {false, 1}}
	if len(got) != len(want) {
		t.Fatalf("rows %v, want %v", got, want)
	}
	for name, w := range want {
		if got[name] != w {
			t.Errorf("%s: %+v, want %+v", name, got[name], w)
		}
	}
}

// An event applied by a transaction that was still running when the
// resync took its mark (it began before the mark and committed before the
// listing's deletes) is not older than the listing: the proxy it created
// stays. Here the apply waits on an uncommitted row of the same uid while
// the mark is taken.
func TestDeleteMissingKeepsAnApplyInFlightAtTheMark(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	ctx := context.Background()
	uids := seedPool(t, st, 1)
	const uid = "0c0c0000-0000-4000-8000-300000000000"
	blocker, err := st.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = blocker.Rollback(ctx) }()
	if _, err := blocker.Exec(ctx, `INSERT INTO lease.proxies (uid, name, revision, tiebreak, update_time) VALUES ($1, 'blocker', 1, 0, now())`, uid); err != nil {
		t.Fatal(err)
	}
	type result struct {
		applied []bool
		err     error
	}
	done := make(chan result, 1)
	go func() {
		p := ProxyState{UID: uid, Name: "created", Host: "10.9.3.3", Port: 3128, ProviderID: "test/created", Ready: true, Healthy: true}
		applied, err := st.ApplyProxies(ctx, []ProxyState{p}, []int64{11})
		done <- result{applied, err}
	}()
	waittest.For(t, 30*time.Second, "the apply to wait on the uncommitted row", func() bool {
		var waiting bool
		_ = st.Pool().QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO lease.proxies%')`).Scan(&waiting)
		return waiting
	})
	mark, err := st.TakeResyncMark(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := blocker.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if r := <-done; r.err != nil || len(r.applied) != 1 || !r.applied[0] {
		t.Fatalf("ApplyProxies: %v, %v; want the event applied", r.applied, r.err)
	}
	if n, err := st.DeleteMissing(ctx, uids, mark, 10); err != nil || n != 0 {
		t.Fatalf("DeleteMissing: %d, %v; want nothing deleted", n, err)
	}
	var deleted bool
	if err := st.Pool().QueryRow(ctx, `SELECT deleted FROM lease.proxies WHERE uid = $1`, uid).Scan(&deleted); err != nil || deleted {
		t.Fatalf("the proxy created during the listing: deleted %v, %v; want it kept", deleted, err)
	}
}

// A resync page with a row PostgreSQL rejects (a NUL byte in text) applies
// the other rows and names the rejected one.
func TestApplySnapshotIsolatesARejectedRow(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	good := ProxyState{UID: "00000000-0000-4000-8000-0000000000a1", Name: "good", Provider: "p", Host: "10.0.0.1", Port: 3128, Ready: true, Healthy: true}
	bad := good
	bad.UID, bad.Name, bad.Zone = "00000000-0000-4000-8000-0000000000a2", "bad", "eu-1\x00"
	applied, rejected, err := st.ApplySnapshot(context.Background(), []ProxyState{bad, good}, []int64{5})
	if err != nil {
		t.Fatal(err)
	}
	if applied != 1 || len(rejected) != 1 || rejected[0].Proxy.UID != bad.UID || !Rejected(rejected[0].Err) {
		t.Fatalf("applied %d, rejected %v; want the good row applied and the bad one named", applied, rejected)
	}
}

// A resync page is one statement: a UID twice in it takes its last
// snapshot, proxies without a limit or a verdict time store NULLs, and a
// page of a revision already stored (another replica's resync of the same
// listing) changes nothing.
func TestApplySnapshotPage(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	db := st.pool
	ctx := context.Background()
	limit := uint32(3)
	at := time.Date(2026, 3, 1, 11, 0, 0, 0, time.UTC)
	a := ProxyState{UID: "00000000-0000-4000-8000-0000000000b1", Name: "a-first", Provider: "p", Host: "10.0.0.1", Port: 3128, Ready: true, Healthy: true, HealthTime: &at, MaxLeases: &limit}
	b := ProxyState{UID: "00000000-0000-4000-8000-0000000000b2", Name: "b", Provider: "p", Host: "10.0.0.2", Port: 3128, Ready: true, Labels: map[string]string{"pool": "x"}}
	last := a
	last.Name = "a-last"
	applied, rejected, err := st.ApplySnapshot(ctx, []ProxyState{a, b, last}, []int64{7})
	if err != nil || len(rejected) != 0 || applied != 2 {
		t.Fatalf("applied %d, rejected %v, %v; want 2 rows", applied, rejected, err)
	}
	var name string
	var maxLeases *int32
	var healthTime *time.Time
	if err := db.QueryRow(ctx, `SELECT name, max_leases, health_time FROM lease.proxies WHERE uid = $1`, a.UID).Scan(&name, &maxLeases, &healthTime); err != nil {
		t.Fatal(err)
	}
	if name != "a-last" || maxLeases == nil || *maxLeases != 3 || healthTime == nil || !healthTime.Equal(at) {
		t.Errorf("a: name %q, max_leases %v, health_time %v; want its last snapshot, 3, %v", name, maxLeases, healthTime, at)
	}
	var labels string
	if err := db.QueryRow(ctx, `SELECT max_leases, health_time, labels::text FROM lease.proxies WHERE uid = $1`, b.UID).Scan(&maxLeases, &healthTime, &labels); err != nil {
		t.Fatal(err)
	}
	if maxLeases != nil || healthTime != nil || labels != `{"pool": "x"}` {
		t.Errorf("b: max_leases %v, health_time %v, labels %s; want NULL, NULL, its labels", maxLeases, healthTime, labels)
	}
	if applied, _, err := st.ApplySnapshot(ctx, []ProxyState{a, b}, []int64{7}); err != nil || applied != 0 {
		t.Errorf("the same revision again: applied %d, %v; want nothing", applied, err)
	}
	if applied, _, err := st.ApplySnapshot(ctx, []ProxyState{a, b}, []int64{8}); err != nil || applied != 2 {
		t.Errorf("a newer revision: applied %d, %v; want both", applied, err)
	}
}

// A view's refresh reads the proxies changed since its last read, through
// the change log the database keeps for every write to proxies and
// cooldowns, whoever made it; the sweep purges the log past its retention.
func TestReadChangesFollowsTheLog(t *testing.T) {
	t.Parallel()
	dsn := testDatabase(t)
	a, _ := startStore(t, dsn, Config{})
	b, _ := startStore(t, dsn, Config{})
	ctx := context.Background()
	pool := make([]ProxyState, 3)
	for i := range pool {
		uid := fmt.Sprintf("0c4a0000-0000-4000-8000-%012d", i)
		pool[i] = ProxyState{UID: uid, Name: fmt.Sprintf("c-%03d", i), Provider: "test",
			Host: fmt.Sprintf("10.9.1.%d", i+1), Port: 3128, ProviderID: "test/" + uid, Ready: true, Healthy: true}
	}
	if _, _, err := a.ApplySnapshot(ctx, pool, []int64{1}); err != nil {
		t.Fatal(err)
	}
	now := a.Now().UTC()
	whole, err := a.readMirror(ctx, now)
	if err != nil {
		t.Fatal(err)
	}
	if len(whole.all) != 3 || whole.horizon == 0 {
		t.Fatalf("whole read: %d proxies, horizon %d; want 3 and a horizon", len(whole.all), whole.horizon)
	}
	// Another replica leases a proxy and reports on it; an event deletes
	// another.
	l, err := b.Acquire(ctx, AcquireRequest{ClientID: "crawler", TargetHost: "example.com", TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Report(ctx, ReportRequest{ClientID: "crawler", LeaseID: l.ID, Outcome: 3, Cooldown: time.Hour}); err != nil {
		t.Fatal(err)
	}
	gone := pool[0]
	if gone.UID == l.ProxyUID {
		gone = pool[1]
	}
	gone.Deleted = true
	if _, err := a.ApplyProxy(ctx, gone, 2); err != nil {
		t.Fatal(err)
	}
	// New proxies, a page of them in one statement (one log entry) and
	// one alone.
	fresh := make([]ProxyState, 3)
	for i := range fresh {
		uid := fmt.Sprintf("0c4b0000-0000-4000-8000-%012d", i)
		fresh[i] = ProxyState{UID: uid, Name: fmt.Sprintf("n-%03d", i), Provider: "test",
			Host: fmt.Sprintf("10.9.2.%d", i+1), Port: 3128, ProviderID: "test/" + uid, Ready: true, Healthy: true}
	}
	countLog := func() (n int) {
		t.Helper()
		if err := a.Pool().QueryRow(ctx, `SELECT count(*) FROM lease.proxy_changes`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := countLog()
	if _, _, err := a.ApplySnapshot(ctx, fresh[:2], []int64{2}); err != nil {
		t.Fatal(err)
	}
	if added := countLog() - before; added != 1 {
		t.Errorf("a page of 2 new proxies logged %d entries; want 1", added)
	}
	if _, err := a.ApplyProxy(ctx, fresh[2], 2); err != nil {
		t.Fatal(err)
	}
	changes, err := a.readChanges(ctx, now, whole.horizon)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range fresh {
		if v, ok := changes.all[p.UID]; !ok || v == nil {
			t.Errorf("new proxy %s in the changes: %+v (listed %v); want it", p.Name, v, ok)
		}
	}
	leased, ok := changes.all[l.ProxyUID]
	if !ok || leased == nil || leased.active != 1 || !leased.coolingFor("example.com", now) {
		t.Errorf("the leased proxy in the changes: %+v (listed %v); want 1 active, cooling for example.com", leased, ok)
	}
	if p, ok := changes.all[gone.UID]; !ok || p != nil {
		t.Errorf("the deleted proxy in the changes: %+v (listed %v); want listed as deleted", p, ok)
	}
	if changes.horizon < whole.horizon {
		t.Errorf("horizon went back from %d to %d", whole.horizon, changes.horizon)
	}

	// The sweep purges what came before a sweep's horizon of
	// changeRetention ago, nothing at or after it. (The oldest running
	// transaction of the server may be another database's, so the
	// horizon here is a transaction id taken after the writes above.)
	var logged, horizon int64
	if err := a.Pool().QueryRow(ctx, `SELECT count(*) FROM lease.proxy_changes`).Scan(&logged); err != nil {
		t.Fatal(err)
	}
	if err := a.Pool().QueryRow(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(&horizon); err != nil {
		t.Fatal(err)
	}
	later := pool[2]
	later.Name = "renamed"
	if _, err := a.ApplyProxy(ctx, later, 3); err != nil {
		t.Fatal(err)
	}
	a.recordHorizon(time.Now().Add(-changeRetention), horizon)
	res, err := a.Sweep(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var left, early int
	if err := a.Pool().QueryRow(ctx, `
		SELECT count(*), count(*) FILTER (WHERE xid < $1::bigint::text::xid8) FROM lease.proxy_changes`,
		horizon).Scan(&left, &early); err != nil {
		t.Fatal(err)
	}
	if int64(res.Changes) != logged || early != 0 || left == 0 {
		t.Errorf("sweep purged %d of the %d entries before the horizon; %d left, %d of them before it; want all purged and the later change kept",
			res.Changes, logged, left, early)
	}
}

// Events are applied in batches, each snapshot at its own revision: the
// newest snapshot of a proxy in the batch is the one stored, a snapshot
// older than the stored one changes nothing, and a row PostgreSQL refuses
// fails the whole batch as Rejected with nothing stored.
func TestApplyProxiesBatch(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	ctx := context.Background()
	a := ProxyState{UID: "00000000-0000-4000-8000-0000000000c1", Name: "a", Provider: "p", Host: "10.0.0.1", Port: 3128, Ready: true, Healthy: true}
	b := a
	b.UID, b.Name = "00000000-0000-4000-8000-0000000000c2", "b"
	if _, err := st.ApplyProxy(ctx, b, 20); err != nil {
		t.Fatal(err)
	}
	aNewer := a
	aNewer.Name = "a-newer"
	bOlder := b
	bOlder.Name = "b-older"
	applied, err := st.ApplyProxies(ctx, []ProxyState{aNewer, a, bOlder}, []int64{12, 11, 19})
	if err != nil {
		t.Fatal(err)
	}
	if want := []bool{true, false, false}; !slices.Equal(applied, want) {
		t.Errorf("applied %v, want %v (a's newest stored, its older one and b's stale one not)", applied, want)
	}
	name := func(uid string) (name string, revision int64) {
		if err := st.pool.QueryRow(ctx, `SELECT name, revision FROM lease.proxies WHERE uid = $1`, uid).Scan(&name, &revision); err != nil {
			t.Fatal(err)
		}
		return name, revision
	}
	if n, r := name(a.UID); n != "a-newer" || r != 12 {
		t.Errorf("a is %q at revision %d, want a-newer at 12", n, r)
	}
	if n, r := name(b.UID); n != "b" || r != 20 {
		t.Errorf("b is %q at revision %d, want b at 20 (the older event ignored)", n, r)
	}

	bad := a
	bad.UID, bad.Zone = "00000000-0000-4000-8000-0000000000c3", "eu-1\x00"
	aLater := a
	aLater.Name = "a-later"
	if _, err := st.ApplyProxies(ctx, []ProxyState{aLater, bad}, []int64{13, 13}); !Rejected(err) {
		t.Fatalf("a batch with an unstorable row: %v, want a Rejected error", err)
	}
	if n, _ := name(a.UID); n != "a-newer" {
		t.Errorf("a is %q after the refused batch, want it unchanged", n)
	}
}

// Health transitions are applied in batches: the latest transition of a
// proxy in the batch is the one stored; one for another instance, or older
// than the stored one, changes nothing.
func TestApplyHealthsBatch(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	ctx := context.Background()
	a := ProxyState{UID: "00000000-0000-4000-8000-0000000000d1", Name: "a", Provider: "p", Host: "10.0.0.1", Port: 3128, Ready: true, ProviderID: "i-a"}
	b := a
	b.UID, b.Name, b.ProviderID = "00000000-0000-4000-8000-0000000000d2", "b", "i-b"
	for _, p := range []ProxyState{a, b} {
		if _, err := st.ApplyProxy(ctx, p, 1); err != nil {
			t.Fatal(err)
		}
	}
	at := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	applied, err := st.ApplyHealths(ctx, []HealthTransition{
		{Sequence: 2, ProxyUID: a.UID, ProviderID: "i-a", Healthy: true, Time: at},
		{Sequence: 1, ProxyUID: a.UID, ProviderID: "i-a", Healthy: false, Time: at.Add(-time.Second)},
		{Sequence: 5, ProxyUID: b.UID, ProviderID: "i-old", Healthy: true, Time: at},
	})
	if err != nil {
		t.Fatal(err)
	}
	if want := []bool{true, false, false}; !slices.Equal(applied, want) {
		t.Errorf("applied %v, want %v (a's latest, not its older one nor b's of another instance)", applied, want)
	}
	healthy := func(uid string) bool {
		var h bool
		if err := st.pool.QueryRow(ctx, `SELECT healthy FROM lease.proxies WHERE uid = $1`, uid).Scan(&h); err != nil {
			t.Fatal(err)
		}
		return h
	}
	if !healthy(a.UID) || healthy(b.UID) {
		t.Errorf("healthy: a %v, b %v; want a healthy, b unchanged", healthy(a.UID), healthy(b.UID))
	}
	if applied, err := st.ApplyHealths(ctx, []HealthTransition{{Sequence: 2, ProxyUID: a.UID, ProviderID: "i-a", Healthy: false, Time: at}}); err != nil || applied[0] {
		t.Errorf("the same sequence again: applied %v, %v; want nothing", applied, err)
	}
}
