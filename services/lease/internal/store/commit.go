package store

import (
	"context"
	"crypto/rand"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/egress-proxies/egress-proxies/pkg/postgres"
)

// The committer turns concurrent acquires, reports and releases into a few
// database transactions: a round takes every operation queued so far and
// commits them in one transaction (one round trip, one WAL flush), while
// the next operations queue for the next round. Up to Config.Rounds rounds
// are in flight at once, so the database works on one while the next is
// prepared and sent. Under load that is tens of operations per
// transaction; a lone caller still gets a round of its own at once. Every
// round commits synchronously.

type opKind int

const (
	opAcquire opKind = iota
	opReport
	opRelease
)

// op is one queued operation and where its answer goes.
type op struct {
	kind     opKind
	ctx      context.Context
	acquire  AcquireRequest
	report   ReportRequest
	clientID string // release
	leaseID  string // release
	refused  int    // acquire: choices the database refused so far
	failed   int    // rounds that failed with this op in them
	solo     bool   // commit in a round of its own (after a failure)

	// set by the round
	lease   Lease
	uid     string // acquire: the proxy chosen, "" when none
	granted bool
	kept    bool   // session acquire: the session's lease is the answer
	moved   *Moved // session acquire: the lease the session left
	ended   bool   // session acquire: this round ended the session's previous lease
	matched bool   // report/release: the statement found the lease
	active  bool   // release: it was active (not yet expired)
	cool    *Cooldown
	err     error
	done    chan struct{}
}

func (o *op) finish(err error) {
	o.err = err
	close(o.done)
}

// maxRound bounds the operations of one round, so that one transaction
// stays short even when a burst queued thousands.
const maxRound = 512

// submit queues o and waits for its answer.
func (s *Store) submit(ctx context.Context, o *op) error {
	o.ctx, o.done = ctx, make(chan struct{})
	select {
	case s.queue <- o:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-o.done:
		return o.err
	case <-ctx.Done():
		// The round may still commit it: an acquire then holds its proxy
		// until the lease expires, as a lease whose client went away.
		return ctx.Err()
	}
}

// session names a session acquire's session: its client and key.
func (o *op) session() string { return o.acquire.ClientID + "\x00" + o.acquire.SessionKey }

// Queued is how many operations wait for a round (not yet in flight).
func (s *Store) Queued() int { return int(s.waiting.Load()) + len(s.queue) }

// Invalidate makes the next round read the mirror's changes: it changed.
func (s *Store) Invalidate() { s.stale.Store(true) }

// round is one transaction's worth of operations.
type round struct {
	ops   []*op
	now   time.Time
	start time.Time
	res   roundResult
	err   error
}

// Run commits the queued operations until ctx ends. One Run per Store.
func (s *Store) Run(ctx context.Context) error {
	v := newView()
	done := make(chan *round)
	fresh := make(chan *snapshot)
	go s.refresh(ctx, fresh)
	inflight := 0
	var waiting []*op // queued, retried and deferred operations
	for {
		if ctx.Err() != nil {
			for ; inflight > 0; inflight-- {
				r := <-done
				for _, o := range r.ops {
					o.finish(ctx.Err())
				}
			}
			for _, o := range waiting {
				o.finish(ctx.Err())
			}
			return nil
		}
	drain:
		for {
			select {
			case o := <-s.queue:
				waiting = append(waiting, o)
			default:
				break drain
			}
		}
		if inflight < s.cfg.Rounds && len(waiting) > 0 {
			var r *round
			if r, waiting = s.prepare(ctx, v, waiting); r != nil {
				inflight++
				go func() {
					r.res, r.err = s.commit(ctx, r.ops, r.now)
					done <- r
				}()
			}
			continue
		}
		s.waiting.Store(int64(len(waiting)))
		select {
		case <-ctx.Done():
		case o := <-s.queue:
			waiting = append(waiting, o)
		case r := <-done:
			inflight--
			waiting = append(s.settle(v, r), waiting...)
		case snap := <-fresh:
			s.adopt(v, snap)
		}
	}
}

// refresh reads the mirror's changes every RefreshInterval beside the
// committer and hands them over, so that the periodic read never delays a
// round. Before the committer's first read there is no view to refresh.
func (s *Store) refresh(ctx context.Context, fresh chan<- *snapshot) {
	t := time.NewTicker(s.cfg.RefreshInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		last := s.viewRead.Load()
		if last == nil {
			continue
		}
		snap, err := s.read(ctx, s.cfg.Now().UTC(), last.horizon, last.started)
		if err != nil {
			continue // the next tick tries again; rounds read when they must
		}
		select {
		case fresh <- snap:
		case <-ctx.Done():
			return
		}
	}
}

// prepare takes the next round's operations from waiting and chooses
// proxies for its acquires; it returns the round (nil when none is left
// to commit) and the operations still waiting.
func (s *Store) prepare(ctx context.Context, v *view, waiting []*op) (*round, []*op) {
	var ops, rest []*op
	reports := map[string]bool{}  // lease ids of this round's reports
	sessions := map[string]bool{} // sessions of this round's acquires
	for i, o := range waiting {
		session := o.kind == opAcquire && o.acquire.SessionKey != ""
		switch {
		case o.ctx.Err() != nil:
			o.finish(o.ctx.Err())
		case len(ops) >= maxRound || o.solo && len(ops) > 0:
			rest = append(rest, waiting[i:]...)
			return s.choose(ctx, v, ops, rest)
		case o.kind == opReport && reports[o.report.LeaseID],
			session && sessions[o.session()]:
			// Two reports on one lease, or two acquires of one session:
			// the second goes in a later round, so that each sees the
			// first one's result.
			rest = append(rest, o)
		default:
			if o.kind == opReport {
				reports[o.report.LeaseID] = true
			}
			if session {
				sessions[o.session()] = true
			}
			ops = append(ops, o)
			if o.solo {
				return s.choose(ctx, v, ops, append(rest, waiting[i+1:]...))
			}
		}
	}
	return s.choose(ctx, v, ops, rest)
}

// choose picks a proxy from the view for every acquire of ops. When the
// view has none for one, it is reloaded and the choices made again (at
// most once per reloadPause), so a refusal rests on a fresh read of the
// database, with this replica's rounds in flight counted as committed. An
// acquire still without a proxy is answered with the arithmetic.
func (s *Store) choose(ctx context.Context, v *view, ops, rest []*op) (*round, []*op) {
	if len(ops) == 0 {
		return nil, rest
	}
	r := &round{ops: ops, start: time.Now(), now: s.cfg.Now().UTC().Truncate(time.Microsecond)}
	fail := func(err error) (*round, []*op) {
		for _, o := range ops {
			o.finish(fmt.Errorf("reading the proxy mirror: %w", err))
		}
		return nil, rest
	}
	if v.stale || s.stale.Swap(false) {
		if err := s.reload(ctx, v, r.now); err != nil {
			return fail(err)
		}
	}
	pick := func() (missing bool) {
		for _, o := range ops {
			if o.kind == opAcquire && o.uid == "" {
				if p := v.pick(o.acquire.Selector, o.acquire.TargetHost, r.now); p != nil {
					o.uid = p.uid
				} else {
					missing = true
				}
			}
		}
		return missing
	}
	if pick() && time.Since(v.loaded) >= reloadPause {
		// The picks already made stay pending across the reload.
		if err := s.reload(ctx, v, r.now); err != nil {
			for _, o := range ops {
				if o.uid != "" {
					v.settle(o.uid, -1, 0)
				}
			}
			return fail(err)
		}
		pick()
	}
	kept := ops[:0]
	for _, o := range ops {
		// A session's acquire goes to the database even without a
		// proxy to offer: the session's own lease may be the answer.
		if o.kind == opAcquire && o.uid == "" && o.acquire.SessionKey == "" {
			o.finish(&NoProxyError{v.unavailable(o.acquire.Selector, o.acquire.TargetHost, r.now)})
			continue
		}
		kept = append(kept, o)
	}
	if len(kept) == 0 {
		return nil, rest
	}
	r.ops = kept
	return r, rest
}

// reloadPause is the least time between two reloads of the view made
// because it had no proxy to offer, so that an exhausted pool under load
// is not re-read for every round.
const reloadPause = 50 * time.Millisecond

// settle applies a finished round to the view and answers its operations;
// it returns those to try again.
func (s *Store) settle(v *view, r *round) (again []*op) {
	res := r.res
	if r.err != nil {
		v.stale = true
		for _, o := range r.ops {
			if o.uid != "" {
				v.settle(o.uid, -1, 0)
				o.uid = ""
			}
			o.failed++
			switch {
			case o.ctx.Err() != nil:
				o.finish(o.ctx.Err())
			case (postgres.Retryable(r.err) || sessionTaken(r.err)) && o.failed < 5:
				again = append(again, o)
			case !postgres.Retryable(r.err) && !sessionTaken(r.err) && len(r.ops) > 1 && !o.solo:
				// One operation may be at fault: commit each on its own,
				// so that it fails alone.
				o.solo = true
				again = append(again, o)
			default:
				o.finish(r.err)
			}
		}
		return again
	}
	if s.cfg.OnRound != nil {
		s.cfg.OnRound(len(r.ops), time.Since(r.start))
	}
	seq := s.settled.Add(1)
	var changes []Change
	for _, o := range r.ops {
		switch o.kind {
		case opRelease:
			rel, ok := res.released[o.leaseID]
			o.matched, o.active = ok, rel.active
			if ok {
				v.setActive(rel.uid, rel.count, seq)
				typ := Released
				if !rel.active {
					typ = Expired
				}
				changes = append(changes, Change{Type: typ, Lease: Lease{ID: o.leaseID, ClientID: o.clientID, ProxyUID: rel.uid}, Time: r.now})
			}
			o.finish(nil)
		case opReport:
			var uid string
			uid, o.matched = res.reported[o.report.LeaseID]
			c := res.cooldowns[o.report.LeaseID]
			if c != nil {
				o.cool = c
				v.addCooldown(c.ProxyUID, c.TargetHost, c.ExpireTime, seq)
			}
			if o.matched {
				changes = append(changes, Change{Type: Reported, Lease: Lease{ID: o.report.LeaseID, ClientID: o.report.ClientID, ProxyUID: uid},
					Cooldown: c, Time: r.now})
			}
			o.finish(nil)
		}
	}
	defer func() { s.changed(changes) }()
	for _, o := range r.ops {
		if o.kind != opAcquire {
			continue
		}
		a := acquired{active: -1}
		if o.uid != "" {
			if got, ok := res.acquired[o.lease.ID]; ok {
				a = got
			}
			v.settle(o.uid, a.active, seq)
		}
		endedNow := false
		if sr, ok := res.sessions[o.session()]; ok && o.acquire.SessionKey != "" && sr.earlier {
			// The session moved off its proxy in an earlier round that had
			// no proxy to give it (or in this operation's previous round):
			// the grant to come completes that move.
			if o.moved == nil {
				o.moved = &Moved{LeaseID: sr.lease.ID, ProxyUID: sr.lease.ProxyUID, ProxyName: sr.lease.ProxyName, Reason: MoveReason(sr.verdict)}
			}
		} else if ok && o.acquire.SessionKey != "" {
			if sr.active >= 0 {
				v.setActive(sr.lease.ProxyUID, sr.active, seq)
			}
			if sr.verdict == "" {
				o.kept, o.lease = true, sr.lease
				changes = append(changes, Change{Type: Renewed, Lease: o.lease, Time: r.now})
				o.finish(nil)
				continue
			}
			endedNow = true
			typ := Released
			if sr.verdict == verdictExpired {
				typ = Expired
			} else {
				o.moved = &Moved{LeaseID: sr.lease.ID, ProxyUID: sr.lease.ProxyUID, ProxyName: sr.lease.ProxyName, Reason: MoveReason(sr.verdict)}
			}
			changes = append(changes, Change{Type: typ, Lease: Lease{ID: sr.lease.ID, ClientID: o.acquire.ClientID, ProxyUID: sr.lease.ProxyUID}, Time: r.now})
		}
		if o.uid == "" {
			// A session's acquire without a proxy to offer, even after a
			// reload. When this round ended the session's previous lease,
			// its place may be the one to take: choose once more.
			if !endedNow {
				o.finish(&NoProxyError{v.unavailable(o.acquire.Selector, o.acquire.TargetHost, r.now)})
			} else {
				again = append(again, o)
			}
			continue
		}
		if o.granted = a.granted; o.granted {
			o.lease.ProxyName, o.lease.Host, o.lease.Port = a.name, a.host, uint32(a.port)
			if p := v.all[o.uid]; p != nil {
				o.lease.Pool = p.pool
			}
			changes = append(changes, Change{Type: Acquired, Lease: o.lease, Time: r.now})
			o.finish(nil)
			continue
		}
		// The database refused the view's choice: another replica leased
		// it (the view now holds the database's count), or it cools down
		// or stopped being leasable (the view reloads). Choose again.
		if p := v.all[o.uid]; p == nil || p.free() {
			v.stale = true
		}
		o.uid = ""
		if o.refused++; o.refused > 3 {
			o.finish(&NoProxyError{v.unavailable(o.acquire.Selector, o.acquire.TargetHost, r.now)})
			continue
		}
		again = append(again, o)
	}
	return again
}

// lockSQL takes the row locks of every proxy the round changes, in uid
// order, before any change: two rounds (of two replicas, or a round and the
// sweep) then wait for each other instead of deadlocking.
const lockSQL = `
SELECT p.uid FROM lease.proxies p
WHERE p.uid = ANY($1::text[] || ARRAY(
	SELECT l.proxy_uid FROM lease.leases l WHERE l.id = ANY($2::uuid[])) || ARRAY(
	SELECT l.proxy_uid FROM unnest($3::text[], $4::text[]) AS s(client_id, session_key)
	JOIN lease.leases l ON l.client_id = s.client_id AND l.session_key = s.session_key
	     AND l.session_key <> '' AND l.end_reason IS NULL))
ORDER BY p.uid
FOR UPDATE OF p`

// The statements below name their keys with = ANY besides joining the
// request arrays, so that the planner reads the tables through their
// primary keys. An active lease is found by end_reason IS NULL, the same
// as end_time IS NULL by the table's CHECK, because the partial index on
// end_time IS NULL holds an entry for every lease ended since the last
// vacuum and the planner would AND it in.

// releaseSQL ends the leases of a round (a lease past its expiry ends as
// expired) and gives their capacity back.
const releaseSQL = `
WITH req AS (
	SELECT * FROM unnest($1::uuid[], $2::text[]) AS r(id, client_id)
), l AS (
	UPDATE lease.leases le
	SET end_time = LEAST($3, le.expire_time),
	    end_reason = CASE WHEN le.expire_time > $3 THEN 'released' ELSE 'expired' END
	FROM req r
	WHERE le.id = ANY($1::uuid[]) AND le.id = r.id AND le.client_id = r.client_id AND le.end_reason IS NULL
	RETURNING le.id, le.proxy_uid, le.end_reason = 'released' AS active
), n AS (
	SELECT proxy_uid, count(*)::int AS n FROM l GROUP BY proxy_uid
), p AS (
	UPDATE lease.proxies p SET active_leases = p.active_leases - n.n
	FROM n WHERE p.uid = n.proxy_uid
	RETURNING p.uid, p.active_leases
)
SELECT l.id::text, l.active, p.uid, p.active_leases FROM l JOIN p ON p.uid = l.proxy_uid`

// reportSQL records the outcomes of a round, on active leases and on ended
// ones still retained, and starts the cooldowns they ask for; a longer
// cooldown already in force for the same scope stays.
const reportSQL = `
WITH req AS (
	SELECT * FROM unnest($1::uuid[], $2::text[], $3::int2[], $4::timestamptz[], $5::bool[], $7::text[])
		AS r(id, client_id, outcome, cool_until, global, target_host)
), l AS (
	UPDATE lease.leases le SET outcome = r.outcome, report_time = $6
	FROM req r
	WHERE le.id = ANY($1::uuid[]) AND le.id = r.id AND le.client_id = r.client_id
	RETURNING le.id, le.proxy_uid,
	          CASE WHEN r.global THEN '' WHEN r.target_host <> '' THEN r.target_host ELSE le.target_host END AS scope,
	          r.outcome, r.cool_until
), want AS (
	SELECT DISTINCT ON (proxy_uid, scope) proxy_uid, scope, cool_until, outcome
	FROM l WHERE cool_until > $6
	ORDER BY proxy_uid, scope, cool_until DESC
), c AS (
	INSERT INTO lease.cooldowns AS o (proxy_uid, target_host, expire_time, outcome)
	SELECT proxy_uid, scope, cool_until, outcome FROM want
	ON CONFLICT (proxy_uid, target_host) DO UPDATE
	SET expire_time = GREATEST(o.expire_time, EXCLUDED.expire_time),
	    outcome = CASE WHEN EXCLUDED.expire_time >= o.expire_time THEN EXCLUDED.outcome ELSE o.outcome END
	RETURNING proxy_uid, target_host, expire_time, outcome
)
SELECT l.id::text, l.proxy_uid, c.target_host, c.expire_time, c.outcome
FROM l LEFT JOIN c ON l.cool_until > $6 AND c.proxy_uid = l.proxy_uid AND c.target_host = l.scope`

// acquireSQL grants the round's choices that the database confirms: the
// proxy is leasable, has the capacity for all of the round's leases on it
// (checked on the locked, current row), and does not cool down for the
// lease's target nor globally. A proxy that cannot take all of them takes
// none; the view then learns its count and chooses again.
//
// The cooldown check is a subquery per requested lease, probing the
// cooldowns' primary key for its two scopes: written as NOT EXISTS, the
// planner turned it into a hash anti-join that read every cooldown in
// force on every round, so that a ban wave on other targets slowed all
// acquires (BenchmarkLoop/cooldowns=5000).
const acquireSQL = `
WITH req AS (
	SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::timestamptz[], $8::text[])
		AS r(id, proxy_uid, client_id, target_host, expire_time, session_key)
), ok AS (
	SELECT r.* FROM req r
	WHERE NOT COALESCE((SELECT bool_or(c.expire_time > $6) FROM lease.cooldowns c
	                    WHERE c.proxy_uid = r.proxy_uid AND c.target_host IN ('', r.target_host)), false)
	  -- a session whose lease sessionSQL kept takes no new one
	  AND (r.session_key = '' OR NOT EXISTS (
	        SELECT 1 FROM lease.leases le
	        WHERE le.client_id = r.client_id AND le.session_key = r.session_key
	          AND le.session_key <> '' AND le.end_reason IS NULL))
), n AS (
	SELECT proxy_uid, count(*)::int AS n FROM ok GROUP BY proxy_uid
), p AS (
	UPDATE lease.proxies p SET active_leases = p.active_leases + n.n, last_lease_time = $6
	FROM n
	WHERE p.uid = ANY($2::text[]) AND p.uid = n.proxy_uid AND p.leasable
	  AND (COALESCE(p.max_leases, $7) = 0 OR p.active_leases + n.n <= COALESCE(p.max_leases, $7))
	RETURNING p.uid, p.name, p.host, p.port, p.active_leases, COALESCE(p.max_leases, $7) AS capacity, n.n
), ins AS (
	INSERT INTO lease.leases (id, client_id, proxy_uid, target_host, acquire_time, expire_time, active_at_acquire, capacity, session_key)
	SELECT ok.id, ok.client_id, ok.proxy_uid, ok.target_host, $6, ok.expire_time,
	       p.active_leases - p.n + row_number() OVER (PARTITION BY ok.proxy_uid ORDER BY ok.id), p.capacity, ok.session_key
	FROM ok JOIN p ON p.uid = ok.proxy_uid
	RETURNING id
)
SELECT r.id::text, ins.id IS NOT NULL, COALESCE(p.name, ''), COALESCE(p.host, ''), COALESCE(p.port, 0),
       COALESCE(p.active_leases, cur.active_leases, 0)
FROM req r
LEFT JOIN ins ON ins.id = r.id
LEFT JOIN p ON p.uid = r.proxy_uid
LEFT JOIN lease.proxies cur ON cur.uid = ANY($2::text[]) AND cur.uid = r.proxy_uid`

type released struct {
	active bool
	uid    string
	count  int
}

type acquired struct {
	granted    bool
	name, host string
	port       int
	active     int
}

// roundResult is what a round's statements returned, by lease id.
type roundResult struct {
	released  map[string]released
	reported  map[string]string // lease id → proxy uid
	cooldowns map[string]*Cooldown
	acquired  map[string]acquired
	sessions  map[string]sessionRow // by op.session()
}

// commit runs a round's statements in one transaction, one round trip.
// It runs beside the committer and must not touch the view.
func (s *Store) commit(ctx context.Context, ops []*op, now time.Time) (roundResult, error) {
	var (
		acqIDs, relIDs, repIDs          []pgtype.UUID // binary-encoded, unlike strings
		acqUIDs, acqClients, acqTargets []string
		acqSessions                     []string
		acqExpire                       []time.Time
		ses                             sessionArgs
		relClients, repClients          []string
		repTargets                      []string
		repOutcomes                     []int16
		repUntil                        []time.Time
		repGlobal                       []bool
	)
	for _, o := range ops {
		switch o.kind {
		case opAcquire:
			if o.acquire.SessionKey != "" {
				ses.add(o, now)
			}
			if o.uid == "" {
				continue // a session's, answered by the session's lease or not at all
			}
			o.lease = Lease{
				ID: newLeaseID(now).String(), ClientID: o.acquire.ClientID, ProxyUID: o.uid, TargetHost: o.acquire.TargetHost,
				AcquireTime: now, ExpireTime: now.Add(o.acquire.TTL), SessionKey: o.acquire.SessionKey,
			}
			acqIDs = append(acqIDs, parseLeaseID(o.lease.ID))
			acqUIDs = append(acqUIDs, o.uid)
			acqClients = append(acqClients, o.acquire.ClientID)
			acqTargets = append(acqTargets, o.acquire.TargetHost)
			acqSessions = append(acqSessions, o.acquire.SessionKey)
			acqExpire = append(acqExpire, o.lease.ExpireTime)
		case opRelease:
			relIDs = append(relIDs, parseLeaseID(o.leaseID))
			relClients = append(relClients, o.clientID)
		case opReport:
			repIDs = append(repIDs, parseLeaseID(o.report.LeaseID))
			repClients = append(repClients, o.report.ClientID)
			repOutcomes = append(repOutcomes, o.report.Outcome)
			repUntil = append(repUntil, now.Add(o.report.Cooldown))
			repGlobal = append(repGlobal, o.report.Global)
			repTargets = append(repTargets, o.report.TargetHost)
		}
	}
	res := roundResult{
		released:  map[string]released{},
		reported:  map[string]string{},
		cooldowns: map[string]*Cooldown{},
		acquired:  make(map[string]acquired, len(acqIDs)),
		sessions:  map[string]sessionRow{},
	}
	b := &pgx.Batch{}
	// Every row these statements touch is found by key. Without this, a
	// plan made for arrays of unknown length may scan a table whole
	// (proxies; leases while it is small); with it, the generic plans are
	// index lookups, fit for a round of any size, and made once.
	b.Queue(`SELECT set_config('enable_seqscan', 'off', true)`)
	if len(acqIDs) > 0 || len(relIDs) > 0 || len(ses.clients) > 0 {
		b.Queue(lockSQL, uniqueSorted(acqUIDs), relIDs, ses.clients, ses.keys)
	}
	if len(relIDs) > 0 {
		b.Queue(releaseSQL, relIDs, relClients, now).Query(func(rows pgx.Rows) error {
			for rows.Next() {
				var id string
				var r released
				if err := rows.Scan(&id, &r.active, &r.uid, &r.count); err != nil {
					return err
				}
				res.released[id] = r
			}
			return rows.Err()
		})
	}
	if len(repIDs) > 0 {
		b.Queue(reportSQL, repIDs, repClients, repOutcomes, repUntil, repGlobal, now, repTargets).Query(func(rows pgx.Rows) error {
			for rows.Next() {
				var id, uid string
				var target *string
				var end *time.Time
				var outcome *int16
				if err := rows.Scan(&id, &uid, &target, &end, &outcome); err != nil {
					return err
				}
				res.reported[id] = uid
				if target != nil {
					res.cooldowns[id] = &Cooldown{ProxyUID: uid, TargetHost: *target, ExpireTime: *end, Outcome: *outcome}
				}
			}
			return rows.Err()
		})
	}
	if len(ses.clients) > 0 {
		ses.queue(b, now, res.sessions)
	}
	if len(acqIDs) > 0 {
		b.Queue(acquireSQL, acqIDs, acqUIDs, acqClients, acqTargets, acqExpire, now, s.cfg.DefaultMaxLeases, acqSessions).
			Query(func(rows pgx.Rows) error {
				for rows.Next() {
					var id string
					var a acquired
					if err := rows.Scan(&id, &a.granted, &a.name, &a.host, &a.port, &a.active); err != nil {
						return err
					}
					res.acquired[id] = a
				}
				return rows.Err()
			})
	}
	return res, s.pool.SendBatch(ctx, b).Close()
}

// parseLeaseID reads a lease id the API validated; anything else becomes
// the nil UUID, which names no lease.
func parseLeaseID(id string) pgtype.UUID {
	u, _ := uuid.Parse(id)
	return pgtype.UUID{Bytes: u, Valid: true}
}

func uniqueSorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return slices.Compact(s)
}

// newLeaseID returns a version 7 UUID (RFC 9562) for a lease acquired at
// t: the acquisition millisecond, then random bits. The lease table's
// primary key then grows at its right edge, and leases acquired before a
// time are the keys below leaseIDBound of that time (the purge reads them
// so, with no index of its own). t is the store's clock, not the wall
// clock, so that tests with a fake clock purge as production does.
func newLeaseID(t time.Time) uuid.UUID {
	u := leaseIDBound(t)
	if _, err := rand.Read(u[6:]); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	u[6] = 0x70 | u[6]&0x0f // version 7
	u[8] = 0x80 | u[8]&0x3f // RFC 9562 variant
	return u
}

// leaseIDBound is the smallest lease id of a lease acquired at t or later.
func leaseIDBound(t time.Time) uuid.UUID {
	var u uuid.UUID
	ms := uint64(max(t.UnixMilli(), 0))
	for i := range 6 {
		u[i] = byte(ms >> (8 * (5 - i)))
	}
	return u
}
