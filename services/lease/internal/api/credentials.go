package api

import (
	"context"
	"net"
	"net/url"
	"strconv"

	"google.golang.org/grpc"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
)

// CredentialsSource fetches a proxy's credentials from the orchestrator,
// with the service role: the orchestrator's GetProxyCredentials.
type CredentialsSource interface {
	GetProxyCredentials(ctx context.Context, in *proxyv1.GetProxyCredentialsRequest, opts ...grpc.CallOption) (*proxyv1.GetProxyCredentialsResponse, error)
}

// credentialsFor returns the credentials the caller may be given for the
// proxy uid: none when the proxy has none, when the lease service has no
// source, or when the proxy is marked service-only and the caller lacks
// the service role.
func (s *Server) credentialsFor(ctx context.Context, uid string) (*proxyv1.ProxyCredentials, error) {
	if s.Credentials == nil {
		return nil, nil
	}
	resp, err := s.Credentials.GetProxyCredentials(ctx, &proxyv1.GetProxyCredentialsRequest{Uid: uid})
	if err != nil {
		return nil, err
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
