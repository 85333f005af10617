package provisioner

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// CredentialsSource is the orchestrator's GetProxyCredentials, called with
// the service role.
type CredentialsSource interface {
	GetProxyCredentials(ctx context.Context, in *proxyv1.GetProxyCredentialsRequest, opts ...grpc.CallOption) (*proxyv1.GetProxyCredentialsResponse, error)
}

// withCredentials returns req with the proxy's credentials from the
// orchestrator, when the runtime has a source and req carries none (a
// command from NATS never does).
func (r *Runtime) withCredentials(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.CreateInstanceRequest, error) {
	if r.creds == nil || req.GetCredentials() != nil {
		return req, nil
	}
	c, err := r.fetchCredentials(ctx, req.GetProxyUid())
	if err != nil || c == nil {
		return req, err
	}
	out := proto.Clone(req).(*provisionerv1.CreateInstanceRequest)
	out.Credentials = c
	return out, nil
}

// withNewCredentials returns req with the proxy's current credentials from
// the orchestrator when it carries none. A proxy without credentials is a
// Permanent error: an update never opens an instance to everyone.
func (r *Runtime) withNewCredentials(ctx context.Context, req *provisionerv1.UpdateCredentialsRequest) (*provisionerv1.UpdateCredentialsRequest, error) {
	if req.GetCredentials() != nil {
		return req, nil
	}
	var c *proxyv1.ProxyCredentials
	if r.creds != nil {
		var err error
		if c, err = r.fetchCredentials(ctx, req.GetProxyUid()); err != nil {
			return nil, err
		}
	}
	if c == nil {
		return nil, errclass.New(errclass.Permanent, "proxy %s has no credentials to update its instance to", req.GetProxyUid())
	}
	out := proto.Clone(req).(*provisionerv1.UpdateCredentialsRequest)
	out.Credentials = c
	return out, nil
}

// fetchCredentials asks the orchestrator for the proxy's credentials (nil:
// it has none). An unreachable orchestrator is a Transient error; a proxy
// it does not know is Permanent (the proxy was deleted meanwhile). Errors
// name the proxy, never credentials.
func (r *Runtime) fetchCredentials(ctx context.Context, uid string) (*proxyv1.ProxyCredentials, error) {
	resp, err := r.creds.GetProxyCredentials(ctx, &proxyv1.GetProxyCredentialsRequest{Uid: uid})
	if err != nil {
		class := errclass.Transient
		if status.Code(err) == codes.NotFound {
			class = errclass.Permanent
		}
		return nil, errclass.New(class, "fetching the credentials of proxy %s from the orchestrator: %s", uid, status.Convert(err).Message())
	}
	return resp.GetCredentials(), nil
}
