// Package errclass is the suite's error taxonomy: every provisioner failure is
// NotFound, Permanent, Transient, QuotaExceeded or Unsupported. A backend classifies an
// error once, where it happens, with New or Wrap; the class then travels
// unchanged as a gRPC status with a google.rpc.ErrorInfo (ToStatus /
// FromStatus) and as a NATS CommandError (ToCommandError /
// FromCommandError), and the orchestrator's reconcile rules read it with Of.
package errclass

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Class is an error class, the proto enum itself so that no second list can
// drift from the contract.
type Class = provisionerv1.ErrorReason

// The classes.
const (
	NotFound      = provisionerv1.ErrorReason_ERROR_REASON_NOT_FOUND
	Permanent     = provisionerv1.ErrorReason_ERROR_REASON_PERMANENT
	Transient     = provisionerv1.ErrorReason_ERROR_REASON_TRANSIENT
	QuotaExceeded = provisionerv1.ErrorReason_ERROR_REASON_QUOTA_EXCEEDED
	Unsupported   = provisionerv1.ErrorReason_ERROR_REASON_UNSUPPORTED
)

// Domain is the google.rpc.ErrorInfo domain of classified errors.
const Domain = "provisioner.egress-proxies.dev"

// Error is a classified error. Message is what clients see; it must never
// contain a secret. Err, when set, is the cause, kept for errors.Is/As and
// for logs on the side that classified it: it does not cross the wire.
type Error struct {
	Class    Class
	Message  string
	Metadata map[string]string
	Err      error
}

func (e *Error) Error() string { return e.Message }

func (e *Error) Unwrap() error { return e.Err }

// New returns a classified error with a formatted message.
func New(class Class, format string, args ...any) *Error {
	return &Error{Class: class, Message: fmt.Sprintf(format, args...)}
}

// Wrap classifies err, using its text as the message. It returns nil for a
// nil err.
func Wrap(class Class, err error) error {
	if err == nil {
		return nil
	}
	return &Error{Class: class, Message: err.Error(), Err: err}
}

// WithMetadata returns a copy of e carrying the given key/value pairs too.
func (e *Error) WithMetadata(kv ...string) *Error {
	out := *e
	out.Metadata = maps.Clone(e.Metadata)
	if out.Metadata == nil {
		out.Metadata = make(map[string]string, len(kv)/2)
	}
	for i := 0; i+1 < len(kv); i += 2 {
		out.Metadata[kv[i]] = kv[i+1]
	}
	return &out
}

// Of returns err's class. nil has none (ERROR_REASON_UNSPECIFIED). An error
// nobody classified is Transient, deliberately: retrying an unknown failure
// is safer than latching a proxy as Failed on a guess.
func Of(err error) Class {
	if err == nil {
		return provisionerv1.ErrorReason_ERROR_REASON_UNSPECIFIED
	}
	var e *Error
	if errors.As(err, &e) && e.Class != provisionerv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
		return e.Class
	}
	return Transient
}

// Is reports whether err has class c.
func Is(err error, c Class) bool { return err != nil && Of(err) == c }

// codeFor maps a class onto the gRPC code a generic client expects.
func codeFor(c Class) codes.Code {
	switch c {
	case NotFound:
		return codes.NotFound
	case Permanent:
		return codes.FailedPrecondition
	case QuotaExceeded:
		return codes.ResourceExhausted
	case Unsupported:
		return codes.Unimplemented
	default:
		return codes.Unavailable
	}
}

// ToStatus converts err to a gRPC status: the class's code and an ErrorInfo
// whose reason is the class name. Every failure carries the reason, so a
// client reads the class the same way over gRPC as from a NATS result.
// A context error nobody classified keeps its own code (Canceled,
// DeadlineExceeded), so a generic client is not told the backend failed,
// and still carries its reason (Transient); a classified error that wraps
// one (a request that ran out of its per-request budget) takes its class's
// code.
func ToStatus(err error) *status.Status {
	if err == nil {
		return status.New(codes.OK, "")
	}
	class := Of(err)
	var md map[string]string
	var e *Error
	classified := errors.As(err, &e) && e.Class != provisionerv1.ErrorReason_ERROR_REASON_UNSPECIFIED
	if classified {
		md = validMetadata(e.Metadata)
	}
	code := codeFor(class)
	switch {
	case classified:
	case errors.Is(err, context.Canceled):
		code = codes.Canceled
	case errors.Is(err, context.DeadlineExceeded):
		code = codes.DeadlineExceeded
	}
	st := status.New(code, messageOf(err))
	withInfo, derr := st.WithDetails(&errdetails.ErrorInfo{
		Reason:   class.String(),
		Domain:   Domain,
		Metadata: md,
	})
	if derr != nil {
		return st
	}
	return withInfo
}

// FromStatus turns a gRPC error back into a classified error. A status with
// our ErrorInfo keeps its class (and a Canceled or DeadlineExceeded one
// still matches the context error with errors.Is); without it, Canceled and
// DeadlineExceeded become the context errors and anything else is
// classified from its code (NotFound, ResourceExhausted,
// FailedPrecondition/InvalidArgument as Permanent, Unimplemented as
// Unsupported, the rest Transient).
func FromStatus(err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return Wrap(Transient, err)
	}
	var ctxErr error
	switch st.Code() {
	case codes.Canceled:
		ctxErr = context.Canceled
	case codes.DeadlineExceeded:
		ctxErr = context.DeadlineExceeded
	}
	for _, d := range st.Details() {
		info, ok := d.(*errdetails.ErrorInfo)
		if !ok || info.GetDomain() != Domain {
			continue
		}
		if v, ok := provisionerv1.ErrorReason_value[info.GetReason()]; ok && v != 0 {
			return &Error{Class: Class(v), Message: st.Message(), Metadata: info.GetMetadata(), Err: ctxErr}
		}
	}
	if ctxErr != nil {
		return fmt.Errorf("%s: %w", st.Message(), ctxErr)
	}
	var class Class
	switch st.Code() {
	case codes.NotFound:
		class = NotFound
	case codes.ResourceExhausted:
		class = QuotaExceeded
	case codes.Unimplemented:
		class = Unsupported
	case codes.FailedPrecondition, codes.InvalidArgument, codes.PermissionDenied, codes.Unauthenticated:
		class = Permanent
	default:
		class = Transient
	}
	return &Error{Class: class, Message: st.Message()}
}

// ToCommandError converts err for a NATS CommandResult.
func ToCommandError(err error) *busv1.CommandError {
	if err == nil {
		return nil
	}
	ce := &busv1.CommandError{Reason: Of(err), Message: messageOf(err)}
	var e *Error
	if errors.As(err, &e) {
		ce.Metadata = validMetadata(e.Metadata)
	}
	return ce
}

// messageOf is err's text as a protobuf string may hold it: a backend's
// error text is copied as it came, and an invalid UTF-8 sequence in it
// would make the whole status or result fail to encode.
func messageOf(err error) string { return strings.ToValidUTF8(err.Error(), "\uFFFD") }

// validMetadata is a copy of md with every key and value valid UTF-8.
func validMetadata(md map[string]string) map[string]string {
	if md == nil {
		return nil
	}
	out := make(map[string]string, len(md))
	for k, v := range md {
		out[strings.ToValidUTF8(k, "\uFFFD")] = strings.ToValidUTF8(v, "\uFFFD")
	}
	return out
}

// FromCommandError turns a CommandError back into a classified error.
func FromCommandError(ce *busv1.CommandError) error {
	if ce == nil {
		return nil
	}
	class := ce.GetReason()
	if class == provisionerv1.ErrorReason_ERROR_REASON_UNSPECIFIED {
		class = Transient
	}
	return &Error{Class: class, Message: ce.GetMessage(), Metadata: maps.Clone(ce.GetMetadata())}
}
