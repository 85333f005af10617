package store

import (
	"context"
	"fmt"
)

// CountRefusal counts an acquire refused for a pool for lack of a proxy.
func (s *Store) CountRefusal(ctx context.Context, pool string) error {
	return retry(ctx, func() error {
		_, err := s.pool.Exec(ctx, `INSERT INTO lease.refusals (pool, refused) VALUES ($1, 1)
			ON CONFLICT (pool) DO UPDATE SET refused = lease.refusals.refused + 1`, pool)
		return err
	})
}

// PoolDemand is the lease demand on one pool's proxies ("" for proxies of
// no pool).
type PoolDemand struct {
	Pool string
	// ActiveLeases held on the pool's proxies.
	ActiveLeases int64
	// Capacity of its leasable proxies; 0 when one of them is unlimited.
	Capacity int64
	// Leasable proxies.
	Leasable int64
	// Refused is the running count of refused acquires (its growth is the
	// demand).
	Refused int64
	// LeasesByProxy counts active leases per proxy UID (only those > 0).
	LeasesByProxy map[string]int32
}

// Demand reads the demand of every pool that has proxies or refusals, and
// of the proxies of no pool.
func (s *Store) Demand(ctx context.Context) (map[string]*PoolDemand, error) {
	out := map[string]*PoolDemand{"": {LeasesByProxy: map[string]int32{}}}
	get := func(pool string) *PoolDemand {
		d := out[pool]
		if d == nil {
			d = &PoolDemand{Pool: pool, LeasesByProxy: map[string]int32{}}
			out[pool] = d
		}
		return d
	}
	err := s.readOnly(ctx, func(q querier) error {
		rows, err := q.Query(ctx, `
			SELECT pool, uid, active_leases, leasable, COALESCE(max_leases, $1)
			FROM lease.proxies WHERE NOT deleted`, s.cfg.DefaultMaxLeases)
		if err != nil {
			return err
		}
		unlimited := map[string]bool{}
		for rows.Next() {
			var pool, uid string
			var active, capacity int32
			var leasable bool
			if err := rows.Scan(&pool, &uid, &active, &leasable, &capacity); err != nil {
				rows.Close()
				return err
			}
			d := get(pool)
			d.ActiveLeases += int64(active)
			if active > 0 {
				d.LeasesByProxy[uid] = active
			}
			if leasable {
				d.Leasable++
				d.Capacity += int64(capacity)
				if capacity == 0 {
					unlimited[pool] = true
				}
			}
		}
		if err := rows.Err(); err != nil {
			return err
		}
		for pool := range unlimited {
			out[pool].Capacity = 0
		}
		rows, err = q.Query(ctx, "SELECT pool, refused FROM lease.refusals")
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var pool string
			var n int64
			if err := rows.Scan(&pool, &n); err != nil {
				return err
			}
			get(pool).Refused = n
		}
		return rows.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("reading pool demand: %w", err)
	}
	return out, nil
}
