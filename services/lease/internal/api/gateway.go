package api

import (
	"context"
	"net/http"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/egress-proxies/egress-proxies/pkg/auth"
)

// GatewayOptions are the lease service's REST gateway options: its error
// handler.
func GatewayOptions() []runtime.ServeMuxOption {
	return []runtime.ServeMuxOption{runtime.WithErrorHandler(ErrorHandler)}
}

// ErrorHandler is the gateway's default error handler, except that
// RESOURCE_EXHAUSTED (no proxy available) is HTTP 409 Conflict, as in the
// original discovery API, rather than 429: nothing is rate-limited, the
// pool is exhausted. The body is the google.rpc.Status with its details, so
// the NoProxyAvailable arithmetic is visible to REST clients. A per-client
// rate limit refusal (also RESOURCE_EXHAUSTED) stays 429, with Retry-After.
//
// A request the gateway itself cannot decode (malformed JSON, an unknown
// field, a value of the wrong type) is INVALID_ARGUMENT naming the field
// "body", like the service's own validation errors.
func ErrorHandler(ctx context.Context, mux *runtime.ServeMux, m runtime.Marshaler, w http.ResponseWriter, r *http.Request, err error) {
	if st, ok := status.FromError(err); ok {
		switch {
		case st.Code() == codes.ResourceExhausted && !auth.IsRateLimited(st):
			w = &statusOverride{ResponseWriter: w, code: http.StatusConflict}
		case st.Code() == codes.InvalidArgument && len(st.Details()) == 0:
			err = invalid("body", st.Message())
		}
	}
	runtime.DefaultHTTPErrorHandler(ctx, mux, m, w, r, err)
}

type statusOverride struct {
	http.ResponseWriter
	code int
}

func (w *statusOverride) WriteHeader(int) { w.ResponseWriter.WriteHeader(w.code) }

func (w *statusOverride) Unwrap() http.ResponseWriter { return w.ResponseWriter }
