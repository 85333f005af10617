// Package fleet learns the proxies from the orchestrator's ProxyEvents,
// checked against the orchestrator's listing (a resync: at start,
// periodically, after NATS outages), and decides which of them this
// replica probes: it keeps the latest snapshot of every proxy (newest
// revision wins), and hands the engine those that are probeable and owned
// by this replica. It re-decides when the replica set changes, moving only
// the proxies whose owner changed: a replica that joins can take only the
// proxies it now outweighs, one that leaves gives up only its own, so a
// change costs one hash per proxy rather than one per proxy and member.
package fleet

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/proxysync"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/membership"
)

// Engine is what the fleet drives.
type Engine interface {
	Adopt(engine.Spec, *engine.Verdict)
	Remove(uid string)
}

// PriorFunc returns the verdicts already reached for proxies this replica
// is about to take (by an earlier owner, or before a restart), keyed by
// UID; a verdict for another instance than the spec's is ignored.
type PriorFunc func(uids []string) map[string]Prior

// Prior is an earlier verdict and the instance it was for.
type Prior struct {
	ProviderID      string
	CredentialsTime time.Time
	Verdict         engine.Verdict
}

// Fleet is the set of known proxies.
type Fleet struct {
	Engine   Engine
	Defaults engine.Defaults
	// Self is this replica's ID in the replica set: it probes the proxies
	// the set's rendezvous hashing gives it (membership), none before the
	// first Rebalance. Empty: it probes every proxy.
	Self string
	// Gone is called when a proxy is deleted or stops being probeable, so
	// its stored health goes too: what was stored for its snapshots up to
	// revision (every snapshot when the orchestrator no longer lists it).
	Gone func(uid string, revision int64)
	// Prior, when set, seeds proxies taken over with their earlier verdict.
	Prior PriorFunc
	Log   *slog.Logger
	// Resumed, when set, is called when the event consumer is set up
	// again after it stopped (events may have been missed meanwhile).
	Resumed func()

	mu      sync.Mutex
	proxies map[string]*known
	seq     uint64 // counts applied snapshots
	members []string
	ring    membership.Ring
}

type known struct {
	revision int64
	seq      uint64 // when its snapshot was applied, in Fleet.seq
	spec     engine.Spec
	probe    bool // probeable
	owned    bool // handed to the engine
	// owner is the member that probes it under ring, and its weight; ""
	// while not probeable (decided when it becomes so).
	owner  string
	weight uint64
}

// Apply applies one event; it returns false for an event older than what
// is known.
func (f *Fleet) Apply(ev *busv1.ProxyEvent) bool {
	return f.applyAll([]*busv1.ProxyEvent{ev}) > 0
}

// applyAll applies events (at most one per proxy) and returns how many
// were newer than what was known. The proxies this replica takes with
// them are adopted together: their earlier verdicts are read in one call.
func (f *Fleet) applyAll(evs []*busv1.ProxyEvent) (applied int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.proxies == nil {
		f.proxies = map[string]*known{}
	}
	changed := make(map[string]*known, len(evs))
	type goneAt struct {
		uid      string
		revision int64
	}
	var gone []goneAt
	for _, ev := range evs {
		uid := ev.GetProxy().GetUid()
		if uid == "" {
			continue
		}
		k, ok := f.proxies[uid]
		if ok && ev.GetRevision() <= k.revision {
			continue
		}
		if !ok {
			k = &known{}
			f.proxies[uid] = k
		}
		applied++
		k.revision = ev.GetRevision()
		f.seq++
		k.seq = f.seq
		wasProbe := k.probe
		if ev.GetType() == proxyv1.ChangeType_CHANGE_TYPE_DELETED {
			k.probe = false
		} else {
			k.spec, k.probe = engine.SpecFor(ev.GetProxy(), f.Defaults)
			k.spec.Revision = k.revision
		}
		changed[uid] = k
		// Stored health goes when a proxy stops being probed, and also
		// when the first event seen says it is not probed: the service
		// may have been down when it went.
		if !k.probe && (wasProbe || !ok) {
			gone = append(gone, goneAt{uid, k.revision})
		}
	}
	f.syncAll(changed, true)
	if f.Gone != nil {
		for _, g := range gone {
			f.Gone(g.uid, g.revision)
		}
	}
	// A deleted proxy is remembered (its revision guards against replays
	// of older events) but holds nothing else.
	return applied
}

// Resync checks the fleet against the orchestrator's listing: every
// listed proxy is applied at the revision of its page (older than what is
// known changes nothing), and every proxy still probeable here but missing
// from the listing, whose snapshot was applied before the listing began,
// is forgotten as deleted. Which proxies are gone is decided by the
// listing, not by revisions, so a reset of the orchestrator's database
// (revisions start again from one) purges what no longer exists.
func (f *Fleet) Resync(ctx context.Context, l proxysync.Lister) (listed, changed, purged int, err error) {
	f.mu.Lock()
	mark := f.seq
	f.mu.Unlock()
	seen := map[string]bool{}
	_, err = proxysync.List(ctx, l, func(proxies []*proxyv1.Proxy, revision int64) error {
		page := make([]*busv1.ProxyEvent, 0, len(proxies))
		for _, p := range proxies {
			seen[p.GetUid()] = true
			page = append(page, &busv1.ProxyEvent{Revision: proxysync.Revision(p, revision), Type: proxyv1.ChangeType_CHANGE_TYPE_UPDATED, Proxy: p})
		}
		changed += f.applyAll(page)
		return nil
	})
	if err != nil {
		return 0, 0, 0, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	gone := map[string]*known{}
	for uid, k := range f.proxies {
		if k.probe && !seen[uid] && k.seq <= mark {
			k.probe = false
			gone[uid] = k
		}
	}
	f.syncAll(gone, false)
	for uid := range gone {
		f.Log.Info("proxy gone from the orchestrator's listing; no longer probed", "proxy_uid", uid)
		if f.Gone != nil {
			f.Gone(uid, math.MaxInt64)
		}
	}
	return len(seen), changed, len(gone), nil
}

// Rebalance re-decides ownership for a new replica set (members includes
// this replica). Proxies owned by a member that left get the owner of
// the new set; the others change hands only to a member that joined and
// outweighs their owner.
func (f *Fleet) Rebalance(members []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var added, left []string
	for _, id := range members {
		if !slices.Contains(f.members, id) {
			added = append(added, id)
		}
	}
	for _, id := range f.members {
		if !slices.Contains(members, id) {
			left = append(left, id)
		}
	}
	f.members, f.ring = slices.Clone(members), membership.NewRing(members)
	joined := membership.NewRing(added)
	for uid, k := range f.proxies {
		switch {
		case !k.probe:
		case k.owner == "" || slices.Contains(left, k.owner):
			k.owner, k.weight = f.ring.Owner(uid)
		case len(added) > 0:
			if id, w := joined.Owner(uid); membership.Beats(w, id, k.weight, k.owner) {
				k.owner, k.weight = id, w
			}
		}
	}
	f.syncAll(f.proxies, false)
}

// Owned counts the proxies handed to the engine.
func (f *Fleet) Owned() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, k := range f.proxies {
		if k.owned {
			n++
		}
	}
	return n
}

// syncAll hands the engine the given proxies this replica owns and takes
// back those it no longer owns; with specs set, it also passes the engine
// the current spec of those it keeps. Proxies new to the engine start from
// their prior verdict when there is one for the same instance.
func (f *Fleet) syncAll(ks map[string]*known, specs bool) {
	var taking []string
	for uid, k := range ks {
		if !k.probe {
			k.owner = ""
		} else if k.owner == "" && len(f.members) > 0 {
			k.owner, k.weight = f.ring.Owner(uid)
		}
		own := k.probe && (f.Self == "" || k.owner == f.Self)
		switch {
		case own && !k.owned:
			taking = append(taking, uid)
		case own && specs:
			f.Engine.Adopt(k.spec, nil)
		case !own && k.owned:
			f.Engine.Remove(uid)
			k.owned = false
		}
	}
	if len(taking) == 0 {
		return
	}
	var prior map[string]Prior
	if f.Prior != nil {
		prior = f.Prior(taking)
	}
	for _, uid := range taking {
		k := ks[uid]
		var v *engine.Verdict
		if p, ok := prior[uid]; ok && p.ProviderID == k.spec.ProviderID && p.CredentialsTime.Equal(k.spec.CredentialsTime) {
			v = &p.Verdict
		}
		f.Engine.Adopt(k.spec, v)
		k.owned = true
	}
}

// Follow reads every proxy's latest event, then follows changes, until ctx
// ends. An ordered consumer with DeliverLastPerSubject gives the current
// state of the fleet first; it recreates itself on gaps, is set up afresh
// after every reconnect, and again and again while NATS is unreachable
// (bus.KeepConsuming).
func (f *Fleet) Follow(ctx context.Context, js jetstream.JetStream, names bus.Names) error {
	attempts := 0
	bus.KeepConsuming(ctx, js, f.Log, "proxy events", func(ctx context.Context) error {
		if attempts++; attempts > 1 && f.Resumed != nil {
			f.Resumed()
		}
		return f.follow(ctx, js, names)
	})
	return nil
}

func (f *Fleet) follow(ctx context.Context, js jetstream.JetStream, names bus.Names) error {
	ctx, cancel := bus.UntilReconnect(ctx, js.Conn())
	defer cancel()
	cons, err := js.OrderedConsumer(ctx, names.ProxyEventStream(), jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{names.ProxyEventSubjects()},
		DeliverPolicy:  jetstream.DeliverLastPerSubjectPolicy,
	})
	if err != nil {
		return fmt.Errorf("proxy event consumer: %w", err)
	}
	it, err := cons.Messages(bus.MessagesOpts()...)
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	defer it.Stop()
	batch := make([]*busv1.ProxyEvent, 0, followBatch)
	for {
		// Wait for an event, then take those the consumer already holds
		// (up to followBatch): the proxies they give this replica are
		// adopted together, their earlier verdicts read in one query.
		m, err := it.Next()
		for err == nil {
			var ev busv1.ProxyEvent
			if _, derr := bus.Decode(ctx, m, &ev); derr != nil {
				f.Log.Warn("WARNING: dropping an undecodable proxy event", "subject", m.Subject(), "error", derr)
			} else {
				batch = append(batch, &ev)
			}
			if len(batch) == followBatch {
				break
			}
			m, err = it.Next(jetstream.NextMaxWait(time.Millisecond))
		}
		f.applyInOrder(batch)
		clear(batch)
		batch = batch[:0]
		switch {
		case err == nil, errors.Is(err, nats.ErrTimeout):
		case errors.Is(err, jetstream.ErrMsgIteratorClosed):
			return nil // ctx ended or NATS reconnected
		default:
			return err
		}
	}
}

// followBatch is the most events follow applies together.
const followBatch = 500

// applyInOrder applies events in the order given: as runs of distinct
// proxies, since applyAll takes at most one event of each.
func (f *Fleet) applyInOrder(evs []*busv1.ProxyEvent) {
	seen := make(map[string]bool, len(evs))
	start := 0
	for i, ev := range evs {
		uid := ev.GetProxy().GetUid()
		if seen[uid] {
			f.applyAll(evs[start:i])
			start = i
			clear(seen)
		}
		seen[uid] = true
	}
	if start < len(evs) {
		f.applyAll(evs[start:])
	}
}
