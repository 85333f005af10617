// Package telemetry sets up OpenTelemetry tracing from the standard OTEL_*
// environment variables. Trace context always propagates (W3C traceparent
// and baggage), so a trace continues across services even where this
// process exports nothing; spans are exported only when an exporter is
// configured.
package telemetry

import (
	"context"
	"fmt"
	"os"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
)

// Setup installs the global propagator and, when OTEL_TRACES_EXPORTER or an
// OTEL_EXPORTER_OTLP_*ENDPOINT variable is set, a tracer provider exporting
// through it. It returns a function that flushes and stops the provider.
func Setup(ctx context.Context, serviceName string) (func(context.Context) error, error) {
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(
		propagation.TraceContext{}, propagation.Baggage{}))
	if !exporterConfigured() {
		return func(context.Context) error { return nil }, nil
	}
	exp, err := newSpanExporter(ctx)
	if err != nil {
		return nil, err
	}
	res, err := resource.Merge(resource.Default(),
		resource.NewSchemaless(semconv.ServiceName(serviceName)))
	if err != nil {
		return nil, err
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	return tp.Shutdown, nil
}

func exporterConfigured() bool {
	for _, k := range []string{"OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"} {
		if os.Getenv(k) != "" {
			return true
		}
	}
	return false
}

// newSpanExporter is the span exporter OTEL_TRACES_EXPORTER names, as the
// contrib autoexport package chooses it: otlp (the default) over the
// protocol OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL
// names (http/protobuf by default, or grpc), console, or none. Not
// autoexport itself: it links every signal's exporters (metrics and logs
// too, Prometheus among them) and their protobuf descriptors into every
// binary, for traces alone (docs/benchmarks/gateway.md, run 11).
func newSpanExporter(ctx context.Context) (sdktrace.SpanExporter, error) {
	switch name := os.Getenv("OTEL_TRACES_EXPORTER"); name {
	case "", "otlp":
		proto := os.Getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
		if proto == "" {
			proto = os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
		}
		switch proto {
		case "", "http/protobuf":
			return otlptracehttp.New(ctx)
		case "grpc":
			return otlptracegrpc.New(ctx)
		default:
			return nil, fmt.Errorf("OTLP protocol %q: want http/protobuf or grpc", proto)
		}
	case "console":
		return stdouttrace.New()
	case "none":
		return noopExporter{}, nil
	default:
		return nil, fmt.Errorf("OTEL_TRACES_EXPORTER %q: want otlp, console or none", name)
	}
}

// noopExporter drops every span (OTEL_TRACES_EXPORTER=none): spans are
// still made, so logs keep their trace_id, but go nowhere.
type noopExporter struct{}

func (noopExporter) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (noopExporter) Shutdown(context.Context) error                             { return nil }
