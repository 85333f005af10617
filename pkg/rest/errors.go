package rest

import (
	"context"
	"net/http"
	"regexp"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ErrorHandler writes every REST error of every service in one shape: the
// google.rpc.Status as JSON ({"code", "message", "details"}), with the HTTP
// status grpc-gateway maps the gRPC code to (INVALID_ARGUMENT 400,
// NOT_FOUND 404, ...). Field errors carry a google.rpc.BadRequest detail
// naming each field, whether the service's validation found them or the
// REST layer could not even decode the request (malformed JSON, a wrong type,
// an unknown field, a bad path or query parameter): those are named after
// the parameter when the decoder says which, "body" otherwise.
func ErrorHandler(ctx context.Context, mux *runtime.ServeMux, m runtime.Marshaler, w http.ResponseWriter, r *http.Request, err error) {
	ErrorHandlerWith(nil)(ctx, mux, m, w, r, err)
}

// ErrorHandlerWith is ErrorHandler with a service's own HTTP status for some
// errors: httpStatus returns the status to use, or 0 for the default
// mapping.
func ErrorHandlerWith(httpStatus func(*status.Status) int) runtime.ErrorHandlerFunc {
	return func(ctx context.Context, mux *runtime.ServeMux, m runtime.Marshaler, w http.ResponseWriter, r *http.Request, err error) {
		if st, ok := status.FromError(err); ok {
			if st.Code() == codes.InvalidArgument && len(st.Details()) == 0 {
				err = decodeError(st)
			}
			if httpStatus != nil {
				if code := httpStatus(st); code != 0 {
					w = &statusOverride{ResponseWriter: w, code: code}
				}
			}
		}
		runtime.DefaultHTTPErrorHandler(ctx, mux, m, w, r, err)
	}
}

// RoutingErrorHandler answers requests that match no route in the same
// shape: 404 NOT_FOUND for an unknown path, 405 (UNIMPLEMENTED in the body)
// for a known path with another method, where grpc-gateway's default says
// 501.
func RoutingErrorHandler(ctx context.Context, mux *runtime.ServeMux, m runtime.Marshaler, w http.ResponseWriter, r *http.Request, httpStatus int) {
	var err error
	switch httpStatus {
	case http.StatusMethodNotAllowed:
		err = status.Errorf(codes.Unimplemented, "method %s is not allowed on %s", r.Method, r.URL.Path)
		w = &statusOverride{ResponseWriter: w, code: http.StatusMethodNotAllowed}
	case http.StatusNotFound:
		err = status.Errorf(codes.NotFound, "no API at %s", r.URL.Path)
	default:
		runtime.DefaultRoutingErrorHandler(ctx, mux, m, w, r, httpStatus)
		return
	}
	runtime.DefaultHTTPErrorHandler(ctx, mux, m, w, r, err)
}

// The field a grpc-gateway or protojson decoding error is about, from the
// wording of their messages (grpc-gateway runtime/query.go and the
// generated handlers; protojson's decoder).
var decodeFieldREs = []*regexp.Regexp{
	regexp.MustCompile(`parsing (?:field|list|map key|map value) "([^"]+)"`),
	regexp.MustCompile(`(?:missing parameter|parameter:) ([A-Za-z0-9_.]+)`),
	regexp.MustCompile(`unknown field "([^"]+)"`),
	regexp.MustCompile(`invalid value for [a-z0-9 ]+ field ([A-Za-z0-9_]+)`),
}

// decodeError adds the BadRequest detail to an INVALID_ARGUMENT the REST layer
// produced while decoding the request.
func decodeError(st *status.Status) error {
	field := "body"
	for _, re := range decodeFieldREs {
		if m := re.FindStringSubmatch(st.Message()); m != nil {
			field = m[1]
			break
		}
	}
	msg := st.Message()
	if len(msg) > 512 {
		msg = msg[:512] + "..."
	}
	out := status.New(codes.InvalidArgument, "invalid request: "+field+": "+msg)
	d, err := out.WithDetails(&errdetails.BadRequest{
		FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: field, Description: msg}},
	})
	if err != nil {
		return out.Err()
	}
	return d.Err()
}

type statusOverride struct {
	http.ResponseWriter
	code int
}

func (w *statusOverride) WriteHeader(int) { w.ResponseWriter.WriteHeader(w.code) }

func (w *statusOverride) Unwrap() http.ResponseWriter { return w.ResponseWriter }
