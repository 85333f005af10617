// Package credentials keeps the credentials health's probes authenticate
// with: fetched from the orchestrator (GetProxyCredentials, with the
// service role) the first time a proxy's credentials are needed and again
// whenever the proxy's credentials time changes, never received on an
// event. They live in memory only, as the probe's ready-made header.
package credentials

import (
	"context"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/health/internal/probe"
)

// Source is the orchestrator's GetProxyCredentials.
type Source interface {
	GetProxyCredentials(ctx context.Context, in *proxyv1.GetProxyCredentialsRequest, opts ...grpc.CallOption) (*proxyv1.GetProxyCredentialsResponse, error)
}

type entry struct {
	at   time.Time
	auth probe.Auth
}

// Cache holds each proxy's probe authentication. Safe for concurrent use.
type Cache struct {
	mu      sync.Mutex
	source  Source
	entries map[string]entry
}

// SetSource sets where credentials come from; until it is set, proxies
// with credentials are probed without them.
func (c *Cache) SetSource(s Source) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.source = s
}

// For returns the authentication for the proxy uid whose credentials were
// made at t (zero: it has none, and the probe sends none). The error names
// the proxy, never the credentials.
func (c *Cache) For(ctx context.Context, uid string, t time.Time) (probe.Auth, error) {
	if t.IsZero() {
		return probe.Auth{}, nil
	}
	c.mu.Lock()
	e, ok := c.entries[uid]
	src := c.source
	c.mu.Unlock()
	if ok && e.at.Equal(t) {
		return e.auth, nil
	}
	if src == nil {
		return probe.Auth{}, nil
	}
	resp, err := src.GetProxyCredentials(ctx, &proxyv1.GetProxyCredentialsRequest{Uid: uid})
	if err != nil {
		return probe.Auth{}, fmt.Errorf("fetching the credentials of proxy %s from the orchestrator: %w", uid, err)
	}
	auth := probe.Auth{}
	if cr := resp.GetCredentials(); cr != nil {
		auth = probe.BasicAuth(cr.GetUsername(), cr.GetPassword())
	}
	at := t
	if ct := resp.GetCredentialsTime(); ct != nil {
		at = ct.AsTime()
	}
	c.mu.Lock()
	if c.entries == nil {
		c.entries = map[string]entry{}
	}
	c.entries[uid] = entry{at: at, auth: auth}
	c.mu.Unlock()
	return auth, nil
}

// Forget drops a proxy's entry (it left the fleet).
func (c *Cache) Forget(uid string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.entries, uid)
}
