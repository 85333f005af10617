// Package rest holds the suite's one grpc-gateway configuration (the REST layer), so every
// service's REST API encodes JSON the same way: lowerCamelCase field names,
// every field present in responses, enums by name, and unknown fields in a
// request body rejected rather than silently dropped; and one error shape
// (ErrorHandler).
package rest

import (
	"net/textproto"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/protobuf/encoding/protojson"
)

// Marshaler is the JSON encoding of the REST API.
func Marshaler() runtime.Marshaler {
	return &runtime.HTTPBodyMarshaler{
		Marshaler: &runtime.JSONPb{
			MarshalOptions: protojson.MarshalOptions{
				EmitUnpopulated: true,
			},
			UnmarshalOptions: protojson.UnmarshalOptions{
				DiscardUnknown: false,
			},
		},
	}
}

// NewServeMux returns a grpc-gateway mux using Marshaler for every content type
// and ErrorHandler and RoutingErrorHandler for every error (streaming
// calls write the same google.rpc.Status as {"error": ...} on their line),
// with any extra options (a service's
// ErrorHandlerWith, header matchers) applied after.
func NewServeMux(opts ...runtime.ServeMuxOption) *runtime.ServeMux {
	base := []runtime.ServeMuxOption{
		runtime.WithMarshalerOption(runtime.MIMEWildcard, Marshaler()),
		runtime.WithOutgoingHeaderMatcher(OutgoingHeader),
		runtime.WithErrorHandler(ErrorHandler),
		runtime.WithRoutingErrorHandler(RoutingErrorHandler),
	}
	return runtime.NewServeMux(append(base, opts...)...)
}

// OutgoingHeader maps gRPC response metadata to HTTP headers: retry-after
// (set with RESOURCE_EXHAUSTED by a rate limit) becomes Retry-After, the
// rest keep the REST layer's Grpc-Metadata- prefix.
func OutgoingHeader(key string) (string, bool) {
	if textproto.CanonicalMIMEHeaderKey(key) == "Retry-After" {
		return "Retry-After", true
	}
	return runtime.MetadataHeaderPrefix + key, true
}
