package web

import (
	"context"
	"errors"
	"io"
	"strconv"
	"time"

	"github.com/cenkalti/backoff/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// The feeds follow the services' state for one open page: a listing,
// then the service's watch stream from the listing on. What they hold
// lives only as long as the page's event stream; the services stay the
// only truth.

// listProxies reads every proxy, page by page, with the revision of the
// listing.
func (s *Server) listProxies(ctx context.Context, sess *session, req *proxyv1.ListProxiesRequest) ([]*proxyv1.Proxy, int64, error) {
	var out []*proxyv1.Proxy
	rev, err := s.pageProxies(ctx, sess, req, func(ps []*proxyv1.Proxy, _ bool) { out = append(out, ps...) })
	return out, rev, err
}

// pageProxies hands every page of the listing to page as it arrives (last
// is true for the last one) and returns the listing's revision.
func (s *Server) pageProxies(ctx context.Context, sess *session, req *proxyv1.ListProxiesRequest, page func(ps []*proxyv1.Proxy, last bool)) (int64, error) {
	var rev int64
	req.PageSize = 1000
	req.PageToken = ""
	for {
		resp, err := s.api.Proxies.ListProxies(ctx, req, as(sess))
		if err != nil {
			return 0, fromAPI("the orchestrator", err)
		}
		if rev == 0 {
			rev = resp.GetRevision()
		}
		req.PageToken = resp.GetNextPageToken()
		page(resp.GetProxies(), req.PageToken == "")
		if req.PageToken == "" {
			return rev, nil
		}
	}
}

// allPages reads a paginated listing to its end: fetch returns one page
// and the next page's token ("" after the last).
func allPages[T any](fetch func(token string) ([]T, string, error)) ([]T, error) {
	var out []T
	token := ""
	for {
		page, next, err := fetch(token)
		if err != nil {
			return nil, err
		}
		out = append(out, page...)
		if token = next; token == "" {
			return out, nil
		}
	}
}

func (s *Server) listPools(ctx context.Context, sess *session) ([]*proxyv1.ProxyPool, int64, error) {
	var rev int64
	pools, err := allPages(func(token string) ([]*proxyv1.ProxyPool, string, error) {
		resp, err := s.api.Pools.ListProxyPools(ctx, &proxyv1.ListProxyPoolsRequest{PageSize: 1000, PageToken: token}, as(sess))
		if err != nil {
			return nil, "", fromAPI("the orchestrator", err)
		}
		if rev == 0 {
			rev = resp.GetRevision()
		}
		return resp.GetPools(), resp.GetNextPageToken(), nil
	})
	return pools, rev, err
}

func (s *Server) listLeases(ctx context.Context, sess *session, req *leasev1.ListLeasesRequest) ([]*leasev1.Lease, error) {
	req.PageSize = 1000
	return allPages(func(token string) ([]*leasev1.Lease, string, error) {
		req.PageToken = token
		resp, err := s.api.Leases.ListLeases(ctx, req, as(sess))
		if err != nil {
			return nil, "", fromAPI("the lease service", err)
		}
		return resp.GetLeases(), resp.GetNextPageToken(), nil
	})
}

func (s *Server) listCooldowns(ctx context.Context, sess *session, req *leasev1.ListCooldownsRequest) ([]*leasev1.ProxyCooldown, error) {
	req.PageSize = 1000
	return allPages(func(token string) ([]*leasev1.ProxyCooldown, string, error) {
		req.PageToken = token
		resp, err := s.api.Leases.ListCooldowns(ctx, req, as(sess))
		if err != nil {
			return nil, "", fromAPI("the lease service", err)
		}
		return resp.GetCooldowns(), resp.GetNextPageToken(), nil
	})
}

func (s *Server) listProviderHealth(ctx context.Context, sess *session) ([]*healthv1.ProviderHealth, error) {
	resp, err := s.api.Health.ListProviderHealth(ctx, &healthv1.ListProviderHealthRequest{}, as(sess))
	if err != nil {
		return nil, fromAPI("the health service", err)
	}
	return resp.GetProviders(), nil
}

// retry runs follow until ctx ends, again after each failure with a
// backoff (1s doubling to 30s); report is told each failure and each
// recovery (nil), for the page's status line.
func retry(ctx context.Context, report func(error), follow func(context.Context) error) {
	b := &backoff.ExponentialBackOff{InitialInterval: time.Second, RandomizationFactor: 0.2, Multiplier: 2, MaxInterval: 30 * time.Second}
	for ctx.Err() == nil {
		err := follow(ctx)
		if ctx.Err() != nil {
			return
		}
		report(err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(b.NextBackOff()):
		}
	}
}

// watchProxies lists the proxies matching req, hands them to reset, then
// hands every change to apply until the stream ends. It returns the
// stream's error (nil never: a stream ends only with an error or ctx).
func (s *Server) watchProxies(ctx context.Context, sess *session, req *proxyv1.ListProxiesRequest,
	reset func([]*proxyv1.Proxy), apply func(*proxyv1.WatchProxiesResponse)) error {
	var proxies []*proxyv1.Proxy
	return s.watchProxyPages(ctx, sess, req, func(ps []*proxyv1.Proxy, last bool) {
		if proxies = append(proxies, ps...); last {
			reset(proxies)
		}
	}, apply)
}

// watchProxyPages is watchProxies handing the listing over page by page.
func (s *Server) watchProxyPages(ctx context.Context, sess *session, req *proxyv1.ListProxiesRequest,
	page func(ps []*proxyv1.Proxy, last bool), apply func(*proxyv1.WatchProxiesResponse)) error {
	rev, err := s.pageProxies(ctx, sess, req, page)
	if err != nil {
		return err
	}
	st, err := s.api.Proxies.WatchProxies(ctx, &proxyv1.WatchProxiesRequest{SinceRevision: rev, Provider: req.GetProvider()}, as(sess))
	if err != nil {
		return fromAPI("the orchestrator", err)
	}
	for {
		c, err := st.Recv()
		if err != nil {
			return streamEnd("the orchestrator", err)
		}
		apply(c)
	}
}

func (s *Server) watchPools(ctx context.Context, sess *session, reset func([]*proxyv1.ProxyPool), apply func(*proxyv1.WatchProxyPoolsResponse)) error {
	pools, rev, err := s.listPools(ctx, sess)
	if err != nil {
		return err
	}
	reset(pools)
	st, err := s.api.Pools.WatchProxyPools(ctx, &proxyv1.WatchProxyPoolsRequest{SinceRevision: rev}, as(sess))
	if err != nil {
		return fromAPI("the orchestrator", err)
	}
	for {
		c, err := st.Recv()
		if err != nil {
			return streamEnd("the orchestrator", err)
		}
		apply(c)
	}
}

// watchLeases opens the lease watch first and lists once it is in place
// (its ready header), so no change between the two is missed; a change
// that the listing already shows is applied again, harmlessly.
func (s *Server) watchLeases(ctx context.Context, sess *session, req *leasev1.ListLeasesRequest,
	reset func([]*leasev1.Lease), apply func(*leasev1.WatchLeasesResponse)) error {
	st, err := s.api.Leases.WatchLeases(ctx, &leasev1.WatchLeasesRequest{}, as(sess))
	if err != nil {
		return fromAPI("the lease service", err)
	}
	if _, err := st.Header(); err != nil {
		return fromAPI("the lease service", err)
	}
	leases, err := s.listLeases(ctx, sess, req)
	if err != nil {
		return err
	}
	reset(leases)
	for {
		c, err := st.Recv()
		if err != nil {
			return streamEnd("the lease service", err)
		}
		apply(c)
	}
}

func streamEnd(what string, err error) error {
	if errors.Is(err, io.EOF) {
		return &apiError{Message: what + " ended the watch", Code: codes.Unavailable}
	}
	if status.Code(err) == codes.OutOfRange {
		return &apiError{Message: what + ": the watch fell behind the retained changes; listing again", Code: codes.OutOfRange}
	}
	return fromAPI(what, err)
}

func revString(n int64) string { return strconv.FormatInt(n, 10) }
