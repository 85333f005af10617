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
// read whole once; after that it reads only the proxies changed since its
// last read (the change log of migration 00007), every refresh interval,
// after the mirror changed through this replica, and whenever it can offer
// nothing, so an acquire is never refused on a stale view and a refresh
// costs what changed, not the size of the pool. Only the committer
// goroutine touches it; the periodic read is made beside it and handed
// over.
type view struct {
	all         map[string]*viewProxy // every proxy not deleted
	order       *candidates
	loaded      time.Time // wall clock of the last read adopted
	readStarted time.Time // when the read behind it began
	horizon     int64     // the last read's horizon (horizonSQL); 0: never read
	stale       bool      // read the changes before the next selection
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
	return &view{all: map[string]*viewProxy{}, order: newCandidates(), stale: true}
}

// candidates are the leasable proxies in selection order, and those of
// each pool apart, so that an acquire for a pool walks its pool's proxies
// only, not the whole fleet's.
type candidates struct {
	all   *btree.BTreeG[*viewProxy]
	pools map[string]*btree.BTreeG[*viewProxy] // by pool name, "" not included
}

func newCandidates() *candidates {
	return &candidates{all: btree.NewG(16, before), pools: map[string]*btree.BTreeG[*viewProxy]{}}
}

func (c *candidates) insert(p *viewProxy) {
	c.all.ReplaceOrInsert(p)
	if p.pool == "" {
		return
	}
	t := c.pools[p.pool]
	if t == nil {
		t = btree.NewG(16, before)
		c.pools[p.pool] = t
	}
	t.ReplaceOrInsert(p)
}

func (c *candidates) delete(p *viewProxy) {
	c.all.Delete(p)
	if t := c.pools[p.pool]; t != nil {
		if t.Delete(p); t.Len() == 0 {
			delete(c.pools, p.pool)
		}
	}
}

// ascend calls f in selection order on the candidates that may match sel,
// until f returns false.
func (c *candidates) ascend(sel Selector, f func(*viewProxy) bool) {
	if sel.Pool == "" {
		c.all.Ascend(f)
	} else if t := c.pools[sel.Pool]; t != nil {
		t.Ascend(f)
	}
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
	v.order.ascend(sel, func(p *viewProxy) bool {
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
func reorder(order *candidates, p *viewProxy, f func()) {
	if p.leasable {
		order.delete(p)
	}
	f()
	if p.leasable {
		order.insert(p)
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

const viewProxyColumns = `uid, name, provider, region, zone, labels, leasable, COALESCE(max_leases, $1),
       active_leases, last_lease_time, tiebreak, pool`

const viewProxiesSQL = `SELECT ` + viewProxyColumns + ` FROM lease.proxies WHERE NOT deleted`

const viewCooldownsSQL = `
SELECT c.proxy_uid, c.target_host, c.expire_time FROM lease.cooldowns c
JOIN lease.proxies p ON p.uid = c.proxy_uid AND NOT p.deleted
WHERE c.expire_time > $1`

// horizonSQL is the oldest transaction still running in the read's
// snapshot (a repeatable-read transaction has one snapshot, whichever
// statement comes first): the changes of every transaction before it are
// in the read, those of it and later ones may not be.
const horizonSQL = `SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint`

// changedSQL lists the proxies changed by transactions at or after a
// horizon (migration 00007 logs them).
const changedSQL = `
SELECT COALESCE(array_agg(DISTINCT u), '{}') FROM lease.proxy_changes c, unnest(c.uids) u
WHERE c.xid >= $1::bigint::text::xid8`

const changedProxiesSQL = `SELECT ` + viewProxyColumns + ` FROM lease.proxies WHERE uid = ANY($2) AND NOT deleted`

const changedCooldownsSQL = `
SELECT proxy_uid, target_host, expire_time FROM lease.cooldowns
WHERE proxy_uid = ANY($2) AND expire_time > $1`

// snapshot is the mirror, or the part of it that changed, as read from
// the database at one moment.
type snapshot struct {
	// all is every proxy not deleted; for changes, every proxy changed
	// since the horizon the read started from, nil for one deleted.
	all   map[string]*viewProxy
	order *candidates // the whole read's only
	// changes: all holds only the changes since since.
	changes bool
	since   int64
	// horizon is the read's: the next read of changes starts from it.
	horizon int64
	// settled is how many rounds the committer had settled when the read
	// began: values the view learnt from later rounds may be newer.
	settled uint64
	started time.Time
}

// readMirror reads the whole mirror in one repeatable-read transaction,
// so that proxies and cooldowns agree. It touches no view: the refresher
// runs it beside the committer.
func (s *Store) readMirror(ctx context.Context, now time.Time) (*snapshot, error) {
	snap := &snapshot{all: map[string]*viewProxy{}, order: newCandidates(), settled: s.settled.Load(), started: time.Now()}
	err := s.readOnly(ctx, func(q querier) error {
		if err := q.QueryRow(ctx, horizonSQL).Scan(&snap.horizon); err != nil {
			return err
		}
		if err := readProxies(ctx, q, snap, viewProxiesSQL, s.cfg.DefaultMaxLeases); err != nil {
			return err
		}
		return readCooldowns(ctx, q, snap, viewCooldownsSQL, now)
	})
	if err != nil {
		return nil, fmt.Errorf("reading the proxy mirror: %w", err)
	}
	return snap, nil
}

// readChanges reads the proxies changed since horizon (a read's), with
// their cooldowns, in one repeatable-read transaction: its cost follows
// the changes, not the size of the pool.
func (s *Store) readChanges(ctx context.Context, now time.Time, since int64) (*snapshot, error) {
	snap := &snapshot{all: map[string]*viewProxy{}, changes: true, since: since, settled: s.settled.Load(), started: time.Now()}
	err := s.readOnly(ctx, func(q querier) error {
		if err := q.QueryRow(ctx, horizonSQL).Scan(&snap.horizon); err != nil {
			return err
		}
		var uids []string
		if err := q.QueryRow(ctx, changedSQL, since).Scan(&uids); err != nil {
			return err
		}
		if len(uids) == 0 {
			return nil
		}
		for _, uid := range uids {
			snap.all[uid] = nil // deleted unless read below
		}
		if err := readProxies(ctx, q, snap, changedProxiesSQL, s.cfg.DefaultMaxLeases, uids); err != nil {
			return err
		}
		return readCooldowns(ctx, q, snap, changedCooldownsSQL, now, uids)
	})
	if err != nil {
		return nil, fmt.Errorf("reading the proxy mirror's changes: %w", err)
	}
	return snap, nil
}

func readProxies(ctx context.Context, q querier, snap *snapshot, sql string, args ...any) error {
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		p := &viewProxy{}
		var last *time.Time
		if err := rows.Scan(&p.uid, &p.name, &p.provider, &p.region, &p.zone, &p.labels, &p.leasable,
			&p.capacity, &p.active, &last, &p.tiebreak, &p.pool); err != nil {
			return err
		}
		if last != nil {
			p.lastLease = *last
		}
		snap.all[p.uid] = p
		if snap.order != nil && p.leasable {
			snap.order.insert(p)
		}
	}
	return rows.Err()
}

func readCooldowns(ctx context.Context, q querier, snap *snapshot, sql string, args ...any) error {
	rows, err := q.Query(ctx, sql, args...)
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
}

// adopt makes snap the view, or applies its changes to the view. The
// choices of rounds in flight stay pending, and what rounds settled after
// the read began told the view about a proxy (its count, last lease,
// cooldowns) is kept over the read's older values. It reports whether
// snap was adopted: a read begun before the view's own is older, and
// changes read from a horizon later than the view's would leave a gap.
func (v *view) adopt(snap *snapshot) bool {
	if !snap.started.After(v.readStarted) || snap.changes && (v.horizon == 0 || snap.since > v.horizon) {
		return false
	}
	if snap.changes {
		for uid, p := range snap.all {
			old := v.all[uid]
			if old != nil && old.leasable {
				v.order.delete(old)
			}
			if p == nil {
				delete(v.all, uid)
				continue
			}
			if old != nil {
				p.keep(old, snap.settled)
			}
			v.all[uid] = p
			if p.leasable {
				v.order.insert(p)
			}
		}
	} else {
		for uid, p := range snap.all {
			if old := v.all[uid]; old != nil && (old.pending > 0 || old.touched > snap.settled) {
				reorder(snap.order, p, func() { p.keep(old, snap.settled) })
			}
		}
		v.all, v.order = snap.all, snap.order
	}
	v.loaded, v.readStarted, v.horizon, v.stale = time.Now(), snap.started, snap.horizon, false
	return true
}

// keep carries over to p, read from the database, what the view knew of
// the proxy beyond a read made when settled rounds had settled: the
// choices of rounds in flight, and the values of later rounds.
func (p *viewProxy) keep(old *viewProxy, settled uint64) {
	p.pending = old.pending
	if old.touched <= settled {
		return
	}
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

// fullReadAfter is how old the view's last read may be for the next to
// read only the changes since: the sweep purges the change log's entries
// older than changeRetention.
const fullReadAfter = changeRetention / 2

// read reads what the view needs: the changes since its last read, or
// the whole mirror when it has none or the log may no longer hold them.
func (s *Store) read(ctx context.Context, now time.Time, horizon int64, readStarted time.Time) (*snapshot, error) {
	if horizon == 0 || time.Since(readStarted) > fullReadAfter {
		return s.readMirror(ctx, now)
	}
	return s.readChanges(ctx, now, horizon)
}

// reload brings the view up to date at once, in the committer.
func (s *Store) reload(ctx context.Context, v *view, now time.Time) error {
	snap, err := s.read(ctx, now, v.horizon, v.readStarted)
	if err != nil {
		return err
	}
	s.adopt(v, snap)
	return nil
}

// adopt adopts snap in the committer and tells the refresher where the
// view's next read starts.
func (s *Store) adopt(v *view, snap *snapshot) {
	if v.adopt(snap) {
		s.viewRead.Store(&viewRead{horizon: v.horizon, started: v.readStarted})
	}
}

// viewRead is where the view's last read left it.
type viewRead struct {
	horizon int64
	started time.Time
}
