package web

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	identityv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/identity/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
)

// Backends are the services' APIs. Every call carries the signed-in
// user's token (never a token of the console's own): each service decides
// what the user may see and do, and the console holds no other truth.
type Backends struct {
	Identity identityv1.IdentityServiceClient
	Proxies  proxyv1.ProxyServiceClient
	Pools    proxyv1.ProxyPoolServiceClient
	Leases   leasev1.LeaseServiceClient
	Health   healthv1.HealthServiceClient
}

// NewBackends builds the clients on connections to the orchestrator, the
// lease service and the health service.
func NewBackends(orchestrator, lease, health *grpc.ClientConn) *Backends {
	return &Backends{
		Identity: identityv1.NewIdentityServiceClient(orchestrator),
		Proxies:  proxyv1.NewProxyServiceClient(orchestrator),
		Pools:    proxyv1.NewProxyPoolServiceClient(orchestrator),
		Leases:   leasev1.NewLeaseServiceClient(lease),
		Health:   healthv1.NewHealthServiceClient(health),
	}
}

// as is the call option that sends the user's token.
func as(sess *session) grpc.CallOption {
	return grpc.PerRPCCredentials(auth.BearerToken(sess.Token))
}

// apiError is a service's refusal as the console shows it: the service's
// own message (it names fields and roles), with the HTTP status that
// matches its code.
type apiError struct {
	Status  int
	Message string
	Code    codes.Code
}

func (e *apiError) Error() string { return e.Message }

// fromAPI turns a call's error into what the user reads; what is the
// service ("the orchestrator").
func fromAPI(what string, err error) *apiError {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.Canceled) {
		return &apiError{Status: 499, Message: "canceled", Code: codes.Canceled}
	}
	st := status.Convert(err)
	e := &apiError{Status: http.StatusBadGateway, Code: st.Code(), Message: st.Message()}
	switch st.Code() {
	case codes.InvalidArgument, codes.OutOfRange:
		e.Status = http.StatusBadRequest
	case codes.FailedPrecondition:
		e.Status = http.StatusConflict
	case codes.AlreadyExists:
		e.Status = http.StatusConflict
	case codes.NotFound:
		e.Status = http.StatusNotFound
	case codes.PermissionDenied:
		e.Status = http.StatusForbidden
		e.Message = what + " refused: " + st.Message()
	case codes.Unauthenticated:
		e.Status = http.StatusUnauthorized
		e.Message = what + " refused the token: " + st.Message()
	case codes.ResourceExhausted:
		e.Status = http.StatusTooManyRequests
	case codes.Unavailable, codes.DeadlineExceeded:
		e.Status = http.StatusServiceUnavailable
		e.Message = fmt.Sprintf("%s cannot be reached: %s", what, st.Message())
	}
	return e
}
