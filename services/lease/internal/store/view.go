package store

import (
	"context"
	"fmt"
	"time"

	"github.com/google/btree"
)

// view is one replica's copy of the proxy mirror, in selection order, so that
// choosing a proxy costs a walk of an ordered tree instead of a query. It
// is only a proposal: the commit re-checks every choice in the database
// (leasable, capacity, cooldowns) under the proxy's row lock, and a choice
// the database refuses is retried with the database's answer. The view is
// reloaded whole from the database every refresh interval, after the mirror
// changed through this replica, and whenever it can offer nothing, so an
// acquire is never refused on a stale view. Only the committer goroutine
// touches it; the periodic reload is read beside it and handed over.
type view struct {
	all         map[string]*viewProxy // every proxy not deleted
	order       *btree.BTreeG[*viewProxy]
	loaded      time.Time // wall clock of the last reload
	readStarted time.Time // when the read behind it began
	stale       bool      // reload before the next selection
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
	pool                   string
	labels                 map[string]string
	leasable               bool
	capacity               int // 0: unlimited
	active                 int
	pending                int       // chosen by rounds in flight
	touched                uint64    // the settled round that last told us about it
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

func newView() *view {
	return &view{all: map[string]*viewProxy{}, order: btree.NewG(16, before), stale: true}
}

func (p *viewProxy) load() int { return p.active + p.pending }

func (p *viewProxy) free() bool { return p.capacity == 0 || p.load() < p.capacity }

func (p *viewProxy) matches(sel Selector) bool {
	if sel.Provider != "" && p.provider != sel.Provider ||
		sel.Region != "" && p.region != sel.Region ||
		sel.Zone != "" && p.zone != sel.Zone ||
		sel.Pool != "" && p.pool != sel.Pool {
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
func (v *view) update(p *viewProxy, f func()) { reorder(v.order, p, f) }

// reorder runs f, which changes p's ordering fields, with p out of order
// (a B-tree finds an item by its key, so it must leave under the old one).
func reorder(order *btree.BTreeG[*viewProxy], p *viewProxy, f func()) {
	if p.leasable {
		order.Delete(p)
	}
	f()
	if p.leasable {
		order.ReplaceOrInsert(p)
	}
}

// settle ends a round's choice of proxy uid: it is no longer pending, and
// active becomes the database's count after round seq when known (-1:
// unknown).
func (v *view) settle(uid string, active int, seq uint64) {
	if p := v.all[uid]; p != nil {
		v.update(p, func() {
			p.pending = max(p.pending-1, 0)
			if active >= 0 {
				p.active, p.touched = active, seq
			}
		})
	}
}

// setActive records the database's count of p's active leases after round
// seq.
func (v *view) setActive(uid string, active int, seq uint64) {
	if p := v.all[uid]; p != nil {
		p.touched = seq
		if p.active != active {
			v.update(p, func() { p.active = active })
		}
	}
}

// addCooldown records a cooldown the database confirmed in round seq.
func (v *view) addCooldown(uid, target string, end time.Time, seq uint64) {
	if p := v.all[uid]; p != nil {
		p.touched = seq
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
       active_leases, last_lease_time, tiebreak, pool
FROM lease.proxies WHERE NOT deleted`

const viewCooldownsSQL = `
SELECT c.proxy_uid, c.target_host, c.expire_time FROM lease.cooldowns c
JOIN lease.proxies p ON p.uid = c.proxy_uid AND NOT p.deleted
WHERE c.expire_time > $1`

// snapshot is the mirror as read from the database at one moment.
type snapshot struct {
	all   map[string]*viewProxy
	order *btree.BTreeG[*viewProxy]
	// settled is how many rounds the committer had settled when the read
	// began: values the view learnt from later rounds may be newer.
	settled uint64
	started time.Time
}

// readMirror reads the mirror in one repeatable-read transaction, so that
// proxies and cooldowns agree. It touches no view: the refresher runs it
// beside the committer.
func (s *Store) readMirror(ctx context.Context, now time.Time) (*snapshot, error) {
	snap := &snapshot{all: map[string]*viewProxy{}, order: btree.NewG(16, before), settled: s.settled.Load(), started: time.Now()}
	err := s.readOnly(ctx, func(q querier) error {
		rows, err := q.Query(ctx, viewProxiesSQL, s.cfg.DefaultMaxLeases)
		if err != nil {
			return err
		}
		for rows.Next() {
			p := &viewProxy{}
			var last *time.Time
			if err := rows.Scan(&p.uid, &p.name, &p.provider, &p.region, &p.zone, &p.labels, &p.leasable,
				&p.capacity, &p.active, &last, &p.tiebreak, &p.pool); err != nil {
				rows.Close()
				return err
			}
			if last != nil {
				p.lastLease = *last
			}
			snap.all[p.uid] = p
			if p.leasable {
				snap.order.ReplaceOrInsert(p)
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
			if p := snap.all[uid]; p != nil {
				if p.cooldowns == nil {
					p.cooldowns = map[string]time.Time{}
				}
				p.cooldowns[target] = end
			}
		}
		return rows.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("reading the proxy mirror: %w", err)
	}
	return snap, nil
}

// adopt makes snap the view. The choices of rounds in flight stay pending,
// and what rounds settled after the read began told the view about a
// proxy (its count, last lease, cooldowns) is kept over the read's older
// values.
func (v *view) adopt(snap *snapshot) {
	if !snap.started.After(v.readStarted) {
		return // read before the view's own: older
	}
	for uid, p := range snap.all {
		old := v.all[uid]
		if old == nil || old.pending == 0 && old.touched <= snap.settled {
			continue
		}
		reorder(snap.order, p, func() {
			p.pending = old.pending
			if old.touched > snap.settled {
				p.active, p.lastLease, p.touched = old.active, old.lastLease, old.touched
				for target, end := range old.cooldowns {
					if p.cooldowns == nil {
						p.cooldowns = map[string]time.Time{}
					}
					if end.After(p.cooldowns[target]) {
						p.cooldowns[target] = end
					}
				}
			}
		})
	}
	v.all, v.order, v.loaded, v.readStarted, v.stale = snap.all, snap.order, time.Now(), snap.started, false
}

// reload reads the mirror and adopts it at once, in the committer.
func (s *Store) reload(ctx context.Context, v *view, now time.Time) error {
	snap, err := s.readMirror(ctx, now)
	if err != nil {
		return err
	}
	v.adopt(snap)
	return nil
}
