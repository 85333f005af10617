package store

import (
	"context"
	"errors"
	"fmt"
	"github.com/jackc/pgx/v5"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Rejected reports an error PostgreSQL raised about the values of a row
// (a data exception such as a NUL byte in text, an integrity violation, a
// value over a limit): the same row fails every time, so it must be
// skipped, not retried.
func Rejected(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "23") || strings.HasPrefix(pgErr.Code, "54")
}

// ProxyState is what the lease service keeps of a proxy from the
// orchestrator: a ProxyEvent's snapshot or a resync listing.
type ProxyState struct {
	UID        string
	Name       string
	Provider   string
	Region     string
	Zone       string
	Labels     map[string]string
	Host       string
	Port       uint32
	ProviderID string
	// Ready is phase PROXY_PHASE_READY.
	Ready bool
	// Healthy is status.healthy, as of HealthTime (status.
	// health_transition_time; nil when it never changed).
	Healthy    bool
	HealthTime *time.Time
	// Deleted is a DELETED event (or absence from a resync listing).
	Deleted bool
	// MaxLeases is spec.lease.max_leases: nil takes the service default, 0
	// is unlimited.
	MaxLeases *uint32
	// Pool is the name of the pool that owns the proxy; empty for none.
	Pool string
	// Draining: the proxy keeps its leases but takes no new one.
	Draining bool
}

// applySQL upserts a snapshot unless the stored revision is as new. The
// health verdict of the snapshot replaces the stored one unless the stored
// one came later (a health transition seen before the orchestrator
// republished the proxy) for the same instance.
const applySQL = `
INSERT INTO lease.proxies AS o (uid, name, provider, region, zone, labels, host, port, provider_id,
                                ready, healthy, health_time, deleted, max_leases, revision, tiebreak, update_time,
                                pool, draining)
VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19)
` + applyConflictSQL

// applyConflictSQL is what a snapshot does to the stored row of its UID.
const applyConflictSQL = `ON CONFLICT (uid) DO UPDATE SET
	name = EXCLUDED.name, provider = EXCLUDED.provider, region = EXCLUDED.region, zone = EXCLUDED.zone,
	labels = EXCLUDED.labels, host = EXCLUDED.host, port = EXCLUDED.port, provider_id = EXCLUDED.provider_id,
	ready = EXCLUDED.ready, deleted = EXCLUDED.deleted, max_leases = EXCLUDED.max_leases,
	revision = EXCLUDED.revision, update_time = EXCLUDED.update_time,
	applied_xact = pg_current_xact_id(),
	pool = EXCLUDED.pool, draining = EXCLUDED.draining,
	healthy = CASE WHEN o.provider_id <> EXCLUDED.provider_id OR o.health_time IS NULL
	                    OR EXCLUDED.health_time >= o.health_time
	               THEN EXCLUDED.healthy ELSE o.healthy END,
	health_time = CASE WHEN o.provider_id <> EXCLUDED.provider_id OR o.health_time IS NULL
	                        OR EXCLUDED.health_time >= o.health_time
	                   THEN EXCLUDED.health_time ELSE o.health_time END
WHERE o.revision < EXCLUDED.revision`

// columnValues is what a snapshot stores in the columns whose type differs
// from its own field's.
type columnValues struct {
	labels    string // JSON
	port      int32
	maxLeases *int32
	tiebreak  int64
}

func columns(p ProxyState) columnValues {
	c := columnValues{labels: "{}", port: int32(p.Port), tiebreak: Tiebreak(p.UID)}
	if len(p.Labels) > 0 {
		c.labels = Selector{Labels: p.Labels}.labelsJSON()
	}
	if p.MaxLeases != nil {
		v := int32(min(*p.MaxLeases, 1<<31-1))
		c.maxLeases = &v
	}
	return c
}

func (s *Store) applyArgs(p ProxyState, revision int64) []any {
	c := columns(p)
	return []any{p.UID, p.Name, p.Provider, p.Region, p.Zone, c.labels, p.Host, c.port, p.ProviderID,
		p.Ready, p.Healthy, p.HealthTime, p.Deleted, c.maxLeases, revision, c.tiebreak, s.cfg.Now().UTC(),
		p.Pool, p.Draining}
}

// ApplyProxy stores a snapshot of revision unless a newer or equal one is
// stored already; applied says whether it changed anything.
func (s *Store) ApplyProxy(ctx context.Context, p ProxyState, revision int64) (applied bool, err error) {
	err = retry(ctx, func() error {
		tag, err := s.pool.Exec(ctx, applySQL, s.applyArgs(p, revision)...)
		applied = tag.RowsAffected() > 0
		return err
	})
	if err != nil {
		return false, fmt.Errorf("applying proxy %s revision %d: %w", p.UID, revision, err)
	}
	s.Invalidate()
	return applied, nil
}

// HealthTransition is a flip of the health service's verdict on a proxy.
type HealthTransition struct {
	Sequence   int64
	ProxyUID   string
	ProviderID string
	Healthy    bool
	Time       time.Time
}

// ApplyHealth stores a health transition if it is for the proxy's current
// instance, newer than the last transition applied, and not older than the
// verdict the orchestrator last published. A transition for a proxy not
// known yet is dropped: the orchestrator's next event carries the verdict.
func (s *Store) ApplyHealth(ctx context.Context, t HealthTransition) (applied bool, err error) {
	err = retry(ctx, func() error {
		tag, err := s.pool.Exec(ctx, `
			UPDATE lease.proxies SET healthy = $3, health_time = $4, health_sequence = $5, update_time = $6
			WHERE uid = $1 AND provider_id = $2 AND health_sequence < $5
			  AND (health_time IS NULL OR health_time <= $4)`,
			t.ProxyUID, t.ProviderID, t.Healthy, t.Time.UTC(), t.Sequence, s.cfg.Now().UTC())
		applied = tag.RowsAffected() > 0
		return err
	})
	if err != nil {
		return false, fmt.Errorf("applying health transition %d of %s: %w", t.Sequence, t.ProxyUID, err)
	}
	s.Invalidate()
	return applied, nil
}

// ApplyHealths stores health transitions as ApplyHealth does, in one
// statement; applied[i] says whether ts[i] was stored (false too for one
// that a later transition of the same proxy in the batch replaced).
func (s *Store) ApplyHealths(ctx context.Context, ts []HealthTransition) (applied []bool, err error) {
	// One row per proxy: a statement cannot update a row twice.
	latest := make(map[string]int, len(ts))
	for i, t := range ts {
		if j, ok := latest[t.ProxyUID]; !ok || t.Sequence >= ts[j].Sequence {
			latest[t.ProxyUID] = i
		}
	}
	n := len(latest)
	uid, providerID, healthy, when, sequence := make([]string, 0, n), make([]string, 0, n), make([]bool, 0, n), make([]time.Time, 0, n), make([]int64, 0, n)
	for i, t := range ts {
		if latest[t.ProxyUID] == i {
			uid, providerID, healthy = append(uid, t.ProxyUID), append(providerID, t.ProviderID), append(healthy, t.Healthy)
			when, sequence = append(when, t.Time.UTC()), append(sequence, t.Sequence)
		}
	}
	var stored []string
	err = retry(ctx, func() error {
		rows, err := s.pool.Query(ctx, `
			UPDATE lease.proxies p SET healthy = u.healthy, health_time = u.time, health_sequence = u.sequence, update_time = $6
			FROM unnest($1::text[], $2::text[], $3::boolean[], $4::timestamptz[], $5::bigint[])
			     AS u(uid, provider_id, healthy, time, sequence)
			WHERE p.uid = u.uid AND p.provider_id = u.provider_id AND p.health_sequence < u.sequence
			  AND (p.health_time IS NULL OR p.health_time <= u.time)
			RETURNING p.uid`,
			uid, providerID, healthy, when, sequence, s.cfg.Now().UTC())
		if err != nil {
			return err
		}
		stored, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("applying %d health transitions: %w", len(ts), err)
	}
	applied = make([]bool, len(ts))
	for _, u := range stored {
		applied[latest[u]] = true
	}
	s.Invalidate()
	return applied, nil
}

// Withdraw makes a proxy whose snapshot at revision could not be stored
// unleasable: not Ready (and deleted when deleted is set) until a newer
// snapshot that can be stored arrives. It changes nothing when the
// proxy is unknown or known at revision or later.
func (s *Store) Withdraw(ctx context.Context, uid string, revision int64, deleted bool) error {
	err := retry(ctx, func() error {
		_, err := s.pool.Exec(ctx, `
			UPDATE lease.proxies SET ready = false, deleted = deleted OR $3, revision = $2, update_time = $4,
				applied_xact = pg_current_xact_id()
			WHERE uid = $1 AND revision < $2`,
			uid, revision, deleted, s.cfg.Now().UTC())
		return err
	})
	if err != nil {
		return fmt.Errorf("withdrawing proxy %s at revision %d: %w", uid, revision, err)
	}
	s.Invalidate()
	return nil
}

// RejectedProxy is a proxy of a resync page PostgreSQL would not store.
type RejectedProxy struct {
	Proxy    ProxyState
	Revision int64
	Err      error
}

// ApplySnapshot applies a page of a full listing in one round trip,
// proxies[i] at revisions[i] (or every proxy at revisions[0] when it has
// one element): each proxy's own last change, or the listing's revision.
// When PostgreSQL rejects a row's values, the page is applied row by row
// instead and the rejected proxies are returned, the others applied.
func (s *Store) ApplySnapshot(ctx context.Context, proxies []ProxyState, revisions []int64) (applied int, rejected []RejectedProxy, err error) {
	if len(proxies) == 0 {
		return 0, nil, nil
	}
	if len(revisions) != 1 && len(revisions) != len(proxies) {
		return 0, nil, fmt.Errorf("applying a resync page: %d snapshots and %d revisions", len(proxies), len(revisions))
	}
	stored, err := s.applyBatch(ctx, proxies, revisions)
	if err == nil {
		for _, ok := range stored {
			if ok {
				applied++
			}
		}
		return applied, nil, nil
	}
	if !Rejected(err) {
		return 0, nil, fmt.Errorf("applying a resync page: %w", err)
	}
	applied = 0
	for i, p := range proxies {
		revision := revisionAt(revisions, i)
		ok, err := s.ApplyProxy(ctx, p, revision)
		switch {
		case Rejected(err):
			rejected = append(rejected, RejectedProxy{Proxy: p, Revision: revision, Err: err})
		case err != nil:
			return applied, rejected, err
		case ok:
			applied++
		}
	}
	return applied, rejected, nil
}

// applyPageSQL is applySQL over many snapshots in one statement (a resync
// page, or a batch of events), each at its own revision: each column an
// array, a row per element. One statement rather than a pipeline of a
// statement per proxy: PostgreSQL then looks up, compares and writes the
// rows in one executor pass and one commit, which is what makes a resync
// of 100,000 proxies, or following their events, a matter of seconds.
const applyPageSQL = `
INSERT INTO lease.proxies AS o (uid, name, provider, region, zone, labels, host, port, provider_id,
                                ready, healthy, health_time, deleted, max_leases, revision, tiebreak, update_time,
                                pool, draining)
SELECT u.uid, u.name, u.provider, u.region, u.zone, u.labels::jsonb, u.host, u.port, u.provider_id,
       u.ready, u.healthy, u.health_time, u.deleted, u.max_leases, u.revision, u.tiebreak, $16, u.pool, u.draining
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::integer[],
            $9::text[], $10::boolean[], $11::boolean[], $12::timestamptz[], $13::boolean[], $14::integer[],
            $15::bigint[], $17::bigint[], $18::text[], $19::boolean[])
     AS u(uid, name, provider, region, zone, labels, host, port, provider_id, ready, healthy, health_time,
          deleted, max_leases, revision, tiebreak, pool, draining)
-- Rows stored at this revision or a newer one are left before the insert:
-- another replica's resync of the same listing, or its copy of the same
-- events, locks nothing.
WHERE NOT EXISTS (SELECT 1 FROM lease.proxies s WHERE s.uid = u.uid AND s.revision >= u.revision)
` + applyConflictSQL + `
RETURNING o.uid`

// pageColumns is a resync page as applyPageSQL's arrays, one element per
// proxy.
type pageColumns struct {
	uid, name, provider, region, zone, labels, host, providerID, pool []string
	port                                                              []int32
	maxLeases                                                         []*int32
	ready, healthy, deleted, draining                                 []bool
	healthTime                                                        []*time.Time
	revision, tiebreak                                                []int64
}

func (pc *pageColumns) add(p ProxyState, revision int64) {
	c := columns(p)
	pc.revision = append(pc.revision, revision)
	pc.uid, pc.name, pc.provider = append(pc.uid, p.UID), append(pc.name, p.Name), append(pc.provider, p.Provider)
	pc.region, pc.zone, pc.labels = append(pc.region, p.Region), append(pc.zone, p.Zone), append(pc.labels, c.labels)
	pc.host, pc.port, pc.providerID = append(pc.host, p.Host), append(pc.port, c.port), append(pc.providerID, p.ProviderID)
	pc.ready, pc.healthy, pc.healthTime = append(pc.ready, p.Ready), append(pc.healthy, p.Healthy), append(pc.healthTime, p.HealthTime)
	pc.deleted, pc.maxLeases, pc.tiebreak = append(pc.deleted, p.Deleted), append(pc.maxLeases, c.maxLeases), append(pc.tiebreak, c.tiebreak)
	pc.pool, pc.draining = append(pc.pool, p.Pool), append(pc.draining, p.Draining)
}

// revisionAt is the revision of the i-th snapshot of a batch: revisions[i],
// or revisions[0] for every snapshot when it has one element.
func revisionAt(revisions []int64, i int) int64 {
	if len(revisions) == 1 {
		return revisions[0]
	}
	return revisions[i]
}

// applyBatch stores each snapshot at its revision (revisions[i], or
// revisions[0] for all when it has one element) unless as new a one is
// stored, in one statement; applied[i] says whether proxies[i] was stored
// (false too for a snapshot that a newer one of the same proxy in the
// batch replaced).
func (s *Store) applyBatch(ctx context.Context, proxies []ProxyState, revisions []int64) (applied []bool, err error) {
	// One row per proxy: a statement cannot update a row twice. The
	// newest snapshot of a UID in the batch wins (the last of equals).
	newest := make(map[string]int, len(proxies))
	for i, p := range proxies {
		if j, ok := newest[p.UID]; !ok || revisionAt(revisions, i) >= revisionAt(revisions, j) {
			newest[p.UID] = i
		}
	}
	var pc pageColumns
	for i, p := range proxies {
		if newest[p.UID] == i {
			pc.add(p, revisionAt(revisions, i))
		}
	}
	var stored []string
	err = retry(ctx, func() error {
		rows, err := s.pool.Query(ctx, applyPageSQL, pc.uid, pc.name, pc.provider, pc.region, pc.zone, pc.labels,
			pc.host, pc.port, pc.providerID, pc.ready, pc.healthy, pc.healthTime, pc.deleted, pc.maxLeases,
			pc.revision, s.cfg.Now().UTC(), pc.tiebreak, pc.pool, pc.draining)
		if err != nil {
			return err
		}
		stored, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	if err != nil {
		return nil, err
	}
	applied = make([]bool, len(proxies))
	for _, uid := range stored {
		applied[newest[uid]] = true
	}
	s.Invalidate()
	return applied, nil
}

// ApplyProxies stores snapshots from events, proxies[i] at revisions[i],
// each unless as new a one is stored, in one statement; applied[i] says
// whether proxies[i] was stored (false too for a snapshot that a newer one
// of the same proxy in the batch replaced). When PostgreSQL rejects a
// row's values nothing is stored, and the error says so (Rejected): apply
// the snapshots one at a time to find it.
func (s *Store) ApplyProxies(ctx context.Context, proxies []ProxyState, revisions []int64) (applied []bool, err error) {
	if len(proxies) != len(revisions) {
		return nil, fmt.Errorf("applying proxies: %d snapshots and %d revisions", len(proxies), len(revisions))
	}
	if len(proxies) == 0 {
		return nil, nil
	}
	applied, err = s.applyBatch(ctx, proxies, revisions)
	if err != nil {
		return nil, fmt.Errorf("applying %d proxy events: %w", len(proxies), err)
	}
	return applied, nil
}

// ResyncMark is what a resync takes before it lists the orchestrator's
// proxies: a snapshot of the database, in which every proxy stored by a
// transaction (of this replica or another) committed before it is
// visible. See DeleteMissing.
type ResyncMark string

// TakeResyncMark takes the mark of a resync about to list.
func (s *Store) TakeResyncMark(ctx context.Context) (mark ResyncMark, err error) {
	err = retry(ctx, func() error {
		return s.pool.QueryRow(ctx, `SELECT pg_current_snapshot()::text`).Scan(&mark)
	})
	if err != nil {
		return "", fmt.Errorf("taking a resync mark: %w", err)
	}
	return mark, nil
}

// DeleteMissing marks deleted every live proxy not in seen (the complete
// listing) whose snapshot was stored by a transaction visible in mark
// (taken before the listing began): it was deleted while its events were
// missed. A snapshot stored by a transaction still running when the mark
// was taken is kept, whatever the order of their statements. Which
// proxies are gone is decided by the listing, not by revisions, so after
// a reset of the orchestrator's database (revisions start again from one)
// the proxies it no longer holds go too. A tombstone keeps the higher of
// its revision and the listing's (revision), so that a replayed older
// event cannot bring it back.
func (s *Store) DeleteMissing(ctx context.Context, seen []string, mark ResyncMark, revision int64) (deleted int, err error) {
	err = retry(ctx, func() error {
		tag, err := s.pool.Exec(ctx, `
			UPDATE lease.proxies SET deleted = true, revision = GREATEST(revision, $2), update_time = $3
			WHERE NOT deleted AND pg_visible_in_snapshot(applied_xact, $4::pg_snapshot) AND NOT (uid = ANY($1))`,
			seen, revision, s.cfg.Now().UTC(), string(mark))
		deleted = int(tag.RowsAffected())
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("deleting proxies missing from the resync: %w", err)
	}
	s.Invalidate()
	return deleted, nil
}
