package api

import (
	"context"
	"net"
	"net/url"
	"strconv"
	"sync"

	"google.golang.org/grpc"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
)

// CredentialsSource fetches a proxy's credentials from the orchestrator,
// with the service role: the orchestrator's GetProxyCredentials.
type CredentialsSource interface {
	GetProxyCredentials(ctx context.Context, in *proxyv1.GetProxyCredentialsRequest, opts ...grpc.CallOption) (*proxyv1.GetProxyCredentialsResponse, error)
}

// CredentialsCache keeps each proxy's answer from the orchestrator, so
// that an acquire does not wait for a call to the orchestrator: an entry
// lives until the mirror applies a newer snapshot of its proxy (Forget),
// which every change of its credentials brings (a rotation makes the proxy
// not Ready in the same write; an EXTERNAL proxy's new credentials come
// with its update). The credentials stay in this process's memory only.
// Safe for concurrent use.
type CredentialsCache struct {
	mu      sync.Mutex
	entries map[string]*proxyv1.GetProxyCredentialsResponse
	// gen counts Forget calls per proxy ("" for all), so that an answer
	// fetched across a Forget is not kept.
	gen map[string]uint64
	all uint64
}

// NewCredentialsCache returns an empty cache.
func NewCredentialsCache() *CredentialsCache {
	return &CredentialsCache{entries: map[string]*proxyv1.GetProxyCredentialsResponse{}, gen: map[string]uint64{}}
}

// Forget drops the proxy uid's entry; "" drops every entry.
func (c *CredentialsCache) Forget(uid string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if uid == "" {
		c.all++
		clear(c.entries)
		return
	}
	c.gen[uid]++
	delete(c.entries, uid)
}

func (c *CredentialsCache) get(uid string) (resp *proxyv1.GetProxyCredentialsResponse, gen [2]uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.entries[uid], [2]uint64{c.gen[uid], c.all}
}

func (c *CredentialsCache) put(uid string, gen [2]uint64, resp *proxyv1.GetProxyCredentialsResponse) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gen[uid] == gen[0] && c.all == gen[1] {
		c.entries[uid] = resp
	}
}

// credentialsFor returns the credentials the caller may be given for the
// proxy uid: none when the proxy has none, when the lease service has no
// source, or when the proxy is marked service-only and the caller lacks
// the service role. The orchestrator is asked once per proxy snapshot
// (CredentialsCache).
func (s *Server) credentialsFor(ctx context.Context, uid string) (*proxyv1.ProxyCredentials, error) {
	if s.Credentials == nil {
		return nil, nil
	}
	var resp *proxyv1.GetProxyCredentialsResponse
	var gen [2]uint64
	if s.CredentialsCache != nil {
		resp, gen = s.CredentialsCache.get(uid)
	}
	if resp == nil {
		var err error
		if resp, err = s.Credentials.GetProxyCredentials(ctx, &proxyv1.GetProxyCredentialsRequest{Uid: uid}); err != nil {
			return nil, err
		}
		if s.CredentialsCache != nil {
			s.CredentialsCache.put(uid, gen, resp)
		}
	}
	if resp.GetServiceOnly() && !auth.HasRole(ctx, auth.Service) {
		return nil, nil
	}
	return resp.GetCredentials(), nil
}

// proxyURL is the proxy at host:port as a URL, with c in it when set.
func proxyURL(host string, port uint32, c *proxyv1.ProxyCredentials) string {
	u := url.URL{Scheme: "http", Host: net.JoinHostPort(host, strconv.FormatUint(uint64(port), 10))}
	if c != nil {
		u.User = url.UserPassword(c.GetUsername(), c.GetPassword())
	}
	return u.String()
}
