package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
)

// LeaseFilter narrows ListLeases; empty fields match everything.
type LeaseFilter struct {
	ClientID   string
	Pool       string
	TargetHost string
	ProxyName  string
	SessionKey string
}

// ListLeases returns up to limit active leases matching f, oldest first,
// starting after the lease afterID ("" for the first page). Lease ids are
// version 7 UUIDs, so id order is acquisition order.
func (s *Store) ListLeases(ctx context.Context, f LeaseFilter, afterID string, limit int) ([]Lease, error) {
	now := s.cfg.Now().UTC()
	after := pgtype.UUID{Valid: true} // the nil UUID precedes every id
	if afterID != "" {
		after = parseLeaseID(afterID)
	}
	rows, err := s.pool.Query(ctx, `
		SELECT l.id::text, l.client_id, l.proxy_uid, p.name, p.host, p.port, p.pool, l.target_host, l.acquire_time, l.expire_time,
		       l.session_key
		FROM lease.leases l JOIN lease.proxies p ON p.uid = l.proxy_uid
		WHERE l.end_reason IS NULL AND l.expire_time > $1 AND l.id > $2
		  AND ($3 = '' OR l.client_id = $3)
		  AND ($4 = '' OR p.pool = $4)
		  AND ($5 = '' OR l.target_host = $5)
		  AND ($6 = '' OR p.name = $6)
		  AND ($8 = '' OR l.session_key = $8)
		ORDER BY l.id LIMIT $7`, now, after, f.ClientID, f.Pool, f.TargetHost, f.ProxyName, limit, f.SessionKey)
	if err != nil {
		return nil, fmt.Errorf("listing leases: %w", err)
	}
	defer rows.Close()
	var out []Lease
	for rows.Next() {
		var l Lease
		var port int32
		if err := rows.Scan(&l.ID, &l.ClientID, &l.ProxyUID, &l.ProxyName, &l.Host, &port, &l.Pool, &l.TargetHost,
			&l.AcquireTime, &l.ExpireTime, &l.SessionKey); err != nil {
			return nil, fmt.Errorf("listing leases: %w", err)
		}
		l.Port = uint32(port)
		out = append(out, l)
	}
	return out, rows.Err()
}

// ProxyCooldown is a cooldown in force with its proxy's name and pool.
type ProxyCooldown struct {
	Cooldown
	ProxyName string
	Pool      string
}

// CooldownCursor is where a page of ListCooldowns ended.
type CooldownCursor struct {
	ProxyName, ProxyUID, TargetHost string
}

// ListCooldowns returns up to limit cooldowns in force on proxies not
// deleted, by proxy name, uid and target (global first), after the cursor
// (the zero cursor for the first page); proxyName and pool filter when
// set.
func (s *Store) ListCooldowns(ctx context.Context, proxyName, pool string, after CooldownCursor, limit int) ([]ProxyCooldown, error) {
	rows, err := s.pool.Query(ctx, `
		SELECT c.proxy_uid, p.name, p.pool, c.target_host, c.expire_time, c.outcome
		FROM lease.cooldowns c JOIN lease.proxies p ON p.uid = c.proxy_uid AND NOT p.deleted
		WHERE c.expire_time > $1
		  AND ($2 = '' OR p.name = $2)
		  AND ($3 = '' OR p.pool = $3)
		  AND (p.name, c.proxy_uid, c.target_host) > ($4, $5, $6)
		ORDER BY p.name, c.proxy_uid, c.target_host LIMIT $7`,
		s.cfg.Now().UTC(), proxyName, pool, after.ProxyName, after.ProxyUID, after.TargetHost, limit)
	if err != nil {
		return nil, fmt.Errorf("listing cooldowns: %w", err)
	}
	defer rows.Close()
	var out []ProxyCooldown
	for rows.Next() {
		var c ProxyCooldown
		if err := rows.Scan(&c.ProxyUID, &c.ProxyName, &c.Pool, &c.TargetHost, &c.ExpireTime, &c.Outcome); err != nil {
			return nil, fmt.Errorf("listing cooldowns: %w", err)
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// ChangeType says what happened to a lease.
type ChangeType int

// The changes a store reports to Config.OnChange.
const (
	Acquired ChangeType = iota + 1
	Renewed
	Released
	Expired
	Reported
)

// Change is one committed change of a lease. For Released, Expired and
// Reported only the lease's ID, ClientID and ProxyUID are certain.
type Change struct {
	Type     ChangeType
	Lease    Lease
	Cooldown *Cooldown // Reported: the cooldown it started, if any
	Time     time.Time
}

// changed tells Config.OnChange, if set.
func (s *Store) changed(cs []Change) {
	if s.cfg.OnChange != nil && len(cs) > 0 {
		s.cfg.OnChange(cs)
	}
}
