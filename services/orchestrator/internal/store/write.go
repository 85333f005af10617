package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
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
		t.read[r.UID] = readState{visible: proto.Clone(r.Proto(true)).(*proxyv1.Proxy), revision: r.Revision, updateTime: r.UpdateTime}
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
	now.Etag, now.UpdateTime = was.visible.GetEtag(), was.visible.GetUpdateTime()
	return was, proto.Equal(now, was.visible)
}

type pendingChange struct {
	row *lifecycle.Proxy
	typ proxyv1.ChangeType
}

// Now is the transaction's clock reading, used for every timestamp it
// writes.
func (t *Tx) Now() time.Time { return t.now }

// beginWrite starts a writing transaction whose statements are planned
// for their arguments on every execution. Prepared statements otherwise
// settle on a generic plan after five runs, chosen for the table as it
// was then: the batched UPDATE's, made while the table was small, joins
// by reading every row (a hash join over a sequential scan) and keeps
// doing so as the table grows. Sent with BEGIN, in the same round trip.
const beginWrite = "BEGIN; SET LOCAL plan_cache_mode = force_custom_plan"

// Write runs fn in a transaction and commits what it changed. A
// serialization failure or deadlock reruns fn, up to five times.
func (s *Store) Write(ctx context.Context, fn func(*Tx) error) error {
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		err = pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{BeginQuery: beginWrite}, func(tx pgx.Tx) error {
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

func (t *Tx) lockAll(ctx context.Context, where string, keys []string, key func(*lifecycle.Proxy) string) (map[string]*lifecycle.Proxy, error) {
	out := make(map[string]*lifecycle.Proxy, len(keys))
	if len(keys) == 0 {
		return out, nil
	}
	rows, err := t.tx.Query(ctx, "SELECT "+columns+" FROM orchestrator.proxies WHERE "+where+" FOR UPDATE", keys)
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
	rows, err := t.tx.Query(ctx, "SELECT uid::text FROM orchestrator.proxies WHERE uid = ANY($1::uuid[])", uids)
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
// the transaction commits.
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
// lock orders commits), the rows, the change log and the notifications, in
// one batch. The rows are written a few statements for the whole
// transaction (see rowWriter), not one per row: the counter's lock is held
// until commit, so the time these statements take bounds every writer's
// throughput.
//
// An update that changes nothing a client can see (a resync that found the
// instance as it was: only the queue and the in-flight command moved) is
// stored under the row's old revision and update time, with no change-log
// entry: no new etag, no Watch change, no ProxyEvent.
func (t *Tx) flush(ctx context.Context) error {
	if len(t.pending) == 0 {
		return nil
	}
	w := &rowWriter{}
	due := false
	// The changed rows' values are made (sealed, encoded) before the
	// counter is taken: only their revision is set under its lock.
	type staged struct {
		pendingChange
		args []any // nil for a delete
	}
	var changed []staged
	for _, p := range t.pending {
		r := p.row
		if r.NextAttemptTime != nil && !r.NextAttemptTime.After(t.now.Add(time.Second)) {
			due = true
		}
		if p.typ == proxyv1.ChangeType_CHANGE_TYPE_UPDATED {
			if was, same := t.unchanged(r); same {
				r.Revision, r.UpdateTime = was.revision, was.updateTime
				args, err := rowArgs(t.keys, r)
				if err != nil {
					return err
				}
				w.upsert(r.UID, args, false)
				continue
			}
		}
		r.UpdateTime = t.now
		c := staged{pendingChange: p}
		if p.typ != proxyv1.ChangeType_CHANGE_TYPE_DELETED {
			var err error
			if c.args, err = rowArgs(t.keys, r); err != nil {
				return err
			}
		}
		changed = append(changed, c)
	}
	var log changeLog
	var last int64
	if len(changed) > 0 {
		if err := t.tx.QueryRow(ctx, "UPDATE orchestrator.revision SET value = value + $1 RETURNING value",
			len(changed)).Scan(&last); err != nil {
			return err
		}
		first := last - int64(len(changed)) + 1
		for i, c := range changed {
			r := c.row
			r.Revision = first + int64(i)
			if c.args == nil {
				w.delete(r.UID)
			} else {
				c.args[revisionColumn] = r.Revision
				w.upsert(r.UID, c.args, c.typ == proxyv1.ChangeType_CHANGE_TYPE_CREATED)
			}
			snap, err := proto.Marshal(r.Proto(false))
			if err != nil {
				return err
			}
			log.add(r.Revision, r.UID, c.typ, snap)
		}
	}
	batch := &pgx.Batch{}
	w.queue(batch)
	if len(changed) > 0 {
		batch.Queue(`INSERT INTO orchestrator.changes (revision, uid, change_type, snapshot, change_time)
			SELECT c.revision, c.uid, c.change_type, c.snapshot, $5
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

// changeLog is the change-log entries of one flush, column by column.
type changeLog struct {
	revisions []int64
	uids      []string
	types     []int16
	snapshots [][]byte
}

func (l *changeLog) add(revision int64, uid string, typ proxyv1.ChangeType, snapshot []byte) {
	l.revisions = append(l.revisions, revision)
	l.uids = append(l.uids, uid)
	l.types = append(l.types, int16(typ))
	l.snapshots = append(l.snapshots, snapshot)
}

// rowWriter collects a transaction's row writes into runs of one kind
// (insert, update or delete), each written by one statement over arrays of
// the rows' columns. A run ends where the kind changes or a row comes back
// (a row written twice in one transaction), so the statements apply in the
// order the writes were made.
type rowWriter struct {
	runs []*rowRun
}

type rowKind int

const (
	insertRows rowKind = iota
	updateRows
	deleteRows
)

type rowRun struct {
	kind rowKind
	seen map[string]bool
	// cols holds each column's values, one per row (deleteRows: uid only).
	cols [][]any
}

func (w *rowWriter) run(kind rowKind, uid string) *rowRun {
	if n := len(w.runs); n > 0 {
		if last := w.runs[n-1]; last.kind == kind && !last.seen[uid] {
			last.seen[uid] = true
			return last
		}
	}
	width := len(columnTypes)
	if kind == deleteRows {
		width = 1
	}
	r := &rowRun{kind: kind, seen: map[string]bool{uid: true}, cols: make([][]any, width)}
	w.runs = append(w.runs, r)
	return r
}

// upsert writes a row given as rowArgs.
func (w *rowWriter) upsert(uid string, args []any, insert bool) {
	kind := updateRows
	if insert {
		kind = insertRows
	}
	run := w.run(kind, uid)
	for i, a := range args {
		run.cols[i] = append(run.cols[i], a)
	}
}

func (w *rowWriter) delete(uid string) {
	run := w.run(deleteRows, uid)
	run.cols[0] = append(run.cols[0], uid)
}

func (w *rowWriter) queue(b *pgx.Batch) {
	for _, run := range w.runs {
		arrays := make([]any, len(run.cols))
		for i, c := range run.cols {
			arrays[i] = c
		}
		switch run.kind {
		case insertRows:
			b.Queue(insertProxies, arrays...)
		case updateRows:
			b.Queue(updateProxies, arrays...)
		case deleteRows:
			b.Queue("DELETE FROM orchestrator.proxies WHERE uid = ANY($1::uuid[])", run.cols[0])
		}
	}
}

// revisionColumn is where revision is among columns (and rowArgs).
const revisionColumn = 9

// columnTypes are the SQL types of columns, in its order.
var columnTypes = []string{"uuid", "text", "jsonb", "bytea", "smallint", "text", "text", "boolean", "bigint", "bigint",
	"timestamptz", "timestamptz", "timestamptz", "smallint", "text", "text", "integer", "boolean", "text", "text",
	"text", "text", "bigint", "timestamptz", "timestamptz",
	"bigint", "bigint", "timestamptz", "integer", "uuid", "smallint",
	"text", "timestamptz", "timestamptz", "timestamptz", "text", "bytea", "text",
	"text", "timestamptz", "timestamptz", "bytea", "text", "timestamptz", "boolean"}

// insertProxies and updateProxies write rows given as one array per
// column (rowArgs' values, column by column).
var insertProxies, updateProxies = func() (string, string) {
	names := strings.Split(columns, ",")
	arrays := make([]string, len(names))
	sets := make([]string, 0, len(names)-1)
	for i, n := range names {
		names[i] = strings.TrimSpace(n)
		arrays[i] = fmt.Sprintf("$%d::%s[]", i+1, columnTypes[i])
		if i > 0 {
			sets = append(sets, names[i]+" = u."+names[i])
		}
	}
	from := "unnest(" + strings.Join(arrays, ", ") + ") AS u(" + strings.Join(names, ", ") + ")"
	return "INSERT INTO orchestrator.proxies (" + columns + ") SELECT * FROM " + from,
		"UPDATE orchestrator.proxies AS p SET " + strings.Join(sets, ", ") + " FROM " + from + " WHERE p.uid = u.uid"
}()

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

// rowArgs are r's values for columns, in its order.
func rowArgs(keys *atrest.Keyring, r *lifecycle.Proxy) ([]any, error) {
	labels, _ := json.Marshal(r.Labels)
	if r.Labels == nil {
		labels = []byte("{}")
	}
	spec, sealed, keyID, err := sealCloudInit(keys, r)
	if err != nil {
		return nil, err
	}
	credSealed, credKey, credTime, err := sealCredentials(keys, r)
	if err != nil {
		return nil, err
	}
	var cmdID *string
	if r.CommandID != "" {
		cmdID = &r.CommandID
	}
	return []any{r.UID, r.Name, labels, spec, int16(r.Spec.GetMode()), r.Spec.GetProvider(), r.SpecHash,
		r.SkipCleanup, r.Generation, r.Revision, r.CreateTime, r.UpdateTime, r.DeleteTime, int16(r.Phase),
		r.ProviderID, r.IP, int32(r.Port), r.Healthy, string(r.Reason), r.Message, r.InstanceSpecHash,
		r.FailedSpecHash, r.ObservedGeneration, r.PhaseTransitionTime, r.HealthTransitionTime,
		r.ProbeLatency.Microseconds(), r.HealthSequence, r.NextAttemptTime, r.Attempts, cmdID,
		int16(r.CommandStep), r.CommandSpecHash, r.CommandDeadline, r.CommandIssueTime, r.StoppedSince, r.TraceParent,
		sealed, keyID, r.Pool, r.DrainTime, r.DrainDeadline, credSealed, credKey, credTime, r.CredentialsStale}, nil
}

func isUniqueViolation(err error) bool {
	var pgErr interface{ SQLState() string }
	return errors.As(err, &pgErr) && pgErr.SQLState() == "23505"
}
