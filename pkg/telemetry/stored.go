package telemetry

import (
	"context"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// TraceParent is ctx's span context as a W3C traceparent value, for work
// that continues later from a stored record (a proxy row claimed by a
// reconcile worker); empty when ctx carries none. Only the IDs are kept,
// never baggage, which could carry anything a caller put in it.
func TraceParent(ctx context.Context) string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ""
	}
	c := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, c)
	return c.Get("traceparent")
}

// WithTraceParent returns ctx continuing the trace of a stored
// traceparent value (a remote parent); ctx unchanged when it is empty or
// malformed.
func WithTraceParent(ctx context.Context, traceParent string) context.Context {
	if traceParent == "" {
		return ctx
	}
	return propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier{"traceparent": traceParent})
}
