package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/atrest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
)

// Errors of pools.
var (
	ErrPoolNotFound = errors.New("pool not found")
	ErrPoolExists   = errors.New("pool already exists")
)

// PoolRow is one proxy pool as stored.
type PoolRow struct {
	UID        string
	Name       string
	Labels     map[string]string
	Spec       *proxyv1.ProxyPoolSpec
	Status     *proxyv1.ProxyPoolStatus
	Generation int64
	Revision   int64
	CreateTime time.Time
	UpdateTime time.Time
	DeleteTime *time.Time
	// ScaleHistory is the autoscaler's, written by WriteScaleHistory.
	ScaleHistory ScaleHistory
}

// ScaleHistory is what an autoscaled pool's scale-downs look back on: the
// counts its demand asked for within the scale-down window, kept in the
// pool's row so that whichever replica syncs the pool next has them.
type ScaleHistory struct {
	// Since is when the pool's demand was first recorded: a window that
	// reaches further back is not complete.
	Since time.Time `json:"since,omitzero"`
	// Last is the time of the last demand report recorded.
	Last time.Time `json:"last,omitzero"`
	// Steps, oldest first, each asking for fewer proxies than the one
	// before: the highest count of any part of the window is its first
	// step.
	Steps []ScaleStep `json:"steps,omitempty"`
}

// ScaleStep is the count one demand report asked for.
type ScaleStep struct {
	At   time.Time `json:"at"`
	Want int32     `json:"want"`
}

// Deleting reports whether deletion was requested.
func (p *PoolRow) Deleting() bool { return p.DeleteTime != nil }

// Proto renders the pool for the API; withCloudInit false leaves the
// template's cloud-init out.
func (p *PoolRow) Proto(withCloudInit bool) *proxyv1.ProxyPool {
	spec := proto.Clone(p.Spec).(*proxyv1.ProxyPoolSpec)
	if !withCloudInit && spec.GetTemplate().GetSpec() != nil {
		spec.Template.Spec.CloudInit = ""
	}
	st := p.Status
	if st == nil {
		st = &proxyv1.ProxyPoolStatus{}
	}
	return &proxyv1.ProxyPool{
		Uid:        p.UID,
		Name:       p.Name,
		Labels:     p.Labels,
		CreateTime: ts(&p.CreateTime),
		UpdateTime: ts(&p.UpdateTime),
		DeleteTime: ts(p.DeleteTime),
		Generation: p.Generation,
		Etag:       lifecycle.Etag(p.Revision),
		Spec:       spec,
		Status:     proto.Clone(st).(*proxyv1.ProxyPoolStatus),
	}
}

const poolColumns = `uid, name, labels, spec, cloud_init, cloud_init_key, status, generation, revision,
	create_time, update_time, delete_time`

// poolSelect is what scanPool reads: the columns WritePool writes and the
// scale history.
const poolSelect = poolColumns + ", scale_history"

func scanPool(keys *atrest.Keyring, row pgx.Row) (*PoolRow, error) {
	var (
		p      PoolRow
		labels []byte
		spec   []byte
		sealed []byte
		keyID  string
		status []byte
		hist   []byte
	)
	err := row.Scan(&p.UID, &p.Name, &labels, &spec, &sealed, &keyID, &status, &p.Generation, &p.Revision,
		&p.CreateTime, &p.UpdateTime, &p.DeleteTime, &hist)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrPoolNotFound
	}
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(labels, &p.Labels); err != nil {
		return nil, fmt.Errorf("labels of pool %s: %w", p.Name, err)
	}
	if err := json.Unmarshal(hist, &p.ScaleHistory); err != nil {
		return nil, fmt.Errorf("scale history of pool %s: %w", p.Name, err)
	}
	p.Spec, p.Status = &proxyv1.ProxyPoolSpec{}, &proxyv1.ProxyPoolStatus{}
	if err := proto.Unmarshal(spec, p.Spec); err != nil {
		return nil, fmt.Errorf("spec of pool %s: %w", p.Name, err)
	}
	if err := proto.Unmarshal(status, p.Status); err != nil {
		return nil, fmt.Errorf("status of pool %s: %w", p.Name, err)
	}
	if keyID != "" {
		if keys == nil {
			return nil, fmt.Errorf("template cloud-init of pool %s is encrypted with key %q: %w", p.Name, keyID, ErrNoKeyring)
		}
		plain, err := keys.Open(sealed, keyID, p.UID)
		if err != nil {
			return nil, fmt.Errorf("template cloud-init of pool %s: %w", p.Name, err)
		}
		if p.Spec.Template == nil {
			p.Spec.Template = &proxyv1.ProxyTemplate{}
		}
		if p.Spec.Template.Spec == nil {
			p.Spec.Template.Spec = &proxyv1.ProxySpec{}
		}
		p.Spec.Template.Spec.CloudInit = string(plain)
	}
	return &p, nil
}

func scanPools(keys *atrest.Keyring, rows pgx.Rows) ([]*PoolRow, error) {
	defer rows.Close()
	var out []*PoolRow
	for rows.Next() {
		p, err := scanPool(keys, rows)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, rows.Err()
}

// GetPool reads one pool by name.
func (s *Store) GetPool(ctx context.Context, name string) (*PoolRow, error) {
	return scanPool(s.keyring(), s.pool.QueryRow(ctx, "SELECT "+poolSelect+" FROM orchestrator.pools WHERE name = $1", name))
}

// ListPools returns up to limit pools after name after, in name order, and
// the current pool revision.
func (s *Store) ListPools(ctx context.Context, after string, limit int) ([]*PoolRow, int64, error) {
	var out []*PoolRow
	var rev int64
	err := pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, "SELECT value FROM orchestrator.pool_revision").Scan(&rev); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, "SELECT "+poolSelect+" FROM orchestrator.pools WHERE name > $1 ORDER BY name LIMIT $2", after, limit)
		if err != nil {
			return err
		}
		out, err = scanPools(s.keyring(), rows)
		return err
	})
	return out, rev, err
}

// PoolNames lists every pool's name.
func (s *Store) PoolNames(ctx context.Context) ([]string, error) {
	rows, err := s.pool.Query(ctx, "SELECT name FROM orchestrator.pools ORDER BY name")
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// PoolRevision is the latest committed pool revision.
func (s *Store) PoolRevision(ctx context.Context) (int64, error) {
	var rev int64
	err := s.pool.QueryRow(ctx, "SELECT value FROM orchestrator.pool_revision").Scan(&rev)
	return rev, err
}

// PoolChange is one entry of the pools' change log.
type PoolChange struct {
	Revision int64
	Type     proxyv1.ChangeType
	Pool     *proxyv1.ProxyPool
	Time     time.Time
}

// PoolChanges returns up to limit pool changes after revision since, in
// order; ErrCompacted when changes after since were pruned.
func (s *Store) PoolChanges(ctx context.Context, since int64, limit int) ([]PoolChange, error) {
	entries, err := readLog(ctx, s.pool, "orchestrator.pool_changes", since, limit)
	if err != nil {
		return nil, err
	}
	out := make([]PoolChange, len(entries))
	for i, e := range entries {
		out[i] = PoolChange{Revision: e.Revision, Type: e.Type, Pool: &proxyv1.ProxyPool{}, Time: e.Time}
		if err := proto.Unmarshal(e.Snapshot, out[i].Pool); err != nil {
			return nil, fmt.Errorf("pool change %d: %w", e.Revision, err)
		}
	}
	return out, nil
}

// PrunePoolChanges deletes pool changes older than retention, always
// keeping the newest.
func (s *Store) PrunePoolChanges(ctx context.Context, retention time.Duration) (int64, error) {
	tag, err := s.pool.Exec(ctx, `DELETE FROM orchestrator.pool_changes
		WHERE change_time < now() - $1::interval
		  AND revision < (SELECT max(revision) FROM orchestrator.pool_changes)`, retention)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

// LockPool reads a pool by name and locks it until the transaction ends.
func (t *Tx) LockPool(ctx context.Context, name string) (*PoolRow, error) {
	return scanPool(t.keys, t.tx.QueryRow(ctx, "SELECT "+poolSelect+" FROM orchestrator.pools WHERE name = $1 FOR UPDATE", name))
}

// ClaimPool locks a pool by name unless another transaction holds it
// (ErrPoolNotFound then, as for a pool that does not exist): the pool
// controller's claim, so that one replica at a time works on a pool.
func (t *Tx) ClaimPool(ctx context.Context, name string) (*PoolRow, error) {
	return scanPool(t.keys, t.tx.QueryRow(ctx, "SELECT "+poolSelect+" FROM orchestrator.pools WHERE name = $1 FOR UPDATE SKIP LOCKED", name))
}

// PoolProxies reads the live and deleting proxies a pool owns, without
// locking them.
func (t *Tx) PoolProxies(ctx context.Context, pool string) ([]*lifecycle.Proxy, error) {
	rows, err := t.tx.Query(ctx, "SELECT "+columns+" FROM orchestrator.proxies WHERE pool = $1 ORDER BY name", pool)
	if err != nil {
		return nil, err
	}
	return scanRows(t.keys, rows)
}

// LockIfFree reads a proxy by UID and locks it, unless another transaction
// holds it (ErrNotFound then).
func (t *Tx) LockIfFree(ctx context.Context, uid string) (*lifecycle.Proxy, error) {
	r, err := scanRow(t.keys, t.tx.QueryRow(ctx, "SELECT "+columns+" FROM orchestrator.proxies WHERE uid = $1 FOR UPDATE SKIP LOCKED", uid))
	if err == nil {
		t.locked(r)
	}
	return r, err
}

// WriteScaleHistory stores a pool's scale history: no change of the pool
// (its revision and watchers see nothing), as the history is the
// autoscaler's own.
func (t *Tx) WriteScaleHistory(ctx context.Context, uid string, h ScaleHistory) error {
	raw, err := json.Marshal(h)
	if err != nil {
		return err
	}
	_, err = t.tx.Exec(ctx, "UPDATE orchestrator.pools SET scale_history = $2 WHERE uid = $1", uid, raw)
	return err
}

// WritePool stores a pool change at once (unlike proxies, which are
// written when the transaction's function returns): the row, the change
// log entry under the next pool revision, and a notification.
func (t *Tx) WritePool(ctx context.Context, p *PoolRow, typ proxyv1.ChangeType) error {
	if err := t.tx.QueryRow(ctx, "UPDATE orchestrator.pool_revision SET value = value + 1 RETURNING value").Scan(&p.Revision); err != nil {
		return err
	}
	p.UpdateTime = t.now
	labels, _ := json.Marshal(p.Labels)
	if p.Labels == nil {
		labels = []byte("{}")
	}
	bare := proto.Clone(p.Spec).(*proxyv1.ProxyPoolSpec)
	var sealed []byte
	var keyID string
	if ci := p.Spec.GetTemplate().GetSpec().GetCloudInit(); ci != "" {
		if t.keys == nil {
			return fmt.Errorf("storing the template cloud-init of pool %s: %w", p.Name, ErrNoKeyring)
		}
		var err error
		if sealed, keyID, err = t.keys.Seal([]byte(ci), p.UID); err != nil {
			return err
		}
		bare.Template.Spec.CloudInit = ""
	}
	spec, err := proto.MarshalOptions{Deterministic: true}.Marshal(bare)
	if err != nil {
		return err
	}
	if p.Status == nil {
		p.Status = &proxyv1.ProxyPoolStatus{}
	}
	status, err := proto.MarshalOptions{Deterministic: true}.Marshal(p.Status)
	if err != nil {
		return err
	}
	args := []any{p.UID, p.Name, labels, spec, sealed, keyID, status, p.Generation, p.Revision, p.CreateTime, p.UpdateTime, p.DeleteTime}
	switch typ {
	case proxyv1.ChangeType_CHANGE_TYPE_CREATED:
		_, err = t.tx.Exec(ctx, "INSERT INTO orchestrator.pools ("+poolColumns+") VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12)", args...)
		if isUniqueViolation(err) {
			return ErrPoolExists
		}
	case proxyv1.ChangeType_CHANGE_TYPE_UPDATED:
		_, err = t.tx.Exec(ctx, `UPDATE orchestrator.pools SET name=$2, labels=$3, spec=$4, cloud_init=$5, cloud_init_key=$6,
			status=$7, generation=$8, revision=$9, create_time=$10, update_time=$11, delete_time=$12 WHERE uid=$1`, args...)
	case proxyv1.ChangeType_CHANGE_TYPE_DELETED:
		_, err = t.tx.Exec(ctx, "DELETE FROM orchestrator.pools WHERE uid = $1", p.UID)
	}
	if err != nil {
		return err
	}
	snap, err := proto.Marshal(p.Proto(false))
	if err != nil {
		return err
	}
	if _, err := t.tx.Exec(ctx, `INSERT INTO orchestrator.pool_changes (revision, uid, change_type, snapshot, change_time)
		VALUES ($1, $2, $3, $4, $5)`, p.Revision, p.UID, int16(typ), snap, t.now); err != nil {
		return err
	}
	_, err = t.tx.Exec(ctx, "SELECT pg_notify($1, $2)", ChangesChannel, "p"+strconv.FormatInt(p.Revision, 10))
	return err
}

// DrainingAlone lists the draining proxies that belong to no pool and are
// not being deleted (an admin drained them; no pool controller looks after
// them), from the index of draining proxies. Sequential scans are off for
// it: without statistics on drain_time (a table that has just grown) the
// planner takes nearly every row for draining and reads the whole table,
// after every change.
func (s *Store) DrainingAlone(ctx context.Context) ([]*lifecycle.Proxy, error) {
	var out []*lifecycle.Proxy
	err := pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{BeginQuery: "BEGIN READ ONLY; SET LOCAL enable_seqscan = off"}, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, "SELECT "+columns+` FROM orchestrator.proxies
			WHERE pool = '' AND drain_time IS NOT NULL AND delete_time IS NULL ORDER BY name`)
		if err != nil {
			return err
		}
		out, err = scanRows(s.keyring(), rows)
		return err
	})
	return out, err
}

func ts(t *time.Time) *timestamppb.Timestamp {
	if t == nil {
		return nil
	}
	return timestamppb.New(*t)
}
