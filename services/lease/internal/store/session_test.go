package store

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"
)

// Sessions on a real database, with two stores (two replicas) sharing it.

// sessionLeases returns the client's lease rows of key: id → end_reason
// ("" while active).
func sessionLeases(t *testing.T, st *Store, client, key string) map[string]string {
	t.Helper()
	rows, err := st.Pool().Query(context.Background(),
		`SELECT id::text, COALESCE(end_reason, '') FROM lease.leases WHERE client_id = $1 AND session_key = $2`, client, key)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var id, reason string
		if err := rows.Scan(&id, &reason); err != nil {
			t.Fatal(err)
		}
		out[id] = reason
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func acquireSession(t *testing.T, st *Store, req AcquireRequest) Grant {
	t.Helper()
	g, err := st.Acquire(context.Background(), req)
	if err != nil {
		t.Fatalf("acquire %+v: %v", req, err)
	}
	return g
}

func TestSessionSticksAcrossReplicas(t *testing.T) {
	t.Parallel()
	dsn := testDatabase(t)
	a, _ := startStore(t, dsn, Config{})
	b, _ := startStore(t, dsn, Config{})
	seedPool(t, a, 3)
	req := AcquireRequest{ClientID: "crawler", TargetHost: "shop.example.com", TTL: time.Minute, SessionKey: "s1"}

	first := acquireSession(t, a, req)
	if first.Session != SessionNew || first.SessionKey != "s1" || first.Moved != nil {
		t.Fatalf("first acquire: %+v, want a new session s1", first)
	}
	req.TTL = 2 * time.Minute
	for i, st := range []*Store{a, b, b, a} {
		g := acquireSession(t, st, req)
		if g.Session != SessionExisting || g.ID != first.ID || g.ProxyUID != first.ProxyUID || g.Host != first.Host {
			t.Fatalf("acquire %d: %+v, want the session's lease %s", i, g, first.ID)
		}
		if !g.ExpireTime.After(first.ExpireTime) {
			t.Errorf("acquire %d: expiry %v, want it moved past %v by the longer TTL", i, g.ExpireTime, first.ExpireTime)
		}
	}
	// A shorter TTL never shortens the lease.
	req.TTL = 5 * time.Second
	if g := acquireSession(t, b, req); g.ExpireTime.Before(first.ExpireTime) {
		t.Errorf("a shorter TTL moved the expiry back to %v", g.ExpireTime)
	}
	// Another key, and the same key of another client, are other sessions.
	other := acquireSession(t, b, AcquireRequest{ClientID: "crawler", TTL: time.Minute, SessionKey: "s2"})
	theirs := acquireSession(t, a, AcquireRequest{ClientID: "other", TTL: time.Minute, SessionKey: "s1"})
	if other.Session != SessionNew || theirs.Session != SessionNew || other.ID == first.ID || theirs.ID == first.ID {
		t.Fatalf("other sessions: %+v and %+v, want two new ones", other, theirs)
	}
	if got := sessionLeases(t, a, "crawler", "s1"); len(got) != 1 || got[first.ID] != "" {
		t.Fatalf("lease rows of s1: %v, want only %s, active", got, first.ID)
	}
	checkCounts(t, a)
}

// A session holding the only proxy of capacity 1 gets it again: no other
// proxy is free, and the view must not refuse the acquire for that.
func TestSessionKeepsAFullProxy(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	seedPool(t, st, 1)
	req := AcquireRequest{ClientID: "crawler", TTL: time.Minute, SessionKey: "only"}
	first := acquireSession(t, st, req)
	again := acquireSession(t, st, req)
	if again.Session != SessionExisting || again.ID != first.ID {
		t.Fatalf("second acquire: %+v, want the session's lease", again)
	}
	// A plain acquire is still refused: the proxy is at capacity.
	_, err := st.Acquire(context.Background(), AcquireRequest{ClientID: "crawler", TTL: time.Minute})
	var none *NoProxyError
	if !errors.As(err, &none) || none.AtCapacity != 1 {
		t.Fatalf("plain acquire: %v, want no proxy: 1 at capacity", err)
	}
	checkCounts(t, st)
}

func TestSessionMoves(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		reason MoveReason
		// change makes the session's proxy unusable for the next acquire,
		// through replica b while replica a holds the session.
		change func(t *testing.T, b *Store, p ProxyState, lease Lease)
		// next is the acquire that moves it.
		next func(req AcquireRequest) AcquireRequest
	}{
		{"deleted", MoveDeleted, func(t *testing.T, b *Store, p ProxyState, _ Lease) {
			p.Deleted = true
			applyProxy(t, b, p, 2)
		}, nil},
		{"draining", MoveDraining, func(t *testing.T, b *Store, p ProxyState, _ Lease) {
			p.Draining = true
			applyProxy(t, b, p, 2)
		}, nil},
		{"unhealthy", MoveUnhealthy, func(t *testing.T, b *Store, p ProxyState, _ Lease) {
			p.Healthy = false
			applyProxy(t, b, p, 2)
		}, nil},
		{"cooling down for the target", MoveCoolingDown, func(t *testing.T, b *Store, _ ProxyState, l Lease) {
			report(t, b, ReportRequest{ClientID: "crawler", LeaseID: l.ID, Outcome: 3, Cooldown: time.Hour})
		}, nil},
		{"cooling down globally", MoveCoolingDown, func(t *testing.T, b *Store, _ ProxyState, l Lease) {
			report(t, b, ReportRequest{ClientID: "crawler", LeaseID: l.ID, Outcome: 5, Cooldown: time.Hour, Global: true})
		}, nil},
		{"cooling down for a target reported on a lease of another", MoveCoolingDown, func(t *testing.T, b *Store, _ ProxyState, l Lease) {
			report(t, b, ReportRequest{ClientID: "crawler", LeaseID: l.ID, Outcome: 3, Cooldown: time.Hour, TargetHost: "news.example.com"})
		}, func(req AcquireRequest) AcquireRequest { req.TargetHost = "news.example.com"; return req }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dsn := testDatabase(t)
			a, _ := startStore(t, dsn, Config{})
			b, _ := startStore(t, dsn, Config{})
			proxies := seedProxies(t, a, 3, nil)
			req := AcquireRequest{ClientID: "crawler", TargetHost: "shop.example.com", TTL: time.Minute, SessionKey: "s",
				Selector: Selector{Provider: "test"}}
			first := acquireSession(t, a, req)
			var p ProxyState
			for _, q := range proxies {
				if q.UID == first.ProxyUID {
					p = q
				}
			}
			tc.change(t, b, p, first.Lease)
			next := req
			if tc.next != nil {
				next = tc.next(req)
			}
			g := acquireSession(t, a, next)
			if g.Session != SessionMoved || g.Moved == nil || g.Moved.Reason != tc.reason ||
				g.Moved.LeaseID != first.ID || g.Moved.ProxyUID != first.ProxyUID || g.Moved.ProxyName != p.Name {
				t.Fatalf("acquire after the change: %+v (moved %+v), want moved off %s (%s) for %s", g, g.Moved, first.ID, p.Name, tc.reason)
			}
			if g.ProxyUID == first.ProxyUID || g.ID == first.ID {
				t.Fatalf("the session moved onto its old proxy or lease: %+v", g)
			}
			rows := sessionLeases(t, a, "crawler", "s")
			if len(rows) != 2 || rows[first.ID] != "moved" || rows[g.ID] != "" {
				t.Fatalf("lease rows of the session: %v, want %s moved and %s active", rows, first.ID, g.ID)
			}
			// And it sticks there, from the other replica too.
			if again := acquireSession(t, b, next); again.Session != SessionExisting || again.ID != g.ID {
				t.Fatalf("acquire after the move: %+v, want the new lease %s", again, g.ID)
			}
			checkCounts(t, a)
		})
	}
}

func TestSessionMovesOffASelectorItNoLongerMatches(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	seedProxies(t, st, 2, func(i int, p *ProxyState) {
		p.Labels = map[string]string{"market": []string{"us", "eu"}[i]}
	})
	req := AcquireRequest{ClientID: "crawler", TTL: time.Minute, SessionKey: "s", Selector: Selector{Labels: map[string]string{"market": "us"}}}
	first := acquireSession(t, st, req)
	req.Selector.Labels["market"] = "eu"
	g := acquireSession(t, st, req)
	if g.Session != SessionMoved || g.Moved.Reason != MoveSelector || g.ProxyUID == first.ProxyUID {
		t.Fatalf("acquire with the other market: %+v (moved %+v), want moved for the selector", g, g.Moved)
	}
	checkCounts(t, st)
}

// A cooldown for another target leaves the session where it is.
func TestSessionStaysThroughAnotherTargetsCooldown(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	seedPool(t, st, 2)
	req := AcquireRequest{ClientID: "crawler", TargetHost: "shop.example.com", TTL: time.Minute, SessionKey: "s"}
	first := acquireSession(t, st, req)
	report(t, st, ReportRequest{ClientID: "crawler", LeaseID: first.ID, Outcome: 3, Cooldown: time.Hour, TargetHost: "news.example.com"})
	if g := acquireSession(t, st, req); g.Session != SessionExisting || g.ID != first.ID {
		t.Fatalf("acquire for shop after a ban on news: %+v, want the session's lease", g)
	}
}

// A session lease past its expiry that the sweep has not ended yet ends
// as expired, and the acquire starts a new session (not a move).
func TestSessionPastItsExpiryStartsAnew(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	now := time.Now().UTC().Truncate(time.Second)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	st, _ := startStore(t, testDatabase(t), Config{Now: clock})
	seedPool(t, st, 1)
	req := AcquireRequest{ClientID: "crawler", TTL: 5 * time.Second, SessionKey: "s"}
	first := acquireSession(t, st, req)
	mu.Lock()
	now = now.Add(6 * time.Second)
	mu.Unlock()
	g := acquireSession(t, st, req)
	if g.Session != SessionNew || g.Moved != nil || g.ID == first.ID {
		t.Fatalf("acquire after the expiry: %+v, want a new session", g)
	}
	if rows := sessionLeases(t, st, "crawler", "s"); rows[first.ID] != "expired" || rows[g.ID] != "" {
		t.Fatalf("lease rows: %v, want %s expired and %s active", rows, first.ID, g.ID)
	}
	checkCounts(t, st)
}

// When no proxy can take a moving session, the old lease still ends (its
// proxy cannot serve) and the acquire is refused with the arithmetic.
func TestSessionWithNowhereToMove(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	seedPool(t, st, 1)
	req := AcquireRequest{ClientID: "crawler", TargetHost: "shop.example.com", TTL: time.Minute, SessionKey: "s"}
	first := acquireSession(t, st, req)
	report(t, st, ReportRequest{ClientID: "crawler", LeaseID: first.ID, Outcome: 3, Cooldown: time.Hour})
	_, err := st.Acquire(context.Background(), req)
	var none *NoProxyError
	if !errors.As(err, &none) || none.CoolingTarget != 1 {
		t.Fatalf("acquire: %v, want no proxy: 1 cooling down for the target", err)
	}
	if rows := sessionLeases(t, st, "crawler", "s"); len(rows) != 1 || rows[first.ID] != "moved" {
		t.Fatalf("lease rows: %v, want %s ended as moved", rows, first.ID)
	}
	checkCounts(t, st)

	// Once a proxy can take it, the session's next lease still shows the
	// move, from the proxy and for the reason of that refused round.
	seedProxies(t, st, 2, nil)
	g := acquireSession(t, st, req)
	if g.Session != SessionMoved || g.Moved == nil || g.Moved.LeaseID != first.ID || g.Moved.ProxyUID != first.ProxyUID ||
		g.Moved.ProxyName == "" || g.Moved.Reason != MoveCoolingDown || g.ProxyUID == first.ProxyUID {
		t.Fatalf("acquire once a proxy is free: %+v (moved %+v), want moved off %s for cooling_down", g, g.Moved, first.ID)
	}
	if again := acquireSession(t, st, req); again.Session != SessionExisting || again.ID != g.ID || again.Moved != nil {
		t.Fatalf("acquire after the move: %+v, want the new lease %s, settled", again, g.ID)
	}
	checkCounts(t, st)
}

// A session whose proxy left it in a refused round and serves again by
// the time of its next lease is back there: not a move.
func TestSessionBackOnTheProxyItLeft(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	now := time.Now().UTC().Truncate(time.Second)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	st, _ := startStore(t, testDatabase(t), Config{Now: clock})
	seedPool(t, st, 1)
	req := AcquireRequest{ClientID: "crawler", TargetHost: "shop.example.com", TTL: time.Minute, SessionKey: "s"}
	first := acquireSession(t, st, req)
	report(t, st, ReportRequest{ClientID: "crawler", LeaseID: first.ID, Outcome: 3, Cooldown: 5 * time.Second})
	if _, err := st.Acquire(context.Background(), req); !errors.As(err, new(*NoProxyError)) {
		t.Fatalf("acquire while cooling down: %v, want no proxy", err)
	}
	mu.Lock()
	now = now.Add(6 * time.Second)
	mu.Unlock()
	st.Invalidate()
	g := acquireSession(t, st, req)
	if g.Session != SessionNew || g.Moved != nil || g.ProxyUID != first.ProxyUID {
		t.Fatalf("acquire after the cooldown: %+v (moved %+v), want a new lease on the same proxy", g, g.Moved)
	}
	checkCounts(t, st)
}

// Many acquires of one session at once, over two replicas: every one gets
// the same lease, and the database holds one active lease for the key.
func TestSessionAcquiredAtOnceOnTwoReplicas(t *testing.T) {
	t.Parallel()
	dsn := testDatabase(t)
	a, _ := startStore(t, dsn, Config{})
	b, _ := startStore(t, dsn, Config{})
	seedPool(t, a, 20)
	ctx := context.Background()
	const keys, callers = 5, 16
	var wg sync.WaitGroup
	got := make([][]string, keys)
	var mu sync.Mutex
	errs := make(chan error, keys*callers)
	for k := range keys {
		for i := range callers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				st := []*Store{a, b}[i%2]
				g, err := st.Acquire(ctx, AcquireRequest{ClientID: "crawler", TTL: time.Minute, SessionKey: fmt.Sprintf("k%d", k)})
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				got[k] = append(got[k], g.ID)
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("acquire: %v", err)
	}
	for k, ids := range got {
		for _, id := range ids {
			if id != ids[0] {
				t.Fatalf("session k%d got leases %v, want one", k, ids)
			}
		}
		if rows := sessionLeases(t, a, "crawler", fmt.Sprintf("k%d", k)); len(rows) != 1 {
			t.Fatalf("session k%d: lease rows %v, want one", k, rows)
		}
	}
	checkCounts(t, a)
}

// The unique index holds even against a writer that skips the store.
func TestOneActiveLeasePerSessionIsEnforced(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	seedPool(t, st, 2)
	g := acquireSession(t, st, AcquireRequest{ClientID: "crawler", TTL: time.Minute, SessionKey: "s"})
	_, err := st.Pool().Exec(context.Background(), `
		INSERT INTO lease.leases (id, client_id, proxy_uid, acquire_time, expire_time, active_at_acquire, capacity, session_key)
		SELECT gen_random_uuid(), client_id, proxy_uid, acquire_time, expire_time, 1, 1, session_key FROM lease.leases WHERE id = $1`, g.ID)
	if !sessionTaken(err) {
		t.Fatalf("a second active lease for the session: %v, want the unique index leases_session to refuse it", err)
	}
}

func TestReportForAnotherTarget(t *testing.T) {
	t.Parallel()
	st, _ := startStore(t, testDatabase(t), Config{})
	seedPool(t, st, 1)
	l := acquireSession(t, st, AcquireRequest{ClientID: "crawler", TTL: time.Minute})
	c := report(t, st, ReportRequest{ClientID: "crawler", LeaseID: l.ID, Outcome: 3, Cooldown: time.Hour, TargetHost: "shop.example.com"})
	if c == nil || c.TargetHost != "shop.example.com" {
		t.Fatalf("cooldown %+v, want one for shop.example.com (the lease has no target)", c)
	}
	if _, err := st.Release(context.Background(), "crawler", l.ID); err != nil {
		t.Fatal(err)
	}
	_, err := st.Acquire(context.Background(), AcquireRequest{ClientID: "crawler", TargetHost: "shop.example.com", TTL: time.Minute})
	var none *NoProxyError
	if !errors.As(err, &none) || none.CoolingTarget != 1 {
		t.Fatalf("acquire for shop: %v, want no proxy: 1 cooling down for the target", err)
	}
	acquireSession(t, st, AcquireRequest{ClientID: "crawler", TargetHost: "news.example.com", TTL: time.Minute})
}

func report(t *testing.T, st *Store, req ReportRequest) *Cooldown {
	t.Helper()
	c, err := st.Report(context.Background(), req)
	if err != nil {
		t.Fatalf("report %+v: %v", req, err)
	}
	return c
}

func applyProxy(t *testing.T, st *Store, p ProxyState, revision int64) {
	t.Helper()
	if _, err := st.ApplyProxy(context.Background(), p, revision); err != nil {
		t.Fatal(err)
	}
}

// seedProxies stores n Ready, healthy proxies of provider "test", each
// adjusted by mut, and returns them.
func seedProxies(t *testing.T, st *Store, n int, mut func(int, *ProxyState)) []ProxyState {
	t.Helper()
	pool := make([]ProxyState, n)
	for i := range pool {
		uid := fmt.Sprintf("0c0c0000-0000-4000-8000-%012d", i)
		pool[i] = ProxyState{UID: uid, Name: fmt.Sprintf("p-%03d", i), Provider: "test",
			Host: fmt.Sprintf("10.9.0.%d", i+1), Port: 3128, ProviderID: "test/" + uid, Ready: true, Healthy: true}
		if mut != nil {
			mut(i, &pool[i])
		}
	}
	if _, _, err := st.ApplySnapshot(context.Background(), pool, []int64{1}); err != nil {
		t.Fatal(err)
	}
	return pool
}

// Two replicas that start one session at the same moment on two different
// proxies: neither sees the other's uncommitted lease, the second insert
// violates the unique index, and its round is retried and finds the
// first's lease.
func TestSessionStartedOnTwoProxiesAtOnce(t *testing.T) {
	t.Parallel()
	dsn := testDatabase(t)
	a, _ := startStore(t, dsn, Config{DefaultMaxLeases: 2})
	b, _ := startStore(t, dsn, Config{DefaultMaxLeases: 2})
	seedPool(t, a, 2)
	ctx := context.Background()
	// b leases and releases the first proxy of the order, X: b's view
	// now puts the other, Y, first. a's view (read afresh) does too, and a
	// holds a plain lease on Y, so a's next choice is X while b's view,
	// not refreshed, still offers Y.
	x := acquireSession(t, b, AcquireRequest{ClientID: "crawler", TTL: time.Minute})
	if _, err := b.Release(ctx, "crawler", x.ID); err != nil {
		t.Fatal(err)
	}
	y := acquireSession(t, a, AcquireRequest{ClientID: "crawler", TTL: time.Minute})
	if y.ProxyUID == x.ProxyUID {
		t.Fatalf("a leased %s, b's last; want the other", y.ProxyUID)
	}
	unblock := holdProxies(t, a)
	req := AcquireRequest{ClientID: "crawler", TTL: time.Minute, SessionKey: "raced"}
	results := make(chan Grant, 2)
	errs := make(chan error, 2)
	for _, st := range []*Store{a, b} {
		go func() {
			g, err := st.Acquire(ctx, req)
			if err != nil {
				errs <- err
				return
			}
			results <- g
		}()
	}
	waitBlocked(t, a, 2) // both rounds wait for the proxies' locks
	unblock()
	var got []Grant
	for range 2 {
		select {
		case err := <-errs:
			t.Fatalf("acquire: %v", err)
		case g := <-results:
			got = append(got, g)
		}
	}
	if got[0].ID != got[1].ID {
		t.Fatalf("the two replicas answered leases %s (on %s) and %s (on %s); want one session lease",
			got[0].ID, got[0].ProxyUID, got[1].ID, got[1].ProxyUID)
	}
	if rows := sessionLeases(t, a, "crawler", "raced"); len(rows) != 1 {
		t.Fatalf("lease rows of the session: %v, want one", rows)
	}
	checkCountsCapacity(t, a, 2)
}
