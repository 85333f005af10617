// Package store keeps the lease service's state in PostgreSQL (schema
// lease): the proxy mirror (every proxy, learnt from events), the leases and the
// cooldowns. Every operation is one statement or one short transaction, and
// the capacity of a proxy is enforced in the database under the proxy's row
// lock, so any number of lease replicas sharing the database never lease a
// proxy beyond its capacity.
package store

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/egress-proxies/egress-proxies/pkg/postgres"
)

// Schema is the PostgreSQL schema the lease service owns.
const Schema = "lease"

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations are the schema's goose migrations.
func Migrations() fs.FS { return postgres.MigrationsDir(migrationFiles) }

// Migrate applies the migrations to the database at dsn.
func Migrate(ctx context.Context, dsn string, log *slog.Logger) error {
	return postgres.Migrate(ctx, dsn, Schema, Migrations(), log)
}

// Errors of lease operations.
var (
	// ErrNotFound: no such lease (never existed, or no longer retained).
	ErrNotFound = errors.New("lease not found")
	// ErrNotOwner: the lease belongs to another client.
	ErrNotOwner = errors.New("the lease belongs to another client")
	// ErrEnded: the lease has been released or has expired.
	ErrEnded = errors.New("the lease has ended")
	// ErrProxyGone: the leased proxy is no longer Ready and healthy, or was
	// deleted.
	ErrProxyGone = errors.New("the leased proxy is no longer leasable")
)

// Unavailable is the arithmetic of a failed acquire: how the proxies
// matching the selector were ruled out, each counted once under the first
// reason that applies.
type Unavailable struct {
	Matching      int
	Unhealthy     int
	AtCapacity    int
	CoolingTarget int
	CoolingGlobal int
}

// NoProxyError is returned by Acquire when no proxy is available.
type NoProxyError struct{ Unavailable }

func (e *NoProxyError) Error() string {
	return fmt.Sprintf("no proxy available: %d matching, %d unhealthy, %d at capacity, %d cooling down for the target, %d cooling down globally",
		e.Matching, e.Unhealthy, e.AtCapacity, e.CoolingTarget, e.CoolingGlobal)
}

// Reason is the main reason of the failure, for metrics: the reason that
// ruled out most proxies (the first in field order on a tie), or
// "no_matching_proxy".
func (u Unavailable) Reason() string {
	if u.Matching == 0 {
		return "no_matching_proxy"
	}
	reason, most := "unhealthy", u.Unhealthy
	for _, r := range []struct {
		name string
		n    int
	}{{"at_capacity", u.AtCapacity}, {"cooling_down_target", u.CoolingTarget}, {"cooling_down_global", u.CoolingGlobal}} {
		if r.n > most {
			reason, most = r.name, r.n
		}
	}
	return reason
}

// Config tunes a Store.
type Config struct {
	// DefaultMaxLeases is the capacity of a proxy whose spec does not set
	// max_leases; 0 means unlimited. Every replica must use the same value.
	DefaultMaxLeases int
	// Retention is how long ended leases are kept, so that late reports
	// still count.
	Retention time.Duration
	// RefreshInterval is how often the replica's view of the mirror
	// reads the proxies changed in the database, beside the rounds, even
	// when nothing asks for it (other replicas' leases, expiries swept
	// elsewhere). Default 1s.
	RefreshInterval time.Duration
	// Rounds is how many commit rounds may be in flight at once; default
	// 1. More rounds overlap one's commit with the next one's statements
	// but make each smaller; on a small database server one is fastest.
	Rounds int
	// OnChange, when set, is told every committed change of a lease
	// (acquired, renewed, released, expired, reported), from the goroutine
	// that committed it: it must not block.
	OnChange func([]Change)
	// OnRound, when set, is told the size and duration of every committed
	// round, for metrics.
	OnRound func(ops int, d time.Duration)
	// Now is the clock; time.Now when nil.
	Now func() time.Time
}

// Store is the lease service's state. Acquires, reports and releases are
// committed by Run, which must be running for them to complete.
type Store struct {
	pool    *pgxpool.Pool
	cfg     Config
	queue   chan *op
	stale   atomic.Bool
	waiting atomic.Int64  // operations the committer holds for a later round
	settled atomic.Uint64 // rounds the committer has settled

	lastFullSweep atomic.Int64 // Unix nanoseconds by the store's clock; 0: none yet

	viewRead atomic.Pointer[viewRead] // the committer's view's last read; nil: none yet

	horizonsMu sync.Mutex
	horizons   []sweptHorizon // the sweeps' horizons, oldest first, for purging the change log
}

// New returns a store on pool.
func New(pool *pgxpool.Pool, cfg Config) *Store {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Retention <= 0 {
		cfg.Retention = time.Hour
	}
	if cfg.Rounds <= 0 {
		cfg.Rounds = 1
	}
	if cfg.RefreshInterval <= 0 {
		cfg.RefreshInterval = time.Second
	}
	return &Store{pool: pool, cfg: cfg, queue: make(chan *op, maxRound)}
}

// querier is what a read-only transaction offers.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// readOnly runs f in a repeatable-read, read-only transaction: one
// snapshot for several queries.
func (s *Store) readOnly(ctx context.Context, f func(querier) error) error {
	return pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly},
		func(tx pgx.Tx) error { return f(tx) })
}

// Now is the store's clock.
func (s *Store) Now() time.Time { return s.cfg.Now() }

// Pool is the database pool.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Selector narrows the proxies an operation considers. Empty fields match
// everything; labels must all be present with these values.
type Selector struct {
	Provider string
	Region   string
	Zone     string
	Labels   map[string]string
	// Pool is the name of the pool the proxy belongs to.
	Pool string
}

func (sel Selector) labelsJSON() string {
	if len(sel.Labels) == 0 {
		return "{}"
	}
	b, _ := json.Marshal(sel.Labels)
	return string(b)
}

// Lease is a granted lease.
type Lease struct {
	ID          string
	ClientID    string
	ProxyUID    string
	ProxyName   string
	Host        string
	Port        uint32
	TargetHost  string
	AcquireTime time.Time
	ExpireTime  time.Time
	// Pool is the pool of the proxy; "" for none.
	Pool string
	// SessionKey is the session the lease belongs to; "" for none.
	SessionKey string
}

// AcquireRequest asks for a lease.
type AcquireRequest struct {
	ClientID   string
	TargetHost string
	TTL        time.Duration
	Selector   Selector
	// SessionKey makes the lease the client's session of that key: see
	// Acquire.
	SessionKey string
}

// SessionResult says how a session's acquire was answered.
type SessionResult int

// The answers to a session's acquire.
const (
	// NoSession: the acquire had no session key.
	NoSession SessionResult = iota
	// SessionNew: the session had no active lease; a new one was granted.
	SessionNew
	// SessionExisting: the session's active lease was returned.
	SessionExisting
	// SessionMoved: the session's lease was on a proxy that can no longer
	// serve it; that lease ended ('moved') and a new one was granted.
	SessionMoved
)

// MoveReason says why a session left its proxy, the first that applies in
// this order.
type MoveReason string

// The reasons a session moves.
const (
	MoveDeleted     MoveReason = "deleted"
	MoveDraining    MoveReason = "draining"
	MoveUnhealthy   MoveReason = "unhealthy"
	MoveSelector    MoveReason = "selector"
	MoveCoolingDown MoveReason = "cooling_down"
)

// Moved is the lease a session left.
type Moved struct {
	LeaseID   string
	ProxyUID  string
	ProxyName string
	Reason    MoveReason
}

// Grant is an acquire's answer: the lease and, for a session's acquire,
// what became of the session.
type Grant struct {
	Lease
	Session SessionResult
	// Moved is set for SessionMoved.
	Moved *Moved
}

// Acquire leases one proxy, or returns a *NoProxyError with the arithmetic.
// The proxy is chosen from the replica's view of the mirror and confirmed by
// the database under the proxy's row lock, in the committer's next round;
// a refusal always rests on a fresh read of the database.
//
// With a SessionKey, the database first looks for the client's active
// lease of that key (a unique index allows one): when its proxy is still
// leasable, matches the selector and does not cool down for the target nor
// globally, that lease is the answer, its expiry moved to at least now +
// TTL; otherwise it ends (expired, when past its expiry; else moved, with
// the reason) and a new lease is granted as for any acquire, in the same
// transaction.
func (s *Store) Acquire(ctx context.Context, req AcquireRequest) (Grant, error) {
	o := &op{kind: opAcquire, acquire: req}
	if err := s.submit(ctx, o); err != nil {
		var none *NoProxyError
		if errors.As(err, &none) {
			return Grant{}, err
		}
		return Grant{}, fmt.Errorf("acquiring a lease: %w", err)
	}
	g := Grant{Lease: o.lease, Moved: o.moved}
	if o.moved != nil && o.moved.ProxyUID == o.lease.ProxyUID {
		// Back on the proxy it left in an earlier round (which can serve
		// again): not a move.
		g.Moved = nil
	}
	switch {
	case req.SessionKey == "":
	case o.kept:
		g.Session = SessionExisting
	case g.Moved != nil:
		g.Session = SessionMoved
	default:
		g.Session = SessionNew
	}
	return g, nil
}

// Renew extends an active lease of clientID to now+ttl.
func (s *Store) Renew(ctx context.Context, clientID, leaseID string, ttl time.Duration) (Lease, error) {
	now := s.cfg.Now().UTC()
	var l Lease
	var port int32
	err := s.pool.QueryRow(ctx, `
		UPDATE lease.leases l SET expire_time = $4
		FROM lease.proxies p
		WHERE l.id = $1 AND l.client_id = $2 AND l.end_time IS NULL AND l.expire_time > $3
		  AND p.uid = l.proxy_uid AND p.leasable
		RETURNING l.id::text, l.client_id, l.proxy_uid, p.name, p.host, p.port, p.pool, l.target_host, l.acquire_time, l.expire_time, l.session_key`,
		leaseID, clientID, now, now.Add(ttl)).
		Scan(&l.ID, &l.ClientID, &l.ProxyUID, &l.ProxyName, &l.Host, &port, &l.Pool, &l.TargetHost, &l.AcquireTime, &l.ExpireTime, &l.SessionKey)
	if err == nil {
		l.Port = uint32(port)
		s.changed([]Change{{Type: Renewed, Lease: l, Time: now}})
		return l, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return Lease{}, fmt.Errorf("renewing lease: %w", err)
	}
	var owner string
	var active, leasable bool
	err = s.pool.QueryRow(ctx, `
		SELECT l.client_id, l.end_time IS NULL AND l.expire_time > $2, COALESCE(p.leasable, false)
		FROM lease.leases l LEFT JOIN lease.proxies p ON p.uid = l.proxy_uid
		WHERE l.id = $1`, leaseID, now).Scan(&owner, &active, &leasable)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Lease{}, ErrNotFound
	case err != nil:
		return Lease{}, fmt.Errorf("renewing lease: %w", err)
	case owner != clientID:
		return Lease{}, ErrNotOwner
	case !active:
		return Lease{}, ErrEnded
	default:
		return Lease{}, ErrProxyGone
	}
}

// Release ends a lease of clientID. released is true when this call ended
// an active lease, false when it had already ended (or had expired and
// not yet been swept).
func (s *Store) Release(ctx context.Context, clientID, leaseID string) (released bool, err error) {
	o := &op{kind: opRelease, clientID: clientID, leaseID: leaseID}
	if err := s.submit(ctx, o); err != nil {
		return false, fmt.Errorf("releasing lease: %w", err)
	}
	if o.matched {
		return o.active, nil
	}
	switch err := s.owner(ctx, leaseID, clientID); {
	case err != nil:
		return false, err
	default:
		return false, nil // already ended
	}
}

// owner classifies an operation on a lease the statement did not find:
// ErrNotFound, ErrNotOwner, or nil when clientID owns it.
func (s *Store) owner(ctx context.Context, leaseID, clientID string) error {
	var owner string
	err := s.pool.QueryRow(ctx, `SELECT client_id FROM lease.leases WHERE id = $1`, leaseID).Scan(&owner)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return ErrNotFound
	case err != nil:
		return fmt.Errorf("reading lease: %w", err)
	case owner != clientID:
		return ErrNotOwner
	}
	return nil
}

// Cooldown keeps a proxy away from a target host ("" for every target)
// until ExpireTime.
type Cooldown struct {
	ProxyUID   string
	TargetHost string
	ExpireTime time.Time
	Outcome    int16
}

// ReportRequest records an outcome seen through a lease.
type ReportRequest struct {
	ClientID string
	LeaseID  string
	// Outcome is the leasev1.Outcome value.
	Outcome int16
	// Cooldown is how long to keep the proxy away; 0 starts none.
	Cooldown time.Duration
	// Global applies the cooldown to every target; otherwise it applies to
	// TargetHost, else the lease's target (every target when the lease has
	// none).
	Global bool
	// TargetHost is the target the outcome was seen on when it is not the
	// lease's own; "" for the lease's.
	TargetHost string
}

// Report records an outcome on an active lease or an ended one still
// retained, and starts the cooldown it asks for. When the proxy already
// cools down longer for the same scope, that longer cooldown stays and is
// returned. cooldown is nil when none was asked for.
func (s *Store) Report(ctx context.Context, req ReportRequest) (*Cooldown, error) {
	o := &op{kind: opReport, report: req}
	if err := s.submit(ctx, o); err != nil {
		return nil, fmt.Errorf("reporting outcome: %w", err)
	}
	if o.matched {
		return o.cool, nil
	}
	if err := s.owner(ctx, req.LeaseID, req.ClientID); err != nil {
		return nil, err
	}
	// Owned, yet not found a moment ago: it was purged in between.
	return nil, ErrNotFound
}

// LeasableProxy is a proxy that can be leased, with its load.
type LeasableProxy struct {
	UID           string
	Name          string
	Provider      string
	Region        string
	Zone          string
	Labels        map[string]string
	Host          string
	Port          uint32
	MaxLeases     int
	ActiveLeases  int
	LastLeaseTime *time.Time
	Cooldowns     []Cooldown
}

// ProxyCursor is where a page of List ended: its last proxy's name and
// uid. The zero cursor starts at the first proxy.
type ProxyCursor struct {
	Name string `json:"n"`
	UID  string `json:"u"`
}

// List returns the leasable proxies (Ready and healthy) matching sel, by
// name then uid, after the cursor, at most limit of them (0: all), with
// their active cooldowns (global first, then by target).
func (s *Store) List(ctx context.Context, sel Selector, after ProxyCursor, limit int) ([]LeasableProxy, error) {
	now := s.cfg.Now().UTC()
	rows, err := s.pool.Query(ctx, `
		SELECT p.uid, p.name, p.provider, p.region, p.zone, p.labels, p.host, p.port,
		       COALESCE(p.max_leases, $5), p.active_leases, p.last_lease_time
		FROM lease.proxies p
		WHERE p.leasable
		  AND ($1 = '' OR p.provider = $1)
		  AND ($2 = '' OR p.region = $2)
		  AND ($3 = '' OR p.zone = $3)
		  AND p.labels @> $4::jsonb
		  AND ($6 = '' OR p.pool = $6)
		  AND (p.name, p.uid) > ($7, $8)
		ORDER BY p.name, p.uid
		LIMIT NULLIF($9::int, 0)`,
		sel.Provider, sel.Region, sel.Zone, sel.labelsJSON(), s.cfg.DefaultMaxLeases, sel.Pool, after.Name, after.UID, limit)
	if err != nil {
		return nil, fmt.Errorf("listing proxies: %w", err)
	}
	var out []LeasableProxy
	byUID := map[string]int{}
	for rows.Next() {
		var p LeasableProxy
		var port int32
		if err := rows.Scan(&p.UID, &p.Name, &p.Provider, &p.Region, &p.Zone, &p.Labels, &p.Host, &port,
			&p.MaxLeases, &p.ActiveLeases, &p.LastLeaseTime); err != nil {
			rows.Close()
			return nil, fmt.Errorf("listing proxies: %w", err)
		}
		p.Port = uint32(port)
		byUID[p.UID] = len(out)
		out = append(out, p)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("listing proxies: %w", err)
	}
	if len(out) == 0 {
		return out, nil
	}
	uids := make([]string, 0, len(out))
	for _, p := range out {
		uids = append(uids, p.UID)
	}
	rows, err = s.pool.Query(ctx, `
		SELECT proxy_uid, target_host, expire_time, outcome FROM lease.cooldowns
		WHERE proxy_uid = ANY($1) AND expire_time > $2
		ORDER BY proxy_uid, target_host`, uids, now)
	if err != nil {
		return nil, fmt.Errorf("listing cooldowns: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var c Cooldown
		if err := rows.Scan(&c.ProxyUID, &c.TargetHost, &c.ExpireTime, &c.Outcome); err != nil {
			return nil, fmt.Errorf("listing cooldowns: %w", err)
		}
		i := byUID[c.ProxyUID]
		out[i].Cooldowns = append(out[i].Cooldowns, c)
	}
	return out, rows.Err()
}

// SweepResult says what one sweep did.
type SweepResult struct {
	// Expired leases ended by this sweep.
	Expired int
	// Purged ended leases past retention, deleted.
	Purged int
	// Cooldowns that had ended, deleted.
	Cooldowns int
	// Tombstones of proxies deleted long ago, removed.
	Tombstones int
	// Changes are entries of the mirror's change log past changeRetention,
	// deleted.
	Changes int
	// Skipped is true when another replica was sweeping.
	Skipped bool
}

// TombstoneRetention is how long a deleted proxy's row is kept: longer
// than the NATS event streams keep a proxy's last event (7 days).
const TombstoneRetention = 8 * 24 * time.Hour

// sweepLock is the advisory lock key that lets one replica sweep at a time.
var sweepLock = postgres.LockKey("lease", "sweep")

// Expired leases are found through the partial index on the expiry of
// active leases, which also holds an entry for every lease ended since the
// table was last vacuumed: at thousands of leases a second, far more dead
// entries than live ones. A sweep therefore reads only the leases that
// expired within sweepWindow; one that expired earlier and is still active
// (the sweeps stopped for longer than the window, or a lease committed
// long after its round chose its expiry) is ended by a full sweep, which
// reads them all, at start and every fullSweepEvery.
const (
	sweepWindow    = 15 * time.Second
	fullSweepEvery = time.Minute
)

// Sweep ends expired leases (freeing their capacity), deletes ended leases
// past retention and ended cooldowns. One replica sweeps at a time; the
// others skip.
func (s *Store) Sweep(ctx context.Context) (SweepResult, error) {
	now := s.cfg.Now().UTC()
	since := now.Add(-sweepWindow)
	last := s.lastFullSweep.Load()
	full := last == 0 || now.Sub(time.Unix(0, last)) >= fullSweepEvery
	if full {
		since = time.Time{} // the zero time: every expired lease
	}
	var res SweepResult
	var expired []Change
	wall := time.Now() // the change log's retention is the replicas' wall clock, as their reads' age
	var horizon int64
	err := retry(ctx, func() error {
		res = SweepResult{}
		return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			var locked bool
			if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1)`, sweepLock).Scan(&locked); err != nil {
				return err
			}
			if !locked {
				res.Skipped = true
				return nil
			}
			if err := tx.QueryRow(ctx, horizonSQL).Scan(&horizon); err != nil {
				return err
			}
			if purge := s.purgeHorizon(wall); purge > 0 {
				tag, err := tx.Exec(ctx, `DELETE FROM lease.proxy_changes WHERE xid < $1::bigint::text::xid8`, purge)
				if err != nil {
					return err
				}
				res.Changes = int(tag.RowsAffected())
			}
			// Lock the proxies first, in uid order, as the committer does.
			if _, err := tx.Exec(ctx, `
				SELECT p.uid FROM lease.proxies p
				WHERE p.uid IN (SELECT proxy_uid FROM lease.leases
				                WHERE end_time IS NULL AND expire_time <= $1 AND expire_time > $2)
				ORDER BY p.uid FOR UPDATE OF p`, now, since); err != nil {
				return err
			}
			// The proxies' update runs although the answer reads only e:
			// PostgreSQL executes every data-modifying WITH.
			rows, err := tx.Query(ctx, `
				WITH e AS (
					UPDATE lease.leases SET end_time = expire_time, end_reason = 'expired'
					WHERE id IN (SELECT id FROM lease.leases
					             WHERE end_time IS NULL AND expire_time <= $1 AND expire_time > $2
					             ORDER BY expire_time LIMIT 10000 FOR UPDATE SKIP LOCKED)
					RETURNING id, client_id, proxy_uid, expire_time
				), c AS (SELECT proxy_uid, count(*)::int AS n FROM e GROUP BY proxy_uid),
				u AS (
					UPDATE lease.proxies p SET active_leases = p.active_leases - c.n
					FROM c WHERE p.uid = c.proxy_uid
				)
				SELECT id::text, client_id, proxy_uid, expire_time FROM e`, now, since)
			if err != nil {
				return err
			}
			expired = expired[:0]
			for rows.Next() {
				var l Lease
				if err := rows.Scan(&l.ID, &l.ClientID, &l.ProxyUID, &l.ExpireTime); err != nil {
					rows.Close()
					return err
				}
				expired = append(expired, Change{Type: Expired, Lease: l, Time: now})
			}
			rows.Close()
			if err := rows.Err(); err != nil {
				return err
			}
			res.Expired = len(expired)
			// Lease ids start with their acquisition time, so the leases
			// acquired before the cutoff are a range of the primary key.
			cutoff := now.Add(-s.cfg.Retention)
			tag, err := tx.Exec(ctx, `
				DELETE FROM lease.leases WHERE id IN (
					SELECT id FROM lease.leases
					WHERE id < $1 AND acquire_time < $2 AND end_time IS NOT NULL AND end_time < $2
					ORDER BY id LIMIT 10000)`,
				pgtype.UUID{Bytes: leaseIDBound(cutoff), Valid: true}, cutoff)
			if err != nil {
				return err
			}
			res.Purged = int(tag.RowsAffected())
			tag, err = tx.Exec(ctx, `DELETE FROM lease.cooldowns WHERE expire_time <= $1`, now)
			if err != nil {
				return err
			}
			res.Cooldowns = int(tag.RowsAffected())
			// A deleted proxy's row guards against an older event bringing
			// it back; past the event streams' retention no such event is
			// left to arrive.
			tag, err = tx.Exec(ctx, `
				DELETE FROM lease.proxies WHERE deleted AND active_leases = 0 AND update_time < $1`,
				now.Add(-TombstoneRetention))
			if err != nil {
				return err
			}
			res.Tombstones = int(tag.RowsAffected())
			return nil
		})
	})
	if err != nil {
		return SweepResult{}, fmt.Errorf("sweeping: %w", err)
	}
	if full && !res.Skipped {
		s.lastFullSweep.Store(now.UnixNano())
	}
	if !res.Skipped {
		s.recordHorizon(wall, horizon)
	}
	if res.Expired > 0 {
		s.Invalidate()
		s.changed(expired)
	}
	return res, nil
}

// changeRetention is how long the mirror's change log is kept: a view
// whose last read is older than half of it reads the mirror whole.
const changeRetention = 10 * time.Minute

// sweptHorizon is a sweep's horizon (horizonSQL) and when it was read.
type sweptHorizon struct {
	at      time.Time
	horizon int64
}

func (s *Store) recordHorizon(at time.Time, horizon int64) {
	s.horizonsMu.Lock()
	defer s.horizonsMu.Unlock()
	s.horizons = append(s.horizons, sweptHorizon{at: at, horizon: horizon})
}

// purgeHorizon is the horizon read by the latest sweep at least
// changeRetention before now (0: none): every view whose last read is
// younger than fullReadAfter began it at that horizon or later (the
// oldest running transaction only moves forward), so the change log's
// entries before it are needed by no view. Older horizons are dropped.
func (s *Store) purgeHorizon(now time.Time) int64 {
	s.horizonsMu.Lock()
	defer s.horizonsMu.Unlock()
	i := 0
	for i < len(s.horizons) && now.Sub(s.horizons[i].at) >= changeRetention {
		i++
	}
	if i == 0 {
		return 0
	}
	h := s.horizons[i-1].horizon
	s.horizons = s.horizons[i-1:]
	return h
}

// Stats are the gauges read at scrape time.
type Stats struct {
	ActiveLeases    int
	KnownProxies    int
	LeasableProxies int
	GlobalCooldowns int
	TargetCooldowns int
}

// Stats reads the current totals.
func (s *Store) Stats(ctx context.Context) (Stats, error) {
	now := s.cfg.Now().UTC()
	var st Stats
	err := s.pool.QueryRow(ctx, `
		SELECT (SELECT COALESCE(sum(active_leases), 0)::int FROM lease.proxies),
		       (SELECT count(*) FROM lease.proxies WHERE NOT deleted),
		       (SELECT count(*) FROM lease.proxies WHERE leasable),
		       (SELECT count(*) FROM lease.cooldowns WHERE target_host = '' AND expire_time > $1),
		       (SELECT count(*) FROM lease.cooldowns WHERE target_host <> '' AND expire_time > $1)`, now).
		Scan(&st.ActiveLeases, &st.KnownProxies, &st.LeasableProxies, &st.GlobalCooldowns, &st.TargetCooldowns)
	return st, err
}

// retry runs f again on a deadlock or serialization failure, a few times.
func retry(ctx context.Context, f func() error) error {
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		err = f()
		if !postgres.Retryable(err) {
			return err
		}
		if ctx.Err() != nil {
			return err
		}
	}
	return err
}

func fnv64(s string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(s))
	return h.Sum64()
}

// Tiebreak is the stable random tie-break of a proxy: a hash of its uid.
func Tiebreak(uid string) int64 { return int64(fnv64(uid)) }
