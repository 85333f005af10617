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
// command from NATS never does). An unreachable orchestrator is a
// Transient error; a proxy it does not know is Permanent (the proxy was
// deleted meanwhile). Errors name the proxy, never credentials.
func (r *Runtime) withCredentials(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.CreateInstanceRequest, error) {
	if r.creds == nil || req.GetCredentials() != nil {
		return req, nil
	}
	resp, err := r.creds.GetProxyCredentials(ctx, &proxyv1.GetProxyCredentialsRequest{Uid: req.GetProxyUid()})
	if err != nil {
		class := errclass.Transient
		if status.Code(err) == codes.NotFound {
			class = errclass.Permanent
		}
		return nil, errclass.New(class, "fetching the credentials of proxy %s from the orchestrator: %s", req.GetProxyUid(), status.Convert(err).Message())
	}
	if resp.GetCredentials() == nil {
		return req, nil
	}
	out := proto.Clone(req).(*provisionerv1.CreateInstanceRequest)
	out.Credentials = resp.GetCredentials()
	return out, nil
}
