package telemetry

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// OTEL_TRACES_EXPORTER and the OTLP protocol variables choose the exporter
// as the contrib autoexport package does; a value it would refuse is an
// error. An OTLP exporter is made to send a span to a listener here, and
// the first line it sends says which protocol it speaks: HTTP/2's preface
// for grpc, a POST to /v1/traces for http/protobuf.
func TestNewSpanExporter(t *testing.T) {
	const (
		grpcWire = "PRI * HTTP/2.0"
		httpWire = "POST /v1/traces HTTP/1.1"
	)
	for _, tc := range []struct {
		exporter, protocol, tracesProtocol string
		want                               string // the exporter's type, "" for an error
		wire                               string // the first line an OTLP exporter sends
	}{
		{want: "*otlptrace.Exporter", wire: httpWire},
		{exporter: "otlp", protocol: "grpc", want: "*otlptrace.Exporter", wire: grpcWire},
		{exporter: "otlp", protocol: "grpc", tracesProtocol: "http/protobuf", want: "*otlptrace.Exporter", wire: httpWire},
		{exporter: "otlp", tracesProtocol: "grpc", want: "*otlptrace.Exporter", wire: grpcWire},
		{exporter: "otlp", protocol: "http/json"},
		{exporter: "console", want: "*stdouttrace.Exporter"},
		{exporter: "none", want: "telemetry.noopExporter"},
		{exporter: "zipkin"},
	} {
		t.Run(fmt.Sprintf("%s,%s,%s", tc.exporter, tc.protocol, tc.tracesProtocol), func(t *testing.T) {
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer lis.Close()
			first := make(chan string, 1)
			go func() {
				c, err := lis.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
				line, _ := bufio.NewReader(c).ReadString('\n')
				first <- strings.TrimSpace(line)
			}()
			t.Setenv("OTEL_TRACES_EXPORTER", tc.exporter)
			t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", tc.protocol)
			t.Setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", tc.tracesProtocol)
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+lis.Addr().String())
			t.Setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
			exp, err := newSpanExporter(context.Background())
			got := ""
			if err == nil {
				got = fmt.Sprintf("%T", exp)
			}
			if got != tc.want {
				t.Fatalf("exporter %s (error %v), want %q", got, err, tc.want)
			}
			if exp == nil {
				return
			}
			defer func() { _ = exp.Shutdown(context.Background()) }()
			if tc.wire == "" {
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			// The listener answers nothing: the export fails by its
			// deadline, after its first line was read.
			_ = exp.ExportSpans(ctx, tracetest.SpanStubs{{Name: "probe"}}.Snapshots())
			select {
			case line := <-first:
				if line != tc.wire {
					t.Errorf("the exporter sent %q first, want %q", line, tc.wire)
				}
			case <-time.After(10 * time.Second):
				t.Error("the exporter sent nothing to OTEL_EXPORTER_OTLP_ENDPOINT")
			}
		})
	}
}
