// Package validate enforces the request rules written in the contracts:
// every buf.validate annotation in proto/ (lengths, patterns, enums,
// ranges, printable text) is checked by one gRPC interceptor before any
// handler runs, on every service, so the rules a client reads in the API are
// exactly the rules applied. A violation is INVALID_ARGUMENT carrying a
// google.rpc.BadRequest that names each offending field; the REST layer
// turns it into HTTP 400 with the same detail.
//
// Rules that need the running configuration or span several fields (a
// provider must be configured, a TTL within the service's bounds, MANAGED
// versus EXTERNAL) stay in Go next to the handlers and report through
// Violations in the same shape.
package validate

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"buf.build/go/protovalidate"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	// The suite's own string rules (egress.validate.v1.printable, ...) must
	// be registered for protovalidate to resolve them.
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/validate/v1"
)

// Validator checks messages against their contract rules. Safe for
// concurrent use; each message type's rules are compiled once, on first use.
type Validator struct {
	pv func() (protovalidate.Validator, error)
}

// contractPrefix begins the name of every message of the suite's contracts
// (proto/egress/...), the only ones that carry rules.
const contractPrefix = "egress."

// New builds a Validator. Its CEL environment is built on the first Check,
// not here: protovalidate registers every proto file linked into the
// binary with it, 1.3 MB of heap that a process serving no validated call
// (a gateway whose gRPC API is not called) never needs
// (docs/benchmarks/gateway.md, run 11). The error is that of the first
// Check's build, a defect of the contracts that every test calling Check
// would show; New itself does not fail.
func New() (*Validator, error) {
	return &Validator{pv: sync.OnceValues(func() (protovalidate.Validator, error) {
		pv, err := protovalidate.New()
		if err != nil {
			return nil, fmt.Errorf("request validation: %w", err)
		}
		return pv, nil
	})}, nil
}

// Check validates msg: nil, or an INVALID_ARGUMENT status whose message
// lists every violation and whose google.rpc.BadRequest names each field
// (protobuf field paths such as spec.placement.zone or labels["team"]).
// Field values are never echoed: some are secrets.
func (v *Validator) Check(msg proto.Message) error {
	if !strings.HasPrefix(string(msg.ProtoReflect().Descriptor().FullName()), contractPrefix) {
		// Not one of the suite's contracts (gRPC health, reflection): no
		// rules, and no reason to build the validator for it.
		return nil
	}
	pv, err := v.pv()
	if err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	err = pv.Validate(msg)
	if err == nil {
		return nil
	}
	var ve *protovalidate.ValidationError
	if !errors.As(err, &ve) {
		// A rule that does not compile is a defect of the contract, not of
		// the request.
		return status.Errorf(codes.Internal, "validating %s: %v", msg.ProtoReflect().Descriptor().FullName(), err)
	}
	var out Violations
	for _, viol := range ve.Violations {
		field := protovalidate.FieldPathString(viol.Proto.GetField())
		if field == "" {
			field = "body"
		}
		desc := viol.Proto.GetMessage()
		if desc == "" {
			desc = "breaks rule " + viol.Proto.GetRuleId()
		}
		out.Add(field, "%s", desc)
	}
	return out.Err()
}

// UnaryServerInterceptor validates every unary request. (The interceptor of
// go-grpc-middleware's protovalidate package attaches buf.validate's own
// Violations detail; clients of this suite read google.rpc.BadRequest, the
// standard detail grpc-gateway and every gRPC client library know.)
func (v *Validator) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if m, ok := req.(proto.Message); ok {
			if err := v.Check(m); err != nil {
				return nil, err
			}
		}
		return handler(ctx, req)
	}
}

// StreamServerInterceptor validates every message a client streams in,
// including the request of a server-streaming call.
func (v *Validator) StreamServerInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		return handler(srv, &checkedStream{ServerStream: ss, v: v})
	}
}

type checkedStream struct {
	grpc.ServerStream
	v *Validator
}

func (s *checkedStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	if msg, ok := m.(proto.Message); ok {
		return s.v.Check(msg)
	}
	return nil
}

// ServerOptions are the gRPC server options that install the interceptors.
func (v *Validator) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(v.UnaryServerInterceptor()),
		grpc.ChainStreamInterceptor(v.StreamServerInterceptor()),
	}
}

// Violations collects field errors found by Go checks, the ones the
// contract annotations cannot express; Err turns them into the same
// INVALID_ARGUMENT shape as the interceptor's.
type Violations []*errdetails.BadRequest_FieldViolation

// Add records a violation of field (a protobuf field path).
func (v *Violations) Add(field, format string, args ...any) {
	*v = append(*v, &errdetails.BadRequest_FieldViolation{Field: field, Description: fmt.Sprintf(format, args...)})
}

// Err is nil without violations; otherwise INVALID_ARGUMENT whose message
// names every field and whose google.rpc.BadRequest lists them.
func (v Violations) Err() error {
	if len(v) == 0 {
		return nil
	}
	parts := make([]string, len(v))
	for i, f := range v {
		parts[i] = f.GetField() + ": " + f.GetDescription()
	}
	st := status.New(codes.InvalidArgument, "invalid request: "+strings.Join(parts, "; "))
	if d, err := st.WithDetails(&errdetails.BadRequest{FieldViolations: v}); err == nil {
		st = d
	}
	return st.Err()
}

// Field returns an INVALID_ARGUMENT naming one field.
func Field(field, format string, args ...any) error {
	var v Violations
	v.Add(field, format, args...)
	return v.Err()
}
