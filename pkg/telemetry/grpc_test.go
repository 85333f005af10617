package telemetry

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
)

const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// serveHealth serves grpc.health.v1 with opts on a loopback port and
// returns its address; every call's span context, as the handler sees it,
// goes to the returned channel.
func serveHealth(tb testing.TB, opts ...grpc.ServerOption) (string, <-chan trace.SpanContext) {
	tb.Helper()
	seen := make(chan trace.SpanContext, 1)
	srv := grpc.NewServer(append(opts, grpc.ChainUnaryInterceptor(
		func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
			select {
			case seen <- trace.SpanContextFromContext(ctx):
			default: // benchmarks do not read it
			}
			return next(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, next grpc.StreamHandler) error {
			seen <- trace.SpanContextFromContext(ss.Context())
			return next(srv, ss)
		}))...)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	return grpctest.Serve(tb, srv), seen
}

func dialHealth(tb testing.TB, addr string, opts ...grpc.DialOption) healthpb.HealthClient {
	tb.Helper()
	conn, err := grpc.NewClient(addr, append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = conn.Close() })
	return healthpb.NewHealthClient(conn)
}

func TestDialOptionsPassTraceWithoutExporter(t *testing.T) {
	notExporting(t)
	addr, seen := serveHealth(t, ServerOptions()...)
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithRemoteSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true,
	}))
	traced := dialHealth(t, addr, DialOptions()...)
	if _, err := traced.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	if sc := <-seen; sc.TraceID() != tid || sc.SpanID() != sid {
		t.Errorf("unary: server saw trace %s span %s, want %s %s", sc.TraceID(), sc.SpanID(), tid, sid)
	}
	watch, err := traced.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := watch.Recv(); err != nil {
		t.Fatal(err)
	}
	if sc := <-seen; sc.TraceID() != tid {
		t.Errorf("stream: server saw trace %s, want %s", sc.TraceID(), tid)
	}
	if _, err := traced.Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	if sc := <-seen; sc.IsValid() {
		t.Errorf("untraced call: server saw trace %s, want none", sc.TraceID())
	}
}

func notExporting(t *testing.T) {
	for _, k := range []string{"OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"} {
		t.Setenv(k, "")
	}
	if _, err := Setup(context.Background(), "test"); err != nil {
		t.Fatal(err)
	}
}

func TestServerOptionsContinuesIncomingTraceWithoutExporter(t *testing.T) {
	notExporting(t)
	addr, seen := serveHealth(t, ServerOptions()...)
	client := dialHealth(t, addr)
	ctx := context.Background()

	if _, err := client.Check(metadata.AppendToOutgoingContext(ctx, "traceparent", traceparent), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	sc := <-seen
	if got := sc.TraceID().String(); got != "4bf92f3577b34da6a3ce929d0e0e4736" || !sc.IsRemote() {
		t.Errorf("traced call: handler saw trace %s (remote %v), want the caller's", got, sc.IsRemote())
	}

	if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	if sc := <-seen; sc.IsValid() {
		t.Errorf("untraced call: handler saw trace %s, want none", sc.TraceID())
	}

	watch, err := client.Watch(metadata.AppendToOutgoingContext(ctx, "traceparent", traceparent), &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := watch.Recv(); err != nil {
		t.Fatal(err)
	}
	if got := (<-seen).TraceID().String(); got != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("traced stream: handler saw trace %s, want the caller's", got)
	}
}

func TestServerOptionsRecordsUntracedCallsWhenExporting(t *testing.T) {
	t.Setenv("OTEL_TRACES_EXPORTER", "console")
	rec := tracetest.NewSpanRecorder()
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	t.Cleanup(func() { otel.SetTracerProvider(prev) })

	addr, seen := serveHealth(t, ServerOptions()...)
	client := dialHealth(t, addr)
	if _, err := client.Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	if sc := <-seen; !sc.IsValid() || sc.IsRemote() {
		t.Errorf("handler saw span context %v, want a local root span", sc)
	}
	// The span ends after the response is sent.
	for deadline := time.Now().Add(5 * time.Second); len(rec.Ended()) == 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond) // polling for the span's end
	}
	ended := rec.Ended()
	if len(ended) != 1 || ended[0].Name() != "grpc.health.v1.Health/Check" {
		t.Fatalf("recorded spans %v, want one for grpc.health.v1.Health/Check", ended)
	}
}

// BenchmarkServerOptions compares an untraced unary call (client and
// server on loopback) without tracing, with otelgrpc's stats handler, and
// with ServerOptions when nothing is exported.
//
//	go test -run '^$' -bench ServerOptions -benchmem ./pkg/telemetry/
func BenchmarkServerOptions(b *testing.B) {
	if _, err := Setup(context.Background(), "bench"); err != nil {
		b.Fatal(err)
	}
	for _, bc := range []struct {
		name string
		opts []grpc.ServerOption
	}{
		{"untraced", nil},
		{"otelgrpc", []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler())}},
		{"ServerOptions", ServerOptions()},
	} {
		b.Run(bc.name, func(b *testing.B) {
			addr, _ := serveHealth(b, bc.opts...)
			client := dialHealth(b, addr)
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
