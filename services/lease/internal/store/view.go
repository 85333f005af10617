package store

import (
	"context"
	"fmt"
	"time"

	"github.com/google/btree"
)

// view is one replica's copy of the pool, in selection order, so that
// choosing a proxy costs a walk of an ordered tree instead of a query. It
// is only a proposal: the commit re-checks every choice in the database
// (leasable, capacity, cooldowns) under the proxy's row lock, and a choice
// the database refuses is retried with the database's answer. The view is
// reloaded whole from the database every refresh interval, after the pool
// changed through this replica, and whenever it can offer nothing, so an
// acquire is never refused on a stale view. Only the committer goroutine
// touches it.
type view struct {
	all     map[string]*viewProxy // every proxy not deleted
	order   *btree.BTreeG[*viewProxy]
	loaded  time.Time // wall clock of the last reload
	stale   bool      // reload before the next selection
	capDflt int
}

// Rounds run concurrently, so the view counts a proxy's leases twice over:
// active is the database's count as last read or returned by a commit,
// pending the choices of rounds still in flight. Both count against
// capacity and in the selection order, so two rounds in flight never
// offer the same free place.

// viewProxy is what the view knows of a proxy.
type viewProxy struct {
	uid, name              string
	provider, region, zone string
	labels                 map[string]string
	leasable               bool
	capacity               int // 0: unlimited
	active                 int
	pending                int       // chosen by rounds in flight
	lastLease              time.Time // zero: never leased
	tiebreak               int64
	cooldowns              map[string]time.Time // target host ("" for every target) → end
}

// before is the selection order: fewest active leases, least recently
// leased (never leased first), the stable random tie-break.
func before(a, b *viewProxy) bool {
	if la, lb := a.load(), b.load(); la != lb {
		return la < lb
	}
	if !a.lastLease.Equal(b.lastLease) {
		return a.lastLease.Before(b.lastLease)
	}
	if a.tiebreak != b.tiebreak {
		return a.tiebreak < b.tiebreak
	}
	return a.uid < b.uid
}

func newView(defaultMaxLeases int) *view {
	return &view{all: map[string]*viewProxy{}, order: btree.NewG(16, before), stale: true, capDflt: defaultMaxLeases}
}

func (p *viewProxy) load() int { return p.active + p.pending }

func (p *viewProxy) free() bool { return p.capacity == 0 || p.load() < p.capacity }

func (p *viewProxy) matches(sel Selector) bool {
	if sel.Provider != "" && p.provider != sel.Provider ||
		sel.Region != "" && p.region != sel.Region ||
		sel.Zone != "" && p.zone != sel.Zone {
		return false
	}
	for k, v := range sel.Labels {
		if got, ok := p.labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

func (p *viewProxy) coolingFor(target string, now time.Time) bool {
	end, ok := p.cooldowns[target]
	return ok && end.After(now)
}

// pick chooses the first proxy in selection order that matches sel, has
// free capacity and is not cooling down for target nor globally, and counts
// the lease against it in the view; nil when none qualifies.
func (v *view) pick(sel Selector, target string, now time.Time) *viewProxy {
	var found *viewProxy
	v.order.Ascend(func(p *viewProxy) bool {
		if p.free() && p.matches(sel) && !p.coolingFor("", now) && (target == "" || !p.coolingFor(target, now)) {
			found = p
			return false
		}
		return true
	})
	if found != nil {
		v.update(found, func() { found.pending++; found.lastLease = now })
	}
	return found
}

// update changes p's ordering fields in f and moves it to its new place.
func (v *view) update(p *viewProxy, f func()) {
	if p.leasable {
		v.order.Delete(p)
	}
	f()
	if p.leasable {
		v.order.ReplaceOrInsert(p)
	}
}

// settle ends a round's choice of proxy uid: it is no longer pending, and
// active becomes the database's count after the round when known (-1:
// unknown).
func (v *view) settle(uid string, active int) {
	if p := v.all[uid]; p != nil {
		v.update(p, func() {
			p.pending = max(p.pending-1, 0)
			if active >= 0 {
				p.active = active
			}
		})
	}
}

// setActive records the database's count of p's active leases.
func (v *view) setActive(uid string, active int) {
	if p := v.all[uid]; p != nil && p.active != active {
		v.update(p, func() { p.active = active })
	}
}

// addCooldown records a cooldown the database confirmed.
func (v *view) addCooldown(uid, target string, end time.Time) {
	if p := v.all[uid]; p != nil {
		if p.cooldowns == nil {
			p.cooldowns = map[string]time.Time{}
		}
		if end.After(p.cooldowns[target]) {
			p.cooldowns[target] = end
		}
	}
}

// unavailable is the arithmetic of a refused acquire, from the view.
func (v *view) unavailable(sel Selector, target string, now time.Time) Unavailable {
	var u Unavailable
	for _, p := range v.all {
		if !p.matches(sel) {
			continue
		}
		u.Matching++
		switch {
		case !p.leasable:
			u.Unhealthy++
		case !p.free():
			u.AtCapacity++
		case target != "" && p.coolingFor(target, now):
			u.CoolingTarget++
		case p.coolingFor("", now):
			u.CoolingGlobal++
		}
	}
	return u
}

// available says whether u leaves a proxy that could have been leased.
func (u Unavailable) available() bool {
	return u.Matching > u.Unhealthy+u.AtCapacity+u.CoolingTarget+u.CoolingGlobal
}

const viewProxiesSQL = `
SELECT uid, name, provider, region, zone, labels, leasable, COALESCE(max_leases, $1),
       active_leases, last_lease_time, tiebreak
FROM lease.proxies WHERE NOT deleted`

const viewCooldownsSQL = `
SELECT c.proxy_uid, c.target_host, c.expire_time FROM lease.cooldowns c
JOIN lease.proxies p ON p.uid = c.proxy_uid AND NOT p.deleted
WHERE c.expire_time > $1`

// reload replaces the view with the database's pool, read in one
// repeatable-read transaction so that proxies and cooldowns agree. The
// choices of rounds in flight stay pending.
func (s *Store) reload(ctx context.Context, v *view, now time.Time) error {
	all := make(map[string]*viewProxy, len(v.all))
	order := btree.NewG(16, before)
	err := s.readOnly(ctx, func(q querier) error {
		rows, err := q.Query(ctx, viewProxiesSQL, v.capDflt)
		if err != nil {
			return err
		}
		for rows.Next() {
			p := &viewProxy{}
			var last *time.Time
			if err := rows.Scan(&p.uid, &p.name, &p.provider, &p.region, &p.zone, &p.labels, &p.leasable,
				&p.capacity, &p.active, &last, &p.tiebreak); err != nil {
				rows.Close()
				return err
			}
			if last != nil {
				p.lastLease = *last
			}
			if old := v.all[p.uid]; old != nil {
				p.pending = old.pending
			}
			all[p.uid] = p
			if p.leasable {
				order.ReplaceOrInsert(p)
			}
		}
		if err := rows.Err(); err != nil {
			return err
		}
		rows, err = q.Query(ctx, viewCooldownsSQL, now)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var uid, target string
			var end time.Time
			if err := rows.Scan(&uid, &target, &end); err != nil {
				return err
			}
			if p := all[uid]; p != nil {
				if p.cooldowns == nil {
					p.cooldowns = map[string]time.Time{}
				}
				p.cooldowns[target] = end
			}
		}
		return rows.Err()
	})
	if err != nil {
		return fmt.Errorf("reading the pool: %w", err)
	}
	v.all, v.order, v.loaded, v.stale = all, order, time.Now(), false
	return nil
}
