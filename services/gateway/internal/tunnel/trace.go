package tunnel

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/egress-proxies/egress-proxies/services/gateway/internal/access"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/upstream"
)

// The gateway's spans: one per request or tunnel, from the moment its
// caller is known to its end. The lease calls it makes are its children
// (trace context travels with them to the lease service), and each lease
// it went through is an event on it, the last also its attributes. Never
// the caller's token or a proxy's credentials.
var tracer = otel.Tracer("github.com/egress-proxies/egress-proxies/services/gateway")

// StartSpan begins the span of one request or tunnel of kind (forward,
// connect, socks5) to target; the caller ends it.
func StartSpan(ctx context.Context, caller access.Caller, kind, target string) (context.Context, trace.Span) {
	attrs := []attribute.KeyValue{
		attribute.String("egress.client_id", caller.ClientID),
		attribute.String("egress.target", target),
	}
	if caller.Options.Session != "" {
		attrs = append(attrs, attribute.String("egress.session", caller.Options.Session))
	}
	return tracer.Start(ctx, "gateway."+kind, trace.WithSpanKind(trace.SpanKindServer), trace.WithAttributes(attrs...))
}

// traceLease records a lease the request or tunnel of ctx goes through.
func traceLease(ctx context.Context, lease *upstream.Lease) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	attrs := []attribute.KeyValue{
		attribute.String("egress.lease_id", lease.ID),
		attribute.String("egress.proxy", lease.ProxyName),
	}
	if lease.Moved() {
		attrs = append(attrs, attribute.String("egress.session_moved_from", lease.MovedFrom),
			attribute.String("egress.session_move_reason", lease.MoveReason))
	}
	span.AddEvent("lease", trace.WithAttributes(attrs...))
	span.SetAttributes(attrs[:2]...)
}

// TraceFailure marks the span of ctx failed with what the client is told.
func TraceFailure(ctx context.Context, f *Failure) {
	span := trace.SpanFromContext(ctx)
	span.SetAttributes(attribute.String("egress.outcome", f.Outcome))
	span.SetStatus(codes.Error, f.Message)
}
