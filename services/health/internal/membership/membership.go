// Package membership splits the proxies across the live health replicas.
// Each replica keeps a key in a JetStream key-value bucket whose entries
// expire after TTL, refreshing it every TTL/3; a replica that dies stops
// refreshing and its key ages out, one that stops cleanly deletes it. Every
// replica watches the bucket, so all of them see the same member set
// within moments, and rendezvous hashing over that set names one owner per
// proxy: a join or a death moves only the proxies that must move. There is
// no election and no consensus of our own; JetStream is the shared truth.
package membership

import (
	"context"
	"fmt"
	"hash/fnv"
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
	// OnChange is called (from Run's goroutine) whenever the set changes.
	OnChange func(members []string)

	mu      sync.RWMutex
	members []string
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
	return Owner(m.members, uid)
}

// Owns says whether this replica probes uid. Before the first member list
// is known it owns nothing.
func (m *Membership) Owns(uid string) bool { return m.Owner(uid) == m.ID }

// Owner picks uid's owner among members by rendezvous (highest random
// weight) hashing.
func Owner(members []string, uid string) string {
	var best string
	var bestW uint64
	for _, id := range members {
		h := fnv.New64a()
		_, _ = h.Write([]byte(id))
		_, _ = h.Write([]byte{0})
		_, _ = h.Write([]byte(uid))
		w := mix(h.Sum64())
		if best == "" || w > bestW || (w == bestW && id < best) {
			best, bestW = id, w
		}
	}
	return best
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
	_ = bus.Retry(ctx, m.Log, "joining the replica set", func(ctx context.Context) error { return m.run(ctx, js, names) })
	return nil
}

func (m *Membership) run(ctx context.Context, js jetstream.JetStream, names bus.Names) error {
	kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:      Bucket(names),
		Description: "live health replicas; each key expires unless its replica refreshes it",
		TTL:         m.TTL,
		History:     1,
		Storage:     jetstream.MemoryStorage,
	})
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
	m.refresh(ctx, kv)

	// The watcher makes joins and clean leaves visible at once; the
	// heartbeat's listing catches expiries, and covers a watcher that broke
	// until it is rebuilt.
	var updates <-chan jetstream.KeyValueEntry
	var w jetstream.KeyWatcher
	watch := func() {
		var err error
		if w, err = kv.WatchAll(ctx, jetstream.UpdatesOnly()); err != nil {
			if ctx.Err() == nil {
				m.Log.Warn("WARNING: watching the replica set failed; relying on the heartbeat", "error", err)
			}
			w, updates = nil, nil
			return
		}
		updates = w.Updates()
	}
	watch()
	defer func() {
		if w != nil {
			_ = w.Stop()
		}
	}()

	beat := time.NewTicker(m.TTL / 3)
	defer beat.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-updates:
			if !ok {
				if ctx.Err() != nil {
					return nil
				}
				updates = nil
				continue
			}
			if e != nil {
				m.refresh(ctx, kv)
			}
		case <-beat.C:
			if updates == nil {
				watch()
			}
			if _, err := kv.Put(ctx, key, []byte(m.ID)); err != nil && ctx.Err() == nil {
				m.Log.Warn("WARNING: refreshing this replica's membership failed", "error", err)
			}
			m.refresh(ctx, kv)
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

// refresh lists the live keys (expired ones are gone from the bucket).
func (m *Membership) refresh(ctx context.Context, kv jetstream.KeyValue) {
	lister, err := kv.ListKeys(ctx)
	if err != nil {
		if ctx.Err() == nil {
			m.Log.Warn("WARNING: listing the replica set failed", "error", err)
		}
		return
	}
	var ids []string
	for k := range lister.Keys() {
		e, err := kv.Get(ctx, k)
		if err != nil {
			continue
		}
		ids = append(ids, string(e.Value()))
	}
	if !slices.Contains(ids, m.ID) {
		ids = append(ids, m.ID)
	}
	slices.Sort(ids)
	ids = slices.Compact(ids)
	m.mu.Lock()
	changed := !slices.Equal(ids, m.members)
	m.members = ids
	m.mu.Unlock()
	if changed {
		m.Log.Info("health replica set changed", "members", ids, "self", m.ID)
		if m.OnChange != nil {
			m.OnChange(ids)
		}
	}
}
