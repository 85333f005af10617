// Package membership splits the proxies across the live health replicas.
// Each replica keeps a key in a JetStream key-value bucket whose entries
// expire after TTL, refreshing it every TTL/3; a replica that dies stops
// refreshing and its key ages out (leaving a marker every watcher sees),
// one that stops cleanly deletes it. Every replica watches the bucket, so
// all of them see the same member set within moments, and rendezvous
// hashing over that set names one owner per
// proxy: a join or a death moves only the proxies that must move. There is
// no election and no consensus of our own; JetStream is the shared truth.
package membership

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/egress-proxies/egress-proxies/pkg/bus"
)

// Bucket is the key-value bucket of the replicas for names' prefix.
func Bucket(names bus.Names) string {
	p := names.Prefix
	if p == "" {
		p = bus.DefaultPrefix
	}
	return strings.ToUpper(strings.NewReplacer(".", "_", "-", "_").Replace(p)) + "_HEALTH_MEMBERS"
}

// Membership is this replica's view of the replica set.
type Membership struct {
	ID  string
	TTL time.Duration
	Log *slog.Logger
	// OnChange is called whenever the set changes, from a goroutine of
	// its own: a rebalance of many proxies never delays the heartbeat (a
	// late heartbeat would let this replica's key expire). Changes that
	// arrive while it runs are coalesced into one more call.
	OnChange func(members []string)

	mu      sync.RWMutex
	members []string
	ring    Ring
	changed chan struct{}
}

// Members is the current replica set, sorted; it always includes this
// replica while Run runs.
func (m *Membership) Members() []string {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return slices.Clone(m.members)
}

// Owner is the replica that probes uid.
func (m *Membership) Owner(uid string) string {
	m.mu.RLock()
	defer m.mu.RUnlock()
	id, _ := m.ring.Owner(uid)
	return id
}

// Owns says whether this replica probes uid. Before the first member list
// is known it owns nothing.
func (m *Membership) Owns(uid string) bool { return m.Owner(uid) == m.ID }

// Owner picks uid's owner among members by rendezvous (highest random
// weight) hashing.
func Owner(members []string, uid string) string {
	id, _ := NewRing(members).Owner(uid)
	return id
}

// Ring is a member set ready for rendezvous hashing: each member's hash
// state after its ID, so that an owner costs one pass over the UID per
// member and no allocation.
type Ring struct {
	ids    []string
	prefix []uint64
}

const fnvOffset, fnvPrime = 14695981039346656037, 1099511628211

// NewRing prepares members.
func NewRing(members []string) Ring {
	r := Ring{ids: members, prefix: make([]uint64, len(members))}
	for i, id := range members {
		h := uint64(fnvOffset)
		for j := 0; j < len(id); j++ {
			h = (h ^ uint64(id[j])) * fnvPrime
		}
		r.prefix[i] = h * fnvPrime // the zero byte between ID and UID
	}
	return r
}

// Owner is the member with the highest weight for uid, and that weight;
// "" with no members. The weight is FNV-1a of the member, a zero byte and
// the UID, mixed — written out rather than through hash/fnv, the same
// weights (TestWeight_isFNV1a), so replicas of either version agree on
// every owner.
func (r Ring) Owner(uid string) (string, uint64) {
	var best string
	var bestW uint64
	for i, id := range r.ids {
		h := r.prefix[i]
		for j := 0; j < len(uid); j++ {
			h = (h ^ uint64(uid[j])) * fnvPrime
		}
		if w := mix(h); best == "" || Beats(w, id, bestW, best) {
			best, bestW = id, w
		}
	}
	return best, bestW
}

// Beats says whether member id with weight w wins a proxy over member
// other with weight otherW: the higher weight, then the lower ID.
func Beats(w uint64, id string, otherW uint64, other string) bool {
	return w > otherW || (w == otherW && id < other)
}

// mix is the splitmix64 finaliser; FNV alone spreads similar keys poorly.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// Run joins the replica set and keeps the view current until ctx ends,
// then leaves it. While NATS is unreachable it keeps trying to join
// (bus.Retry), owning no proxy meanwhile.
func (m *Membership) Run(ctx context.Context, js jetstream.JetStream, names bus.Names) error {
	if m.TTL < time.Second {
		return fmt.Errorf("membership TTL must be at least 1s, got %s", m.TTL)
	}
	m.changed = make(chan struct{}, 1)
	var notify sync.WaitGroup
	defer notify.Wait()
	nctx, stop := context.WithCancel(ctx)
	defer stop()
	notify.Go(func() {
		for {
			select {
			case <-nctx.Done():
				return
			case <-m.changed:
				if m.OnChange != nil {
					m.OnChange(m.Members())
				}
			}
		}
	})
	_ = bus.Retry(ctx, m.Log, "joining the replica set", func(ctx context.Context) error { return m.run(ctx, js, names) })
	return nil
}

func (m *Membership) run(ctx context.Context, js jetstream.JetStream, names bus.Names) error {
	cfg := jetstream.KeyValueConfig{
		Bucket:      Bucket(names),
		Description: "live health replicas; each key expires unless its replica refreshes it",
		TTL:         m.TTL,
		History:     1,
		Storage:     jetstream.MemoryStorage,
		// A key that expires leaves a marker, so watchers see a death as
		// soon as JetStream does instead of at their next listing.
		LimitMarkerTTL: max(m.TTL, time.Second),
	}
	// Without markers (a server before 2.11) deaths are seen when the
	// watcher is rebuilt from the live keys, as often as a heartbeat.
	rebuildEvery := 3 * m.TTL
	kv, err := js.CreateOrUpdateKeyValue(ctx, cfg)
	if errors.Is(err, jetstream.ErrLimitMarkerTTLNotSupported) {
		m.Log.Warn("WARNING: this NATS server keeps no markers of expired keys (before 2.11); a dead replica's proxies are taken over when the replica set is next read")
		cfg.LimitMarkerTTL, rebuildEvery = 0, m.TTL/3
		kv, err = js.CreateOrUpdateKeyValue(ctx, cfg)
	}
	if err != nil {
		return fmt.Errorf("membership bucket: %w", err)
	}
	key := keyFor(m.ID)
	if _, err := kv.Put(ctx, key, []byte(m.ID)); err != nil {
		return fmt.Errorf("joining the replica set: %w", err)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		// Purge rather than delete: no marker is left for a key that will
		// never come back.
		if err := kv.Purge(dctx, key); err != nil {
			m.Log.Warn("leaving the replica set failed; the key expires on its own", "error", err)
		}
	}()

	// The heartbeat runs on its own, so that nothing else this replica
	// does (a slow NATS answer, a burst of changes) delays it past the
	// TTL; kick asks for one at once (this replica's key expired).
	kick := make(chan struct{}, 1)
	var beat sync.WaitGroup
	bctx, stopBeat := context.WithCancel(ctx)
	defer func() { stopBeat(); beat.Wait() }() // before the purge above
	beat.Go(func() {
		t := time.NewTicker(m.TTL / 3)
		defer t.Stop()
		for {
			select {
			case <-bctx.Done():
				return
			case <-t.C:
			case <-kick:
			}
			pctx, cancel := context.WithTimeout(bctx, m.TTL/3)
			_, err := kv.Put(pctx, key, []byte(m.ID))
			cancel()
			if err != nil && bctx.Err() == nil {
				m.Log.Warn("WARNING: refreshing this replica's membership failed", "error", err)
			}
		}
	})

	// The watcher keeps the view: first every live key, then joins, clean
	// leaves and expiries (their markers) as they happen. It is rebuilt
	// every rebuildEvery from the keys then live, which also covers a
	// watcher that silently fell behind.
	rebuild := time.NewTicker(rebuildEvery)
	defer rebuild.Stop()
	for ctx.Err() == nil {
		w, err := kv.WatchAll(ctx)
		if err != nil {
			if ctx.Err() == nil {
				m.Log.Warn("WARNING: watching the replica set failed; retrying", "error", err)
			}
			select {
			case <-ctx.Done():
			case <-time.After(m.TTL / 3):
			}
			continue
		}
		m.follow(ctx, w, key, kick, rebuild.C)
		_ = w.Stop()
	}
	return nil
}

// follow builds the member set from w's entries until ctx ends, w closes
// or rebuild ticks.
func (m *Membership) follow(ctx context.Context, w jetstream.KeyWatcher, key string, kick chan<- struct{}, rebuild <-chan time.Time) {
	keys := map[string]string{} // key -> replica ID
	initial := true
	for {
		select {
		case <-ctx.Done():
			return
		case <-rebuild:
			if !initial {
				return
			}
		case e, ok := <-w.Updates():
			if !ok {
				return
			}
			if e == nil { // the end of the live keys
				initial = false
				m.publish(keys)
				continue
			}
			if e.Operation() == jetstream.KeyValuePut {
				keys[e.Key()] = string(e.Value())
			} else { // deleted, purged, or expired
				delete(keys, e.Key())
				if e.Key() == key {
					// This replica stalled past the TTL: back at once.
					select {
					case kick <- struct{}{}:
					default:
					}
				}
			}
			if !initial {
				m.publish(keys)
			}
		}
	}
}

// keyFor turns an ID into a valid key.
func keyFor(id string) string {
	var b strings.Builder
	for _, r := range id {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '=':
			b.WriteRune(r)
		default:
			b.WriteRune('_')
		}
	}
	return b.String()
}

// publish makes the replicas in keys, and this one, the current member
// set, telling OnChange when it changed.
func (m *Membership) publish(keys map[string]string) {
	ids := []string{m.ID}
	for _, id := range keys {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	ids = slices.Compact(ids)
	m.mu.Lock()
	changed := !slices.Equal(ids, m.members)
	if changed {
		m.members, m.ring = ids, NewRing(ids)
	}
	m.mu.Unlock()
	if changed {
		m.Log.Info("health replica set changed", "members", ids, "self", m.ID)
		select {
		case m.changed <- struct{}{}:
		default: // a call is pending; it reads the latest set
		}
	}
}
