// Package store keeps the lease service's state in PostgreSQL (schema
// lease): the pool of proxies learnt from events, the leases and the
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
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
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
	// Now is the clock; time.Now when nil.
	Now func() time.Time
}

// Store is the lease service's state.
type Store struct {
	pool *pgxpool.Pool
	cfg  Config
}

// New returns a store on pool.
func New(pool *pgxpool.Pool, cfg Config) *Store {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Retention <= 0 {
		cfg.Retention = time.Hour
	}
	return &Store{pool: pool, cfg: cfg}
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
}

// AcquireRequest asks for a lease.
type AcquireRequest struct {
	ClientID   string
	TargetHost string
	TTL        time.Duration
	Selector   Selector
}

// The selection: free capacity, no cooldown for the target nor global, then
// fewest active leases, least recently leased (never leased first) and the
// stable random tie-break. The row lock and the re-check of the WHERE
// clause on a row another transaction changed meanwhile (PostgreSQL's
// EvalPlanQual) are what make capacity exact across replicas.
const pickSQL = `
WITH pick AS (
	SELECT p.uid FROM lease.proxies p
	WHERE p.leasable
	  AND ($2 = '' OR p.provider = $2)
	  AND ($3 = '' OR p.region = $3)
	  AND ($4 = '' OR p.zone = $4)
	  AND p.labels @> $5::jsonb
	  AND (COALESCE(p.max_leases, $6) = 0 OR p.active_leases < COALESCE(p.max_leases, $6))
	  AND NOT EXISTS (SELECT 1 FROM lease.cooldowns c
	                  WHERE c.proxy_uid = p.uid AND c.target_host IN ('', $7) AND c.expire_time > $8)
	ORDER BY p.active_leases, p.last_lease_time NULLS FIRST, p.tiebreak
	LIMIT 1
	%s
), upd AS (
	UPDATE lease.proxies p
	SET active_leases = p.active_leases + 1, last_lease_time = $8
	FROM pick
	WHERE p.uid = pick.uid
	  AND (COALESCE(p.max_leases, $6) = 0 OR p.active_leases < COALESCE(p.max_leases, $6))
	RETURNING p.uid, p.name, p.host, p.port, p.active_leases, COALESCE(p.max_leases, $6) AS capacity
), ins AS (
	INSERT INTO lease.leases (id, client_id, proxy_uid, target_host, acquire_time, expire_time, active_at_acquire, capacity)
	SELECT $1, $9, upd.uid, $7, $8, $10, upd.active_leases, upd.capacity FROM upd
	RETURNING id
)
SELECT upd.uid, upd.name, upd.host, upd.port FROM upd, ins`

var (
	pickSkipLocked = fmt.Sprintf(pickSQL, "FOR UPDATE OF p SKIP LOCKED")
	pickWait       = fmt.Sprintf(pickSQL, "FOR UPDATE OF p")
)

// Acquire leases one proxy, or returns a *NoProxyError with the arithmetic.
//
// It first skips proxies other transactions hold locked (the common case
// under load: 200 acquirers do not queue behind one row), and when that
// finds nothing it waits for the locked ones, so a proxy with capacity left
// is never reported unavailable just because another acquire was touching
// it.
func (s *Store) Acquire(ctx context.Context, req AcquireRequest) (Lease, error) {
	now := s.cfg.Now().UTC()
	l := Lease{
		ID:          uuid.NewString(),
		ClientID:    req.ClientID,
		TargetHost:  req.TargetHost,
		AcquireTime: now,
		ExpireTime:  now.Add(req.TTL),
	}
	labels := req.Selector.labelsJSON()
	// pick runs one selection; it returns the lease when it granted one.
	pick := func(q string) (bool, error) {
		var port int32
		err := retry(ctx, func() error {
			return s.pool.QueryRow(ctx, q, l.ID, req.Selector.Provider, req.Selector.Region, req.Selector.Zone,
				labels, s.cfg.DefaultMaxLeases, req.TargetHost, now, req.ClientID, l.ExpireTime).
				Scan(&l.ProxyUID, &l.ProxyName, &l.Host, &port)
		})
		if errors.Is(err, pgx.ErrNoRows) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("acquiring a lease: %w", err)
		}
		l.Port = uint32(port)
		return true, nil
	}
	var u Unavailable
	for attempt := 0; attempt < 3; attempt++ {
		if ok, err := pick(pickSkipLocked); err != nil {
			return Lease{}, err
		} else if ok {
			return l, nil
		}
		var err error
		if u, err = s.unavailable(ctx, req.Selector, req.TargetHost, now); err != nil {
			return Lease{}, err
		}
		if u.Matching == u.Unhealthy+u.AtCapacity+u.CoolingTarget+u.CoolingGlobal {
			return Lease{}, &NoProxyError{u}
		}
		// A proxy with capacity left was locked by another transaction (or
		// a lease ended meanwhile): wait for the locks this time.
		if ok, err := pick(pickWait); err != nil {
			return Lease{}, err
		} else if ok {
			return l, nil
		}
	}
	return Lease{}, &NoProxyError{u}
}

const unavailableSQL = `
SELECT count(*),
       count(*) FILTER (WHERE NOT leasable),
       count(*) FILTER (WHERE leasable AND NOT free),
       count(*) FILTER (WHERE leasable AND free AND cool_target),
       count(*) FILTER (WHERE leasable AND free AND NOT cool_target AND cool_global)
FROM (
	SELECT p.leasable,
	       (COALESCE(p.max_leases, $5) = 0 OR p.active_leases < COALESCE(p.max_leases, $5)) AS free,
	       ($6 <> '' AND EXISTS (SELECT 1 FROM lease.cooldowns c
	                            WHERE c.proxy_uid = p.uid AND c.target_host = $6 AND c.expire_time > $7)) AS cool_target,
	       EXISTS (SELECT 1 FROM lease.cooldowns c
	               WHERE c.proxy_uid = p.uid AND c.target_host = '' AND c.expire_time > $7) AS cool_global
	FROM lease.proxies p
	WHERE NOT p.deleted
	  AND ($1 = '' OR p.provider = $1)
	  AND ($2 = '' OR p.region = $2)
	  AND ($3 = '' OR p.zone = $3)
	  AND p.labels @> $4::jsonb
) p`

func (s *Store) unavailable(ctx context.Context, sel Selector, target string, now time.Time) (Unavailable, error) {
	var u Unavailable
	err := s.pool.QueryRow(ctx, unavailableSQL, sel.Provider, sel.Region, sel.Zone, sel.labelsJSON(),
		s.cfg.DefaultMaxLeases, target, now).
		Scan(&u.Matching, &u.Unhealthy, &u.AtCapacity, &u.CoolingTarget, &u.CoolingGlobal)
	if err != nil {
		return u, fmt.Errorf("counting unavailable proxies: %w", err)
	}
	return u, nil
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
		RETURNING l.id::text, l.client_id, l.proxy_uid, p.name, p.host, p.port, l.target_host, l.acquire_time, l.expire_time`,
		leaseID, clientID, now, now.Add(ttl)).
		Scan(&l.ID, &l.ClientID, &l.ProxyUID, &l.ProxyName, &l.Host, &port, &l.TargetHost, &l.AcquireTime, &l.ExpireTime)
	if err == nil {
		l.Port = uint32(port)
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
	now := s.cfg.Now().UTC()
	var wasActive bool
	err = retry(ctx, func() error {
		return s.lazyQueryRow(ctx, func(r pgx.Row) error { return r.Scan(&wasActive) }, `
			WITH l AS (
				UPDATE lease.leases
				SET end_time = LEAST($3, expire_time),
				    end_reason = CASE WHEN expire_time > $3 THEN 'released' ELSE 'expired' END
				WHERE id = $1 AND client_id = $2 AND end_time IS NULL
				RETURNING proxy_uid, end_reason = 'released' AS active
			), p AS (
				UPDATE lease.proxies p SET active_leases = p.active_leases - 1
				FROM l WHERE p.uid = l.proxy_uid
				RETURNING 1
			)
			SELECT l.active FROM l, p`, leaseID, clientID, now)
	})
	if err == nil {
		return wasActive, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return false, fmt.Errorf("releasing lease: %w", err)
	}
	var owner string
	err = s.pool.QueryRow(ctx, `SELECT client_id FROM lease.leases WHERE id = $1`, leaseID).Scan(&owner)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return false, ErrNotFound
	case err != nil:
		return false, fmt.Errorf("releasing lease: %w", err)
	case owner != clientID:
		return false, ErrNotOwner
	}
	return false, nil
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
	// the lease's target (every target when the lease has none).
	Global bool
}

// Report records an outcome on an active lease or an ended one still
// retained, and starts the cooldown it asks for. When the proxy already
// cools down longer for the same scope, that longer cooldown stays and is
// returned. cooldown is nil when none was asked for.
func (s *Store) Report(ctx context.Context, req ReportRequest) (*Cooldown, error) {
	now := s.cfg.Now().UTC()
	var (
		target  *string
		expire  *time.Time
		outcome *int16
		uid     string
	)
	err := retry(ctx, func() error {
		return s.lazyQueryRow(ctx, func(r pgx.Row) error { return r.Scan(&uid, &target, &expire, &outcome) }, `
			WITH l AS (
				UPDATE lease.leases SET outcome = $3, report_time = $4
				WHERE id = $1 AND client_id = $2
				RETURNING proxy_uid, target_host
			), c AS (
				INSERT INTO lease.cooldowns AS o (proxy_uid, target_host, expire_time, outcome)
				SELECT l.proxy_uid, CASE WHEN $6 THEN '' ELSE l.target_host END, $5, $3 FROM l
				WHERE $5 > $4
				ON CONFLICT (proxy_uid, target_host) DO UPDATE
				SET expire_time = GREATEST(o.expire_time, EXCLUDED.expire_time),
				    outcome = CASE WHEN EXCLUDED.expire_time >= o.expire_time THEN EXCLUDED.outcome ELSE o.outcome END
				RETURNING target_host, expire_time, outcome
			)
			SELECT l.proxy_uid, c.target_host, c.expire_time, c.outcome FROM l LEFT JOIN c ON true`,
			req.LeaseID, req.ClientID, req.Outcome, now, now.Add(req.Cooldown), req.Global)
	})
	if err == nil {
		if target == nil {
			return nil, nil
		}
		return &Cooldown{ProxyUID: uid, TargetHost: *target, ExpireTime: *expire, Outcome: *outcome}, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("reporting outcome: %w", err)
	}
	var owner string
	err = s.pool.QueryRow(ctx, `SELECT client_id FROM lease.leases WHERE id = $1`, req.LeaseID).Scan(&owner)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil, ErrNotFound
	case err != nil:
		return nil, fmt.Errorf("reporting outcome: %w", err)
	default:
		return nil, ErrNotOwner
	}
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

// List returns the leasable proxies (Ready and healthy) matching sel, by
// name, with their active cooldowns (global first, then by target).
func (s *Store) List(ctx context.Context, sel Selector) ([]LeasableProxy, error) {
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
		ORDER BY p.name, p.uid`,
		sel.Provider, sel.Region, sel.Zone, sel.labelsJSON(), s.cfg.DefaultMaxLeases)
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
	// Skipped is true when another replica was sweeping.
	Skipped bool
}

// sweepLock is the advisory lock key that lets one replica sweep at a time.
var sweepLock = int64(fnv64("egress-lease/sweep") >> 1)

// Sweep ends expired leases (freeing their capacity), deletes ended leases
// past retention and ended cooldowns. One replica sweeps at a time; the
// others skip.
func (s *Store) Sweep(ctx context.Context) (SweepResult, error) {
	now := s.cfg.Now().UTC()
	var res SweepResult
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
			rows, err := tx.Query(ctx, `
				WITH e AS (
					UPDATE lease.leases SET end_time = expire_time, end_reason = 'expired'
					WHERE id IN (SELECT id FROM lease.leases
					             WHERE end_time IS NULL AND expire_time <= $1
					             ORDER BY expire_time LIMIT 10000 FOR UPDATE SKIP LOCKED)
					RETURNING proxy_uid
				), c AS (SELECT proxy_uid, count(*)::int AS n FROM e GROUP BY proxy_uid)
				UPDATE lease.proxies p SET active_leases = p.active_leases - c.n
				FROM c WHERE p.uid = c.proxy_uid
				RETURNING c.n`, now)
			if err != nil {
				return err
			}
			ns, err := pgx.CollectRows(rows, pgx.RowTo[int])
			if err != nil {
				return err
			}
			for _, n := range ns {
				res.Expired += n
			}
			tag, err := tx.Exec(ctx, `
				DELETE FROM lease.leases WHERE id IN (
					SELECT id FROM lease.leases
					WHERE acquire_time < $1 AND end_time IS NOT NULL AND end_time < $1 LIMIT 10000)`,
				now.Add(-s.cfg.Retention))
			if err != nil {
				return err
			}
			res.Purged = int(tag.RowsAffected())
			tag, err = tx.Exec(ctx, `DELETE FROM lease.cooldowns WHERE expire_time <= $1`, now)
			if err != nil {
				return err
			}
			res.Cooldowns = int(tag.RowsAffected())
			return nil
		})
	})
	if err != nil {
		return SweepResult{}, fmt.Errorf("sweeping: %w", err)
	}
	return res, nil
}

// Vacuum vacuums the small, hot tables, and analyzes them too when
// analyze is set. Every acquire and release rewrites its proxy's row and
// the selection index entry, so between autovacuum runs (a minute apart at
// best) the index fills with dead entries that each pick has to step over;
// vacuuming the proxies (a few thousand rows) several times a second keeps
// a pick at tens of microseconds. ANALYZE keeps the planner on the
// selection index, but it also makes every connection re-plan its prepared
// statements, so callers run it far less often.
func (s *Store) Vacuum(ctx context.Context, analyze bool) error {
	q := `VACUUM (SKIP_LOCKED) lease.proxies, lease.cooldowns`
	if analyze {
		q = `VACUUM (ANALYZE, SKIP_LOCKED) lease.proxies, lease.cooldowns`
	}
	_, err := s.pool.Exec(ctx, q)
	return err
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

// lazyQueryRow runs one statement whose commit need not wait for the WAL
// flush (synchronous_commit off for its transaction only): releases and
// reports. Should PostgreSQL crash right after, the change may be lost,
// which errs on the safe side: a lost release keeps the capacity held
// until the lease expires; a lost report loses a cooldown. Acquires and
// renewals always commit synchronously. The setting and the statement go
// in one batch: one round trip, one implicit transaction.
func (s *Store) lazyQueryRow(ctx context.Context, scan func(pgx.Row) error, sql string, args ...any) error {
	b := &pgx.Batch{}
	b.Queue(`SELECT set_config('synchronous_commit', 'off', true)`)
	b.Queue(sql, args...)
	br := s.pool.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return err
	}
	if err := scan(br.QueryRow()); err != nil {
		_ = br.Close()
		return err
	}
	return br.Close()
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
