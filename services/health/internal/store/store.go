// Package store keeps the health service's state in PostgreSQL, schema
// "health": the transitions (also the outbox of the HealthTransitionEvents),
// the current health of every probed proxy, and the latest check of every
// provider.
package store

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
)

// Schema is the PostgreSQL schema the service owns.
const Schema = "health"

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations are the embedded goose migrations.
func Migrations() fs.FS { return postgres.MigrationsDir(migrationFiles) }

// Migrate applies the migrations to the database at dsn.
func Migrate(ctx context.Context, dsn string, log *slog.Logger) error {
	return postgres.Migrate(ctx, dsn, Schema, Migrations(), log)
}

// transitionLock serialises transition inserts so sequences commit in
// order (see the migration).
var transitionLock = postgres.LockKey(Schema, "transitions")

// ErrNotFound is returned for a missing row.
var ErrNotFound = errors.New("not found")

// Store is the service's PostgreSQL store.
type Store struct {
	pool *pgxpool.Pool
}

// New returns a store on pool.
func New(pool *pgxpool.Pool) *Store { return &Store{pool: pool} }

// Pool is the store's pool.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// ErrRejected marks a write PostgreSQL refused for what it holds (a data
// exception or a violated constraint, SQLSTATE classes 22 and 23): writing
// it again cannot succeed.
var ErrRejected = errors.New("rejected by the database")

// classify marks err ErrRejected when PostgreSQL refused the data.
func classify(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "23")) {
		return fmt.Errorf("%w: %w", ErrRejected, err)
	}
	return err
}

// Record is a transition to store and, when State is set, the proxy's
// current state to write with it.
type Record struct {
	Transition engine.Transition
	State      *engine.State
}

// RecordTransition stores one transition; see RecordTransitions.
func (s *Store) RecordTransition(ctx context.Context, tr engine.Transition, st *engine.State, prober string) (*healthv1.HealthTransition, error) {
	out, err := s.RecordTransitions(ctx, []Record{{Transition: tr, State: st}}, prober)
	if err != nil {
		return nil, err
	}
	return out[0], nil
}

// RecordTransitions stores transitions and the states given with them in
// one transaction, in the order given, and returns each stored transition
// with its sequence (nil for one not stored). A transition that repeats
// the proxy's last stored verdict for the same instance — stored before or
// earlier in recs — is not a flip (a replica that took the proxy over
// without knowing the earlier verdict reached the same one again) and is
// not stored. Inserts are serialised by an advisory lock, so sequences
// commit in order and the repeat rule holds across replicas. Either all of
// recs is written or nothing; an error wraps ErrRejected when PostgreSQL
// refused what one of them holds.
func (s *Store) RecordTransitions(ctx context.Context, recs []Record, prober string) ([]*healthv1.HealthTransition, error) {
	if len(recs) == 0 {
		return nil, nil
	}
	var out []*healthv1.HealthTransition
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		uids := make([]string, 0, len(recs))
		for _, r := range recs {
			uids = append(uids, r.Transition.UID)
		}
		// The lock and the last transition of every proxy of the batch
		// in one round trip.
		b := &pgx.Batch{}
		b.Queue("SELECT pg_advisory_xact_lock($1)", transitionLock)
		b.Queue(`SELECT DISTINCT ON (proxy_uid) proxy_uid, provider_id, credentials_time, healthy FROM health.transitions
			WHERE proxy_uid = ANY($1) ORDER BY proxy_uid, sequence DESC`, uids)
		br := tx.SendBatch(ctx, b)
		if _, err := br.Exec(); err != nil {
			br.Close()
			return err
		}
		last := map[string]engine.Transition{}
		rows, err := br.Query()
		if err != nil {
			br.Close()
			return err
		}
		for rows.Next() {
			var t engine.Transition
			var creds *time.Time
			if err := rows.Scan(&t.UID, &t.ProviderID, &creds, &t.Healthy); err != nil {
				rows.Close()
				br.Close()
				return err
			}
			if creds != nil {
				t.CredentialsTime = *creds
			}
			last[t.UID] = t
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			br.Close()
			return err
		}
		if err := br.Close(); err != nil {
			return err
		}

		out = make([]*healthv1.HealthTransition, len(recs))
		var ins insertColumns
		var stored []int
		for i, r := range recs {
			tr := r.Transition
			if l, ok := last[tr.UID]; ok && l.ProviderID == tr.ProviderID && l.CredentialsTime.Equal(tr.CredentialsTime) && l.Healthy == tr.Healthy {
				continue
			}
			last[tr.UID] = tr
			ins.add(tr)
			stored = append(stored, i)
		}
		// The insert and the states in one round trip: the rows go in in
		// the order given (ORDER BY the ordinality), so their sequences do.
		b = &pgx.Batch{}
		if len(stored) > 0 {
			b.Queue(`INSERT INTO health.transitions
				(proxy_uid, proxy_name, provider_id, credentials_time, healthy, reason, message, latency_us, transition_time, prober)
				SELECT uid, name, provider, creds, healthy, reason, message, latency, at, $10
				FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[], $5::boolean[], $6::text[], $7::text[],
					$8::bigint[], $9::timestamptz[]) WITH ORDINALITY
					AS r(uid, name, provider, creds, healthy, reason, message, latency, at, n)
				ORDER BY n RETURNING sequence`,
				ins.uid, ins.name, ins.provider, ins.creds, ins.healthy, ins.reason, ins.message, ins.latency, ins.at, prober)
		}
		for _, r := range recs {
			if r.State != nil {
				b.Queue(upsertStateSQL, stateArgs(*r.State, prober)...)
			}
		}
		if b.Len() == 0 {
			return nil
		}
		br = tx.SendBatch(ctx, b)
		defer br.Close()
		if len(stored) > 0 {
			rows, err := br.Query()
			if err != nil {
				return err
			}
			seqs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			if err != nil {
				return err
			}
			if len(seqs) != len(stored) {
				return fmt.Errorf("%d transitions inserted, %d sequences returned", len(stored), len(seqs))
			}
			slices.Sort(seqs)
			for j, i := range stored {
				tr := recs[i].Transition
				out[i] = &healthv1.HealthTransition{
					Sequence: seqs[j], ProxyUid: tr.UID, ProxyName: tr.Name, ProviderId: tr.ProviderID, Healthy: tr.Healthy,
					Reason: tr.Reason, Message: tr.Message, Latency: durationpb.New(tr.Latency), TransitionTime: timestamppb.New(tr.Time),
				}
			}
		}
		return br.Close()
	})
	if err != nil {
		if len(recs) == 1 {
			return nil, fmt.Errorf("recording the transition of %s: %w", recs[0].Transition.Name, classify(err))
		}
		return nil, fmt.Errorf("recording %d transitions: %w", len(recs), classify(err))
	}
	return out, nil
}

// insertColumns are the columns of a multi-row transitions insert, one
// array each.
type insertColumns struct {
	uid, name, provider, reason, message []string
	creds                                []*time.Time
	healthy                              []bool
	latency                              []int64
	at                                   []time.Time
}

func (c *insertColumns) add(tr engine.Transition) {
	c.uid = append(c.uid, tr.UID)
	c.name = append(c.name, tr.Name)
	c.provider = append(c.provider, tr.ProviderID)
	c.creds = append(c.creds, nullTime(tr.CredentialsTime))
	c.healthy = append(c.healthy, tr.Healthy)
	c.reason = append(c.reason, tr.Reason)
	c.message = append(c.message, tr.Message)
	c.latency = append(c.latency, tr.Latency.Microseconds())
	c.at = append(c.at, tr.Time)
}

const upsertStateSQL = `INSERT INTO health.proxy_health
	(proxy_uid, proxy_name, provider_id, address, verdict_known, healthy, reason, message, latency_us,
	 consecutive_successes, consecutive_failures, last_probe_time, last_transition_time, prober, revision,
	 credentials_time, updated_at)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, now())
	ON CONFLICT (proxy_uid) DO UPDATE SET
	 proxy_name = EXCLUDED.proxy_name, provider_id = EXCLUDED.provider_id, address = EXCLUDED.address,
	 credentials_time = EXCLUDED.credentials_time,
	 verdict_known = EXCLUDED.verdict_known, healthy = EXCLUDED.healthy, reason = EXCLUDED.reason,
	 message = EXCLUDED.message, latency_us = EXCLUDED.latency_us,
	 consecutive_successes = EXCLUDED.consecutive_successes, consecutive_failures = EXCLUDED.consecutive_failures,
	 last_probe_time = EXCLUDED.last_probe_time, last_transition_time = EXCLUDED.last_transition_time,
	 prober = EXCLUDED.prober, revision = EXCLUDED.revision, updated_at = now()
	WHERE health.proxy_health.provider_id <> EXCLUDED.provider_id
	   OR health.proxy_health.credentials_time IS DISTINCT FROM EXCLUDED.credentials_time
	   OR health.proxy_health.last_probe_time IS NULL
	   OR EXCLUDED.last_probe_time >= health.proxy_health.last_probe_time`

func stateArgs(st engine.State, prober string) []any {
	return []any{st.Spec.UID, st.Spec.Name, st.Spec.ProviderID, st.Spec.Address, st.VerdictKnown, st.Healthy,
		st.Reason, st.Message, st.Latency.Microseconds(), st.ConsecutiveSuccesses, st.ConsecutiveFailures,
		nullTime(st.LastProbe), nullTime(st.LastTransition), prober, st.Spec.Revision, nullTime(st.Spec.CredentialsTime)}
}

func upsertState(ctx context.Context, tx pgx.Tx, st engine.State, prober string) error {
	_, err := tx.Exec(ctx, upsertStateSQL, stateArgs(st, prober)...)
	return err
}

func nullTimestamp(ts *timestamppb.Timestamp) *time.Time {
	if ts == nil {
		return nil
	}
	return nullTime(ts.AsTime())
}

func nullTime(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// SaveStates upserts the current states of proxies, saveBatch a round
// trip. A state older (by its last probe) than the stored one of the same
// instance is skipped: a batch taken just before a transition must not
// undo the state written with it.
func (s *Store) SaveStates(ctx context.Context, states []engine.State, prober string) error {
	for len(states) > 0 {
		n := min(len(states), saveBatch)
		b := &pgx.Batch{}
		for _, st := range states[:n] {
			b.Queue(upsertStateSQL, stateArgs(st, prober)...)
		}
		if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
			return fmt.Errorf("saving %d proxy states: %w", len(states), err)
		}
		states = states[n:]
	}
	return nil
}

// saveBatch is the most states SaveStates sends in one round trip: the
// flush after a replica's first resync holds every proxy it took (100,000
// states), and one batch of them all took the resident set from about 220
// to 470 MB.
const saveBatch = 1000

// Verdicts returns the stored verdicts of the given proxies, for the
// instance each is stored for: uid -> provider ID and verdict. Proxies
// without a verdict are left out.
func (s *Store) Verdicts(ctx context.Context, uids []string) (map[string]StoredVerdict, error) {
	rows, err := s.pool.Query(ctx, `SELECT proxy_uid, provider_id, credentials_time, healthy, last_transition_time
		FROM health.proxy_health WHERE verdict_known AND proxy_uid = ANY($1)`, uids)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]StoredVerdict{}
	for rows.Next() {
		var uid string
		var v StoredVerdict
		var at, creds *time.Time
		if err := rows.Scan(&uid, &v.ProviderID, &creds, &v.Healthy, &at); err != nil {
			return nil, err
		}
		if creds != nil {
			v.CredentialsTime = creds.UTC()
		}
		if at != nil {
			v.LastTransition = *at
		}
		out[uid] = v
	}
	return out, rows.Err()
}

// StoredVerdict is a proxy's stored verdict and the instance it is for.
type StoredVerdict struct {
	ProviderID      string
	CredentialsTime time.Time
	Healthy         bool
	LastTransition  time.Time
}

// DeleteProxy forgets a proxy's current health as written for its
// snapshots up to revision (its transitions stay until retention removes
// them). A state written for a later snapshot stays: the proxy was
// probeable again by then.
func (s *Store) DeleteProxy(ctx context.Context, uid string, revision int64) error {
	_, err := s.pool.Exec(ctx, "DELETE FROM health.proxy_health WHERE proxy_uid = $1 AND revision <= $2", uid, revision)
	return err
}

const proxyColumns = `proxy_uid, proxy_name, provider_id, address, verdict_known, healthy, reason, message, latency_us,
	consecutive_successes, consecutive_failures, last_probe_time, last_transition_time, prober`

func scanProxy(row pgx.Row) (*healthv1.ProxyHealth, error) {
	var h healthv1.ProxyHealth
	var latency int64
	var succ, fail int32
	var lastProbe, lastTrans *time.Time
	if err := row.Scan(&h.ProxyUid, &h.ProxyName, &h.ProviderId, &h.Address, &h.VerdictKnown, &h.Healthy, &h.Reason,
		&h.Message, &latency, &succ, &fail, &lastProbe, &lastTrans, &h.Prober); err != nil {
		return nil, err
	}
	h.Latency = durationpb.New(time.Duration(latency) * time.Microsecond)
	h.ConsecutiveSuccesses, h.ConsecutiveFailures = uint32(max(succ, 0)), uint32(max(fail, 0))
	if lastProbe != nil {
		h.LastProbeTime = timestamppb.New(*lastProbe)
	}
	if lastTrans != nil {
		h.LastTransitionTime = timestamppb.New(*lastTrans)
	}
	return &h, nil
}

// GetProxy returns the health of the proxy named name.
func (s *Store) GetProxy(ctx context.Context, name string) (*healthv1.ProxyHealth, error) {
	h, err := scanProxy(s.pool.QueryRow(ctx, "SELECT "+proxyColumns+
		" FROM health.proxy_health WHERE proxy_name = $1 ORDER BY updated_at DESC LIMIT 1", name))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNotFound
	}
	return h, err
}

// ListProxies returns up to limit proxies ordered by (name, uid) after the
// given position.
func (s *Store) ListProxies(ctx context.Context, afterName, afterUID string, limit int) ([]*healthv1.ProxyHealth, error) {
	rows, err := s.pool.Query(ctx, "SELECT "+proxyColumns+
		" FROM health.proxy_health WHERE (proxy_name, proxy_uid) > ($1, $2) ORDER BY proxy_name, proxy_uid LIMIT $3",
		afterName, afterUID, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*healthv1.ProxyHealth
	for rows.Next() {
		h, err := scanProxy(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, h)
	}
	return out, rows.Err()
}

// scanTransition scans transitionColumns, and then extra.
func scanTransition(row pgx.Row, extra ...any) (*healthv1.HealthTransition, error) {
	var t healthv1.HealthTransition
	var latency int64
	var at time.Time
	if err := row.Scan(append([]any{&t.Sequence, &t.ProxyUid, &t.ProxyName, &t.ProviderId, &t.Healthy, &t.Reason, &t.Message, &latency, &at}, extra...)...); err != nil {
		return nil, err
	}
	t.Latency = durationpb.New(time.Duration(latency) * time.Microsecond)
	t.TransitionTime = timestamppb.New(at)
	return &t, nil
}

const transitionColumns = "sequence, proxy_uid, proxy_name, provider_id, healthy, reason, message, latency_us, transition_time"

// TransitionsAfter returns up to limit transitions with a sequence greater
// than after, in order.
func (s *Store) TransitionsAfter(ctx context.Context, after int64, limit int) ([]*healthv1.HealthTransition, error) {
	rows, err := s.pool.Query(ctx, "SELECT "+transitionColumns+
		" FROM health.transitions WHERE sequence > $1 ORDER BY sequence LIMIT $2", after, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*healthv1.HealthTransition
	for rows.Next() {
		t, err := scanTransition(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	return out, rows.Err()
}

// LastSequence is the highest transition sequence stored (0 with none).
func (s *Store) LastSequence(ctx context.Context) (int64, error) {
	var seq int64
	err := s.pool.QueryRow(ctx, "SELECT COALESCE(max(sequence), 0) FROM health.transitions").Scan(&seq)
	return seq, err
}

// PrunedThrough is the highest sequence retention has removed.
func (s *Store) PrunedThrough(ctx context.Context) (int64, error) {
	var seq int64
	err := s.pool.QueryRow(ctx, "SELECT pruned_through FROM health.retention").Scan(&seq)
	return seq, err
}

// PruneTransitions removes published transitions older than before and
// returns how many went.
func (s *Store) PruneTransitions(ctx context.Context, before time.Time) (int64, error) {
	var n, top int64
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `WITH gone AS (
				DELETE FROM health.transitions WHERE transition_time < $1 AND published RETURNING sequence)
			SELECT count(*), COALESCE(max(sequence), 0) FROM gone`, before).Scan(&n, &top); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "UPDATE health.retention SET pruned_through = GREATEST(pruned_through, $1)", top)
		return err
	})
	return n, err
}

// PublishPending hands the oldest unpublished transitions (at most limit)
// to publish, in sequence order, and marks them published when it returns
// nil (with an error none is marked: they are handed over again later, and
// the stream drops what it already took by message id). Rows another
// replica is publishing are skipped, and so is a proxy's transition while
// an older one of the same proxy is still pending: a page holds at most
// one transition of each proxy, so publish may send the page's events
// concurrently and each proxy's still go out in order. more reports that
// another call may find some now: the page was full, or a proxy of the
// page has a later transition pending.
func (s *Store) PublishPending(ctx context.Context, limit int, publish func([]*healthv1.HealthTransition) error) (n int, more bool, err error) {
	var pubErr error
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		n, more = 0, false
		rows, err := tx.Query(ctx, "SELECT "+transitionColumns+`, EXISTS (
				SELECT 1 FROM health.transitions l WHERE l.proxy_uid = t.proxy_uid AND l.sequence > t.sequence AND NOT l.published)
			FROM health.transitions t
			WHERE NOT published AND NOT EXISTS (
				SELECT 1 FROM health.transitions o WHERE NOT o.published AND o.proxy_uid = t.proxy_uid AND o.sequence < t.sequence)
			ORDER BY sequence LIMIT $1 FOR UPDATE SKIP LOCKED`, limit)
		if err != nil {
			return err
		}
		var pending []*healthv1.HealthTransition
		var later bool
		for rows.Next() {
			t, err := scanTransition(rows, &later)
			if err != nil {
				rows.Close()
				return err
			}
			pending = append(pending, t)
			more = more || later
		}
		rows.Close()
		if err := rows.Err(); err != nil || len(pending) == 0 {
			return err
		}
		if pubErr = publish(pending); pubErr != nil {
			return nil
		}
		seqs := make([]int64, len(pending))
		for i, t := range pending {
			seqs[i] = t.GetSequence()
		}
		if _, err := tx.Exec(ctx, "UPDATE health.transitions SET published = true WHERE sequence = ANY($1)", seqs); err != nil {
			return err
		}
		n, more = len(pending), more || len(pending) == limit
		return nil
	})
	if err != nil {
		// The marks were rolled back: those events go out again, which
		// JetStream drops as duplicates by message id.
		return 0, false, err
	}
	if pubErr != nil {
		return 0, false, pubErr
	}
	return n, more, nil
}

// SaveProvider upserts a provider's latest check.
func (s *Store) SaveProvider(ctx context.Context, h *healthv1.ProviderHealth) error {
	targets, err := json.Marshal(targetsToJSON(h.GetTargets()))
	if err != nil {
		return err
	}
	_, err = s.pool.Exec(ctx, `INSERT INTO health.provider_health
		(provider, type, readiness, reason, targets, targets_ready, last_check_time, message, readiness_transition_time)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
		ON CONFLICT (provider) DO UPDATE SET type = EXCLUDED.type, readiness = EXCLUDED.readiness,
		 reason = EXCLUDED.reason, targets = EXCLUDED.targets, targets_ready = EXCLUDED.targets_ready,
		 last_check_time = EXCLUDED.last_check_time, message = EXCLUDED.message,
		 readiness_transition_time = EXCLUDED.readiness_transition_time`,
		h.GetProvider(), h.GetType(), int32(h.GetReadiness()), h.GetReason(), targets, h.GetTargetsReady(), h.GetLastCheckTime().AsTime(),
		h.GetMessage(), nullTimestamp(h.GetReadinessTransitionTime()))
	if err != nil {
		return fmt.Errorf("saving provider health of %s: %w", h.GetProvider(), err)
	}
	return nil
}

// DeleteProvidersExcept removes the providers not in keep and returns
// their names.
func (s *Store) DeleteProvidersExcept(ctx context.Context, keep []string) ([]string, error) {
	if keep == nil {
		keep = []string{}
	}
	rows, err := s.pool.Query(ctx, "DELETE FROM health.provider_health WHERE NOT provider = ANY($1) RETURNING provider", keep)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// Providers returns every stored provider's health by name.
func (s *Store) Providers(ctx context.Context) (map[string]*healthv1.ProviderHealth, error) {
	rows, err := s.pool.Query(ctx, `SELECT provider, type, readiness, reason, targets, targets_ready, last_check_time,
		message, readiness_transition_time FROM health.provider_health`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]*healthv1.ProviderHealth{}
	for rows.Next() {
		var h healthv1.ProviderHealth
		var readiness int32
		var targets []byte
		var at time.Time
		var changed *time.Time
		if err := rows.Scan(&h.Provider, &h.Type, &readiness, &h.Reason, &targets, &h.TargetsReady, &at, &h.Message, &changed); err != nil {
			return nil, err
		}
		h.Readiness = healthv1.ProviderReadiness(readiness)
		h.LastCheckTime = timestamppb.New(at)
		if changed != nil {
			h.ReadinessTransitionTime = timestamppb.New(*changed)
		}
		var ts []targetJSON
		if err := json.Unmarshal(targets, &ts); err != nil {
			return nil, fmt.Errorf("provider %s targets: %w", h.Provider, err)
		}
		h.Targets = targetsFromJSON(ts)
		out[h.Provider] = &h
	}
	return out, rows.Err()
}

type targetJSON struct {
	Name               string            `json:"name"`
	Address            string            `json:"address,omitempty"`
	Ready              bool              `json:"ready"`
	Reason             string            `json:"reason,omitempty"`
	Message            string            `json:"message,omitempty"`
	LatencyUS          int64             `json:"latencyUs"`
	LastTransitionTime time.Time         `json:"lastTransitionTime"`
	Details            map[string]string `json:"details,omitempty"`
}

func targetsToJSON(ts []*healthv1.ProviderTarget) []targetJSON {
	out := make([]targetJSON, 0, len(ts))
	for _, t := range ts {
		out = append(out, targetJSON{Name: t.GetName(), Address: t.GetAddress(), Ready: t.GetReady(), Reason: t.GetReason(),
			Message: t.GetMessage(), LatencyUS: t.GetLatency().AsDuration().Microseconds(),
			LastTransitionTime: t.GetLastTransitionTime().AsTime(), Details: t.GetDetails()})
	}
	return out
}

func targetsFromJSON(ts []targetJSON) []*healthv1.ProviderTarget {
	out := make([]*healthv1.ProviderTarget, 0, len(ts))
	for _, t := range ts {
		out = append(out, &healthv1.ProviderTarget{Name: t.Name, Address: t.Address, Ready: t.Ready, Reason: t.Reason,
			Message: t.Message, Latency: durationpb.New(time.Duration(t.LatencyUS) * time.Microsecond),
			LastTransitionTime: timestamppb.New(t.LastTransitionTime), Details: t.Details})
	}
	return out
}
