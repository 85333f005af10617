package telemetry

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/baggage"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// A stored traceparent continues the trace it was taken from, keeps only
// the IDs (never baggage), and nothing or garbage continues nothing.
func TestStoredTraceParent(t *testing.T) {
	t.Parallel()
	tp := sdktrace.NewTracerProvider()
	defer func() { _ = tp.Shutdown(context.Background()) }()
	member, _ := baggage.NewMember("user", "secret")
	bag, _ := baggage.New(member)
	ctx, span := tp.Tracer("t").Start(baggage.ContextWithBaggage(context.Background(), bag), "call")
	defer span.End()

	stored := TraceParent(ctx)
	if stored == "" || len(stored) != 55 {
		t.Fatalf("TraceParent = %q, want a W3C traceparent", stored)
	}
	continued := WithTraceParent(context.Background(), stored)
	if baggage.FromContext(continued).Len() != 0 {
		t.Error("the caller's baggage was stored")
	}
	got := trace.SpanContextFromContext(continued)
	if got.TraceID() != span.SpanContext().TraceID() || got.SpanID() != span.SpanContext().SpanID() || !got.IsRemote() {
		t.Errorf("continued %v, want the remote parent %v", got, span.SpanContext())
	}
	for _, tc := range []struct{ name, stored string }{{"empty", ""}, {"garbage", "00-zz-yy-01"}} {
		if sc := trace.SpanContextFromContext(WithTraceParent(context.Background(), tc.stored)); sc.IsValid() {
			t.Errorf("%s: continued %v, want nothing", tc.name, sc)
		}
	}
	if TraceParent(context.Background()) != "" {
		t.Error("a context without a span stored a traceparent")
	}
}
