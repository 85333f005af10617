// Package store keeps the orchestrator's state in PostgreSQL (schema
// orchestrator): one row per proxy (a lifecycle.Proxy: its desired state,
// its observed status, its place in the reconcile queue and its in-flight
// command), the pools, and the change logs that feed Watch and the
// ProxyEvent outbox. It persists what it is given and decides nothing: the
// rules that change a proxy are in package lifecycle.
//
// Every write goes through Write, which stamps each changed proxy with a
// revision taken from a counter row as the transaction's last step; the row
// lock on the counter makes revisions visible in commit order.
package store

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/proto"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/atrest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations are the schema's goose migrations.
func Migrations() fs.FS { return postgres.MigrationsDir(migrationFiles) }

// Schema is the orchestrator's PostgreSQL schema.
const Schema = "orchestrator"

// Migrate applies the migrations to the database at dsn.
func Migrate(ctx context.Context, dsn string, log *slog.Logger) error {
	return postgres.Migrate(ctx, dsn, Schema, Migrations(), log)
}

// Notification channels.
const (
	// WorkChannel is notified when a proxy became due for reconcile.
	WorkChannel = "orchestrator_work"
	// ChangesChannel is notified with the last revision of a committed write.
	ChangesChannel = "orchestrator_changes"
)

// Errors the store reports.
var (
	ErrNotFound = errors.New("proxy not found")
	ErrExists   = errors.New("proxy already exists")
	// ErrNoKeyring: cloud-init to encrypt or decrypt, and no keyring.
	ErrNoKeyring = errors.New("no cloud-init keyring is configured (--cloud-init-key-file)")
)

// Store is the orchestrator's database.
type Store struct {
	pool *pgxpool.Pool
	now  func() time.Time
	keys func() *atrest.Keyring // nil: no keyring
}

// Option configures a Store.
type Option func(*Store)

// WithKeyring encrypts cloud-init at rest with keys; without it a proxy
// with cloud-init can be neither written nor read (ErrNoKeyring).
func WithKeyring(keys *atrest.Keyring) Option {
	return func(s *Store) { s.keys = func() *atrest.Keyring { return keys } }
}

// WithKeyringFrom encrypts cloud-init at rest with the keyring current
// returns, asked on every read and at the start of every write, so a
// keyring reloaded while the service runs is in use at once (one write
// uses one keyring throughout).
func WithKeyringFrom(current func() *atrest.Keyring) Option {
	return func(s *Store) { s.keys = current }
}

// keyring is the keyring in use now; nil without one.
func (s *Store) keyring() *atrest.Keyring {
	if s.keys == nil {
		return nil
	}
	return s.keys()
}

// New wraps a pool.
func New(pool *pgxpool.Pool, opts ...Option) *Store {
	s := &Store{pool: pool, now: time.Now}
	for _, o := range opts {
		o(s)
	}
	return s
}

// Pool is the underlying pool.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

const columns = `uid, name, labels, spec, mode, provider, spec_hash, skip_cleanup, generation, revision,
	create_time, update_time, delete_time, phase, provider_id, ip, port, healthy, reason, message,
	instance_spec_hash, failed_spec_hash, observed_generation, phase_transition_time, health_transition_time,
	probe_latency_us, health_sequence, next_attempt_time, attempts, command_id, command_step,
	command_spec_hash, command_deadline, command_issue_time, stopped_since, trace_parent, cloud_init, cloud_init_key,
	pool, drain_time, drain_deadline, credentials, credentials_key, credentials_time, credentials_stale`

// scanRows reads every row of rows (columns) and closes it.
func scanRows(keys *atrest.Keyring, rows pgx.Rows) ([]*lifecycle.Proxy, error) {
	defer rows.Close()
	var out []*lifecycle.Proxy
	for rows.Next() {
		r, err := scanRow(keys, rows)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

func scanRow(keys *atrest.Keyring, row pgx.Row) (*lifecycle.Proxy, error) {
	var (
		r          lifecycle.Proxy
		labels     []byte
		spec       []byte
		sealed     []byte
		keyID      *string
		mode       int16
		phase      int16
		port       int32
		latencyUS  int64
		cmdID      *string
		step       int16
		reason     string
		credSealed []byte
		credKey    string
		credTime   *time.Time
	)
	err := row.Scan(&r.UID, &r.Name, &labels, &spec, &mode, new(string), &r.SpecHash, &r.SkipCleanup,
		&r.Generation, &r.Revision, &r.CreateTime, &r.UpdateTime, &r.DeleteTime, &phase, &r.ProviderID,
		&r.IP, &port, &r.Healthy, &reason, &r.Message, &r.InstanceSpecHash, &r.FailedSpecHash,
		&r.ObservedGeneration, &r.PhaseTransitionTime, &r.HealthTransitionTime, &latencyUS,
		&r.HealthSequence, &r.NextAttemptTime, &r.Attempts, &cmdID, &step, &r.CommandSpecHash,
		&r.CommandDeadline, &r.CommandIssueTime, &r.StoppedSince, &r.TraceParent, &sealed, &keyID,
		&r.Pool, &r.DrainTime, &r.DrainDeadline, &credSealed, &credKey, &credTime, &r.CredentialsStale)
	if err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, ErrNotFound
		}
		return nil, err
	}
	r.Phase = proxyv1.ProxyPhase(phase)
	r.Port = uint32(port)
	r.ProbeLatency = time.Duration(latencyUS) * time.Microsecond
	r.CommandStep = lifecycle.Step(step)
	r.Reason = lifecycle.Reason(reason)
	if cmdID != nil {
		r.CommandID = *cmdID
	}
	if err := json.Unmarshal(labels, &r.Labels); err != nil {
		return nil, fmt.Errorf("labels of %s: %w", r.Name, err)
	}
	r.Spec = &proxyv1.ProxySpec{}
	if err := proto.Unmarshal(spec, r.Spec); err != nil {
		return nil, fmt.Errorf("spec of %s: %w", r.Name, err)
	}
	// keyID NULL: a row from before encryption at rest, its cloud-init
	// still inside spec until ReencryptCloudInit.
	if keyID != nil && *keyID != "" {
		if keys == nil {
			return nil, fmt.Errorf("cloud-init of proxy %s is encrypted with key %q: %w", r.String(), *keyID, ErrNoKeyring)
		}
		plain, err := keys.Open(sealed, *keyID, r.UID)
		if err != nil {
			return nil, fmt.Errorf("cloud-init of proxy %s: %w", r.String(), err)
		}
		r.Spec.CloudInit = string(plain)
	}
	if credKey != "" {
		if r.Credentials, err = openCredentials(keys, credSealed, credKey, credTime, &r); err != nil {
			return nil, err
		}
	}
	return &r, nil
}

// Get reads one proxy by name.
func (s *Store) Get(ctx context.Context, name string) (*lifecycle.Proxy, error) {
	return scanRow(s.keyring(), s.pool.QueryRow(ctx, "SELECT "+columns+" FROM orchestrator.proxies WHERE name = $1", name))
}

// GetByUID reads one proxy by UID.
func (s *Store) GetByUID(ctx context.Context, uid string) (*lifecycle.Proxy, error) {
	return scanRow(s.keyring(), s.pool.QueryRow(ctx, "SELECT "+columns+" FROM orchestrator.proxies WHERE uid = $1", uid))
}

// Filter narrows List.
type Filter struct {
	Provider string
	Phase    proxyv1.ProxyPhase
	Labels   map[string]string
	// After is the name to continue after (exclusive); empty starts at the
	// beginning.
	After string
	Limit int
}

// List returns proxies in name order, and the current revision.
func (s *Store) List(ctx context.Context, f Filter) ([]*lifecycle.Proxy, int64, error) {
	q := "SELECT " + columns + " FROM orchestrator.proxies WHERE name > $1"
	args := []any{f.After}
	if f.Provider != "" {
		args = append(args, f.Provider)
		q += fmt.Sprintf(" AND provider = $%d", len(args))
	}
	if f.Phase != proxyv1.ProxyPhase_PROXY_PHASE_UNSPECIFIED {
		args = append(args, int16(f.Phase))
		q += fmt.Sprintf(" AND phase = $%d", len(args))
	}
	if len(f.Labels) > 0 {
		b, _ := json.Marshal(f.Labels)
		args = append(args, b)
		q += fmt.Sprintf(" AND labels @> $%d::jsonb", len(args))
	}
	args = append(args, f.Limit)
	q += fmt.Sprintf(" ORDER BY name LIMIT $%d", len(args))

	var rows []*lifecycle.Proxy
	var rev int64
	// One repeatable-read snapshot for the page and the revision, so a
	// client that watches from rev misses nothing the page did not show.
	err := pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, "SELECT value FROM orchestrator.revision").Scan(&rev); err != nil {
			return err
		}
		res, err := tx.Query(ctx, q, args...)
		if err != nil {
			return err
		}
		rows, err = scanRows(s.keyring(), res)
		return err
	})
	return rows, rev, err
}

// Change is one entry of the change log.
type Change struct {
	Revision int64
	Type     proxyv1.ChangeType
	Proxy    *proxyv1.Proxy
	Time     time.Time
}

// ErrCompacted reports a watch from a revision older than the retained log.
var ErrCompacted = errors.New("revision is older than the retained change log")

// Changes returns up to limit changes after revision since, in order. It
// fails with ErrCompacted when changes after since were already pruned.
func (s *Store) Changes(ctx context.Context, since int64, limit int) ([]Change, error) {
	entries, err := readLog(ctx, s.pool, "orchestrator.changes", since, limit)
	if err != nil {
		return nil, err
	}
	out := make([]Change, len(entries))
	for i, e := range entries {
		out[i] = Change{Revision: e.Revision, Type: e.Type, Proxy: &proxyv1.Proxy{}, Time: e.Time}
		if err := proto.Unmarshal(e.Snapshot, out[i].Proxy); err != nil {
			return nil, fmt.Errorf("change %d: %w", e.Revision, err)
		}
	}
	return out, nil
}

// EncodedChange is one entry of the change log with its snapshot as
// stored: a proxyv1.Proxy's encoding, for a reader that forwards it
// without looking inside (the ProxyEvent outbox).
type EncodedChange struct {
	Revision int64
	Type     proxyv1.ChangeType
	UID      string
	Snapshot []byte
	Time     time.Time
}

// EncodedChanges is Changes with the snapshots left encoded.
func (s *Store) EncodedChanges(ctx context.Context, since int64, limit int) ([]EncodedChange, error) {
	return readLog(ctx, s.pool, "orchestrator.changes", since, limit)
}

// ChangesOf returns up to limit retained changes of the proxy uid with a
// revision below before (0: from the newest), newest first.
func (s *Store) ChangesOf(ctx context.Context, uid string, before int64, limit int) ([]Change, error) {
	if before <= 0 {
		before = math.MaxInt64
	}
	rows, err := s.pool.Query(ctx, `SELECT revision, change_type, snapshot, change_time FROM orchestrator.changes
		WHERE uid = $1::uuid AND revision < $2 ORDER BY revision DESC LIMIT $3`, uid, before, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Change
	for rows.Next() {
		var c Change
		var typ int16
		var snap []byte
		if err := rows.Scan(&c.Revision, &typ, &snap, &c.Time); err != nil {
			return nil, err
		}
		c.Type = proxyv1.ChangeType(typ)
		c.Proxy = &proxyv1.Proxy{}
		if err := proto.Unmarshal(snap, c.Proxy); err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// readLog reads up to limit entries after since from a change log table
// (proxies' or pools'), in revision order; ErrCompacted when entries after
// since were pruned. One statement, so one snapshot and one round trip:
// the oldest retained revision beside the entries (a row without an
// entry when there are none).
func readLog(ctx context.Context, pool *pgxpool.Pool, table string, since int64, limit int) ([]EncodedChange, error) {
	rows, err := pool.Query(ctx, `SELECT o.oldest, c.revision, c.change_type, c.uid, c.snapshot, c.change_time
		FROM (SELECT min(revision) AS oldest FROM `+table+`) o
		LEFT JOIN LATERAL (SELECT revision, change_type, uid, snapshot, change_time FROM `+table+`
			WHERE revision > $1 ORDER BY revision LIMIT $2) c ON true
		ORDER BY c.revision`, since, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []EncodedChange
	for rows.Next() {
		var (
			oldest, revision pgtype.Int8
			typ              pgtype.Int2
			uid              pgtype.Text
			e                EncodedChange
			at               pgtype.Timestamptz
		)
		if err := rows.Scan(&oldest, &revision, &typ, &uid, &e.Snapshot, &at); err != nil {
			return nil, err
		}
		// Revisions are contiguous (each one allocated by a committed
		// write), so a first retained revision past since+1 means the
		// changes in between were pruned.
		if oldest.Valid && oldest.Int64 > since+1 {
			return nil, ErrCompacted
		}
		if !revision.Valid {
			break
		}
		e.Revision, e.Type, e.UID, e.Time = revision.Int64, proxyv1.ChangeType(typ.Int16), uid.String, at.Time
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return out, nil
}

// Published returns up to limit proxies in UID order after afterUID whose
// latest change is at revision upTo or older: those whose current state
// the ProxyEvent publisher has already sent.
func (s *Store) Published(ctx context.Context, afterUID string, upTo int64, limit int) ([]*lifecycle.Proxy, error) {
	if afterUID == "" {
		afterUID = "00000000-0000-0000-0000-000000000000"
	}
	rows, err := s.pool.Query(ctx, "SELECT "+columns+` FROM orchestrator.proxies
		WHERE uid > $1::uuid AND revision <= $2 ORDER BY uid LIMIT $3`, afterUID, upTo, limit)
	if err != nil {
		return nil, err
	}
	return scanRows(s.keyring(), rows)
}

// Revision is the latest committed revision.
func (s *Store) Revision(ctx context.Context) (int64, error) {
	var rev int64
	err := s.pool.QueryRow(ctx, "SELECT value FROM orchestrator.revision").Scan(&rev)
	return rev, err
}

// PruneChanges deletes changes older than retention that the ProxyEvent
// outbox has published, always keeping the newest one so the log never
// looks empty to a watcher. It returns how many it deleted.
func (s *Store) PruneChanges(ctx context.Context, retention time.Duration) (int64, error) {
	tag, err := s.pool.Exec(ctx, `DELETE FROM orchestrator.changes
		WHERE change_time < now() - $1::interval
		  AND revision < (SELECT max(revision) FROM orchestrator.changes)
		  AND revision <= (SELECT revision FROM orchestrator.event_cursor)`, retention)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}
