// Package session is this replica's view of the sessions it served: which
// lease (and proxy) each is on, how often it moved, and its request and
// byte counts. The lease service is the one truth of which proxy a session
// is on; this view adds the accounting and forgets a session once its
// lifetime has passed without a request.
package session

import (
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Key names a session: a client's session id.
type Key struct{ ClientID, ID string }

// Session is one session as this replica saw it.
type Session struct {
	Key        Key
	LeaseKey   string
	LeaseID    string
	ProxyName  string
	ProxyAddr  string
	Pool       string
	Lifetime   time.Duration
	Created    time.Time
	LastUsed   time.Time
	Moves      int64
	LastMove   string // the reason of the last move
	Requests   int64
	BytesUp    int64
	BytesDown  int64
	ActiveConn int64
}

// Registry holds the sessions.
type Registry struct {
	mu        sync.Mutex
	sessions  map[Key]*entry
	now       func() time.Time
	lastSweep time.Time
}

type entry struct {
	Session
	up, down, reqs, active atomic.Int64
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	return &Registry{sessions: map[Key]*entry{}, now: time.Now}
}

// Use records a request or tunnel of the session on a lease and returns
// the counters to add its bytes to.
func (r *Registry) Use(k Key, leaseKey, leaseID, proxyName, proxyAddr, pool string, lifetime time.Duration, moveReason string) *Counters {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	if now.Sub(r.lastSweep) > 10*time.Second {
		r.lastSweep = now
		r.expire()
	}
	e, ok := r.sessions[k]
	if !ok {
		e = &entry{Session: Session{Key: k, Created: now}}
		r.sessions[k] = e
	}
	if moveReason != "" {
		e.Moves++
		e.LastMove = moveReason
	}
	e.LeaseKey, e.LeaseID, e.ProxyName, e.ProxyAddr, e.Pool, e.Lifetime, e.LastUsed =
		leaseKey, leaseID, proxyName, proxyAddr, pool, lifetime, now
	e.reqs.Add(1)
	e.active.Add(1)
	return &Counters{e: e}
}

// Counters add bytes to a session.
type Counters struct{ e *entry }

// Add counts bytes up and down; nil counters count nothing.
func (c *Counters) Add(up, down int64) {
	if c == nil {
		return
	}
	c.e.up.Add(up)
	c.e.down.Add(down)
}

// Done ends a request or tunnel of the session.
func (c *Counters) Done() {
	if c != nil {
		c.e.active.Add(-1)
	}
}

// Get returns a session.
func (r *Registry) Get(k Key) (Session, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.expire()
	e, ok := r.sessions[k]
	if !ok {
		return Session{}, false
	}
	return e.snapshot(), true
}

// List returns the sessions of client (every client's when empty), by
// client and id.
func (r *Registry) List(client string) []Session {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.expire()
	var out []Session
	for k, e := range r.sessions {
		if client == "" || k.ClientID == client {
			out = append(out, e.snapshot())
		}
	}
	slices.SortFunc(out, func(a, b Session) int {
		if c := strings.Compare(a.Key.ClientID, b.Key.ClientID); c != 0 {
			return c
		}
		return strings.Compare(a.Key.ID, b.Key.ID)
	})
	return out
}

// Forget drops a session (ended through the API).
func (r *Registry) Forget(k Key) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.sessions, k)
}

// ByLease finds the session on lease id.
func (r *Registry) ByLease(leaseID string) (Session, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.sessions {
		if e.LeaseID == leaseID {
			return e.snapshot(), true
		}
	}
	return Session{}, false
}

// expire drops sessions idle past their lifetime with nothing open.
func (r *Registry) expire() {
	now := r.now()
	for k, e := range r.sessions {
		if e.active.Load() == 0 && now.Sub(e.LastUsed) > e.Lifetime {
			delete(r.sessions, k)
		}
	}
}

func (e *entry) snapshot() Session {
	s := e.Session
	s.Requests, s.BytesUp, s.BytesDown, s.ActiveConn = e.reqs.Load(), e.up.Load(), e.down.Load(), e.active.Load()
	return s
}
