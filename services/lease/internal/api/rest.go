package api

import (
	"net/http"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/pkg/rest"
)

// RESTOptions are the lease service's REST options: the suite's
// error handler, except that no proxy available (RESOURCE_EXHAUSTED
// carrying NoProxyAvailable) is HTTP 409 Conflict rather than 429:
// nothing is rate-limited, every matching proxy is taken. The body is the google.rpc.Status with its details, so the
// NoProxyAvailable arithmetic is visible to REST clients.
func RESTOptions() []runtime.ServeMuxOption {
	return []runtime.ServeMuxOption{runtime.WithErrorHandler(rest.ErrorHandlerWith(noProxyConflict))}
}

func noProxyConflict(st *status.Status) int {
	if st.Code() != codes.ResourceExhausted {
		return 0
	}
	for _, d := range st.Details() {
		if _, ok := d.(*leasev1.NoProxyAvailable); ok {
			return http.StatusConflict
		}
	}
	return 0
}
