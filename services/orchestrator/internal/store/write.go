package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/atrest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
)

// Tx is a writing transaction. Rows are locked as they are read; the
// changes are written, stamped with revisions, when the function given to
// Write returns.
type Tx struct {
	tx      pgx.Tx
	keys    *atrest.Keyring
	now     time.Time
	pending []pendingChange
	// read holds what a client could see of each row as it was locked, so
	// a write that changes none of it keeps its revision (see flush).
	read map[string]readState
}

type readState struct {
	visible    *proxyv1.Proxy
	revision   int64
	updateTime time.Time
}

// locked remembers rows as read, for the no-op check in flush.
func (t *Tx) locked(rows ...*lifecycle.Proxy) {
	if t.read == nil {
		t.read = make(map[string]readState, len(rows))
	}
	for _, r := range rows {
		// Proto builds a message of its own (the spec and timestamps
		// copied) but for the labels, which it shares with r.
		visible := r.Proto(true)
		visible.Labels = maps.Clone(visible.Labels)
		t.read[r.UID] = readState{visible: visible, revision: r.Revision, updateTime: r.UpdateTime}
	}
}

// unchanged reports whether r, about to be updated, shows a client nothing
// new since it was locked (only the queue and the in-flight command, which
// the API does not show, may differ).
func (t *Tx) unchanged(r *lifecycle.Proxy) (readState, bool) {
	was, ok := t.read[r.UID]
	if !ok {
		return readState{}, false
	}
	now := r.Proto(true)
	now.Etag, now.Revision, now.UpdateTime = was.visible.GetEtag(), was.visible.GetRevision(), was.visible.GetUpdateTime()
	return was, proto.Equal(now, was.visible)
}

type pendingChange struct {
	row *lifecycle.Proxy
	typ proxyv1.ChangeType
}

// Now is the transaction's clock reading, used for every timestamp it
// writes.
func (t *Tx) Now() time.Time { return t.now }

// Write runs fn in a transaction and commits what it changed. A
// serialization failure or deadlock reruns fn, up to five times.
func (s *Store) Write(ctx context.Context, fn func(*Tx) error) error {
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			t := &Tx{tx: tx, keys: s.keyring(), now: s.now().UTC().Truncate(time.Microsecond)}
			if err := fn(t); err != nil {
				return err
			}
			return t.flush(ctx)
		})
		if !postgres.Retryable(err) {
			return err
		}
	}
	return err
}

// Lock reads a proxy by UID and locks it until the transaction ends.
func (t *Tx) Lock(ctx context.Context, uid string) (*lifecycle.Proxy, error) {
	r, err := scanRow(t.keys, t.tx.QueryRow(ctx, "SELECT "+columns+" FROM orchestrator.proxies WHERE uid = $1 FOR UPDATE", uid))
	if err == nil {
		t.locked(r)
	}
	return r, err
}

// LockByName reads a proxy by name and locks it until the transaction ends.
func (t *Tx) LockByName(ctx context.Context, name string) (*lifecycle.Proxy, error) {
	r, err := scanRow(t.keys, t.tx.QueryRow(ctx, "SELECT "+columns+" FROM orchestrator.proxies WHERE name = $1 FOR UPDATE", name))
	if err == nil {
		t.locked(r)
	}
	return r, err
}

// LockMany reads the proxies of uids that exist, by UID, and locks them
// until the transaction ends. One query for them all, locking in UID
// order, so concurrent transactions locking overlapping sets cannot
// deadlock.
func (t *Tx) LockMany(ctx context.Context, uids []string) (map[string]*lifecycle.Proxy, error) {
	return t.lockAll(ctx, "uid = ANY($1::uuid[]) ORDER BY uid", uids, func(r *lifecycle.Proxy) string { return r.UID })
}

// LockByNames reads the proxies of names that exist, by name, and locks
// them until the transaction ends, in one query, in name order.
func (t *Tx) LockByNames(ctx context.Context, names []string) (map[string]*lifecycle.Proxy, error) {
	return t.lockAll(ctx, "name = ANY($1::text[]) ORDER BY name", names, func(r *lifecycle.Proxy) string { return r.Name })
}

// plannedPerCall runs a statement as an unnamed prepared statement, so
// PostgreSQL plans it for its arguments and the table as it is at the
// call. A statement over an array of keys (= ANY($1)) prepared once per
// connection gets, after five runs, a generic plan that never changes
// until the table is analyzed; one made while the table was small (a new
// installation, a test database, a table growing faster than autovacuum
// analyzes it) scans the whole table for each batch: 43-95 ms a batch at
// 40,000 proxies (EXPLAIN ANALYZE, docs/benchmarks/scale.md run 10),
// against well under a millisecond through the index.
const plannedPerCall = pgx.QueryExecModeCacheDescribe

func (t *Tx) lockAll(ctx context.Context, where string, keys []string, key func(*lifecycle.Proxy) string) (map[string]*lifecycle.Proxy, error) {
	out := make(map[string]*lifecycle.Proxy, len(keys))
	if len(keys) == 0 {
		return out, nil
	}
	rows, err := t.tx.Query(ctx, "SELECT "+columns+" FROM orchestrator.proxies WHERE "+where+" FOR UPDATE", plannedPerCall, keys)
	if err != nil {
		return nil, err
	}
	found, err := scanRows(t.keys, rows)
	if err != nil {
		return nil, err
	}
	t.locked(found...)
	for _, r := range found {
		out[key(r)] = r
	}
	return out, nil
}

// ClaimDue locks up to limit proxies whose reconcile is due, skipping rows
// another transaction holds, so replicas share the queue without taking the
// same proxy twice.
func (t *Tx) ClaimDue(ctx context.Context, limit int) ([]*lifecycle.Proxy, error) {
	rows, err := t.tx.Query(ctx, "SELECT "+columns+` FROM orchestrator.proxies
		WHERE next_attempt_time <= $1
		ORDER BY next_attempt_time
		LIMIT $2
		FOR UPDATE SKIP LOCKED`, t.now, limit)
	if err != nil {
		return nil, err
	}
	out, err := scanRows(t.keys, rows)
	if err == nil {
		t.locked(out...)
	}
	return out, err
}

// Known reports which of uids belong to a stored proxy.
func (t *Tx) Known(ctx context.Context, uids []string) (map[string]bool, error) {
	rows, err := t.tx.Query(ctx, "SELECT uid::text FROM orchestrator.proxies WHERE uid = ANY($1::uuid[])", plannedPerCall, uids)
	if err != nil {
		return nil, err
	}
	known, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	out := make(map[string]bool, len(known))
	for _, u := range known {
		out[u] = true
	}
	return out, nil
}

// Insert stores a new proxy. A name that exists fails with ErrExists when
// the transaction commits. An Update of the same proxy (another
// *lifecycle.Proxy of its UID) later in the transaction is logged as the
// next change, and the row is written once, as updated.
func (t *Tx) Insert(r *lifecycle.Proxy) {
	t.pending = append(t.pending, pendingChange{row: r, typ: proxyv1.ChangeType_CHANGE_TYPE_CREATED})
}

// Update stores the changed row.
func (t *Tx) Update(r *lifecycle.Proxy) {
	t.pending = append(t.pending, pendingChange{row: r, typ: proxyv1.ChangeType_CHANGE_TYPE_UPDATED})
}

// Delete removes the proxy; its last state becomes the DELETED change.
func (t *Tx) Delete(r *lifecycle.Proxy) {
	t.pending = append(t.pending, pendingChange{row: r, typ: proxyv1.ChangeType_CHANGE_TYPE_DELETED})
}

// flush writes the pending changes: revisions from the counter (whose row
// lock orders commits), the rows, the change log (one statement for all its
// entries) and the notifications, in one batch.
//
// An update that changes nothing a client can see (a resync that found the
// instance as it was: only the queue and the in-flight command moved) is
// stored under the row's old revision and update time, with no change-log
// entry: no new etag, no Watch change, no ProxyEvent.
func (t *Tx) flush(ctx context.Context) error {
	if len(t.pending) == 0 {
		return nil
	}
	batch := &pgx.Batch{}
	due := false
	var changed []pendingChange
	lastOf := make(map[string]int, len(t.pending))
	for i, p := range t.pending {
		lastOf[p.row.UID] = i
	}
	for i, p := range t.pending {
		r := p.row
		// Only a row's last state is stored: a new proxy decided in its
		// create transaction is not due.
		if lastOf[r.UID] == i && r.NextAttemptTime != nil && !r.NextAttemptTime.After(t.now.Add(time.Second)) {
			due = true
		}
		if p.typ == proxyv1.ChangeType_CHANGE_TYPE_UPDATED {
			if was, same := t.unchanged(r); same {
				r.Revision, r.UpdateTime = was.revision, was.updateTime
				if err := queueUpsert(batch, t.keys, r, false); err != nil {
					return err
				}
				continue
			}
		}
		changed = append(changed, p)
	}
	if len(changed) > 0 {
		var last int64
		if err := t.tx.QueryRow(ctx, "UPDATE orchestrator.revision SET value = value + $1 RETURNING value",
			len(changed)).Scan(&last); err != nil {
			return err
		}
		first := last - int64(len(changed)) + 1
		// A row created and changed again in this transaction (a new
		// proxy and its first decision) is inserted once, as it is last;
		// each of its changes is logged.
		lastChanged := make(map[string]int, len(changed))
		for i, p := range changed {
			lastChanged[p.row.UID] = i
		}
		unwritten := map[string]bool{}
		log := struct {
			revisions []int64
			uids      []string
			types     []int16
			snapshots [][]byte
		}{make([]int64, len(changed)), make([]string, len(changed)), make([]int16, len(changed)), make([][]byte, len(changed))}
		for i, p := range changed {
			r := p.row
			r.Revision = first + int64(i)
			r.UpdateTime = t.now
			switch p.typ {
			case proxyv1.ChangeType_CHANGE_TYPE_CREATED, proxyv1.ChangeType_CHANGE_TYPE_UPDATED:
				insert := p.typ == proxyv1.ChangeType_CHANGE_TYPE_CREATED || unwritten[r.UID]
				if lastChanged[r.UID] != i && insert {
					unwritten[r.UID] = true
					break
				}
				delete(unwritten, r.UID)
				if err := queueUpsert(batch, t.keys, r, insert); err != nil {
					return err
				}
			case proxyv1.ChangeType_CHANGE_TYPE_DELETED:
				batch.Queue("DELETE FROM orchestrator.proxies WHERE uid = $1", r.UID)
			}
			snap, err := proto.Marshal(r.Proto(false))
			if err != nil {
				return err
			}
			log.revisions[i], log.uids[i], log.types[i], log.snapshots[i] = r.Revision, r.UID, int16(p.typ), snap
		}
		// The change log's entries in one statement, in revision order.
		batch.Queue(`INSERT INTO orchestrator.changes (revision, uid, change_type, snapshot, change_time)
			SELECT revision, uid, change_type, snapshot, $5
			FROM unnest($1::bigint[], $2::uuid[], $3::smallint[], $4::bytea[]) AS c(revision, uid, change_type, snapshot)`,
			log.revisions, log.uids, log.types, log.snapshots, t.now)
		batch.Queue("SELECT pg_notify($1, $2)", ChangesChannel, strconv.FormatInt(last, 10))
	}
	if due {
		batch.Queue("SELECT pg_notify($1, '')", WorkChannel)
	}
	err := t.tx.SendBatch(ctx, batch).Close()
	if isUniqueViolation(err) {
		return ErrExists
	}
	return err
}

// sealCloudInit returns the spec as stored (without cloud-init) and the
// cloud-init sealed with the active key for this row.
func sealCloudInit(keys *atrest.Keyring, r *lifecycle.Proxy) (spec, sealed []byte, keyID string, err error) {
	bare := r.Spec
	if ci := r.Spec.GetCloudInit(); ci != "" {
		if keys == nil {
			return nil, nil, "", fmt.Errorf("storing the cloud-init of proxy %s: %w", r.String(), ErrNoKeyring)
		}
		if sealed, keyID, err = keys.Seal([]byte(ci), r.UID); err != nil {
			return nil, nil, "", err
		}
		bare = proto.Clone(r.Spec).(*proxyv1.ProxySpec)
		bare.CloudInit = ""
	}
	spec, err = proto.MarshalOptions{Deterministic: true}.Marshal(bare)
	return spec, sealed, keyID, err
}

func queueUpsert(b *pgx.Batch, keys *atrest.Keyring, r *lifecycle.Proxy, insert bool) error {
	labels, _ := json.Marshal(r.Labels)
	if r.Labels == nil {
		labels = []byte("{}")
	}
	spec, sealed, keyID, err := sealCloudInit(keys, r)
	if err != nil {
		return err
	}
	credSealed, credKey, credTime, err := sealCredentials(keys, r)
	if err != nil {
		return err
	}
	var cmdID *string
	if r.CommandID != "" {
		cmdID = &r.CommandID
	}
	args := []any{r.UID, r.Name, labels, spec, int16(r.Spec.GetMode()), r.Spec.GetProvider(), r.SpecHash,
		r.SkipCleanup, r.Generation, r.Revision, r.CreateTime, r.UpdateTime, r.DeleteTime, int16(r.Phase),
		r.ProviderID, r.IP, int32(r.Port), r.Healthy, string(r.Reason), r.Message, r.InstanceSpecHash,
		r.FailedSpecHash, r.ObservedGeneration, r.PhaseTransitionTime, r.HealthTransitionTime,
		r.ProbeLatency.Microseconds(), r.HealthSequence, r.NextAttemptTime, r.Attempts, cmdID,
		int16(r.CommandStep), r.CommandSpecHash, r.CommandDeadline, r.CommandIssueTime, r.StoppedSince, r.TraceParent,
		sealed, keyID, r.Pool, r.DrainTime, r.DrainDeadline, credSealed, credKey, credTime, r.CredentialsStale}
	if insert {
		b.Queue("INSERT INTO orchestrator.proxies ("+columns+`) VALUES
			($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14,$15,$16,$17,$18,$19,$20,$21,$22,$23,$24,$25,$26,$27,$28,$29,$30,$31,$32,$33,$34,$35,$36,$37,$38,$39,$40,$41,$42,$43,$44,$45)`, args...)
		return nil
	}
	b.Queue(`UPDATE orchestrator.proxies SET name=$2, labels=$3, spec=$4, mode=$5, provider=$6, spec_hash=$7,
		skip_cleanup=$8, generation=$9, revision=$10, create_time=$11, update_time=$12, delete_time=$13,
		phase=$14, provider_id=$15, ip=$16, port=$17, healthy=$18, reason=$19, message=$20,
		instance_spec_hash=$21, failed_spec_hash=$22, observed_generation=$23, phase_transition_time=$24,
		health_transition_time=$25, probe_latency_us=$26, health_sequence=$27, next_attempt_time=$28,
		attempts=$29, command_id=$30, command_step=$31, command_spec_hash=$32, command_deadline=$33,
		command_issue_time=$34, stopped_since=$35, trace_parent=$36, cloud_init=$37, cloud_init_key=$38,
		pool=$39, drain_time=$40, drain_deadline=$41, credentials=$42, credentials_key=$43, credentials_time=$44,
		credentials_stale=$45 WHERE uid=$1`, args...)
	return nil
}

func isUniqueViolation(err error) bool {
	var pgErr interface{ SQLState() string }
	return errors.As(err, &pgErr) && pgErr.SQLState() == "23505"
}
