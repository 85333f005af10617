package telemetry

import (
	"context"
	"fmt"
	"testing"
)

// OTEL_TRACES_EXPORTER and the OTLP protocol variables choose the exporter
// as the contrib autoexport package does; a value it would refuse is an
// error.
func TestNewSpanExporter(t *testing.T) {
	for _, tc := range []struct {
		exporter, protocol, tracesProtocol string
		want                               string // the exporter's type, "" for an error
	}{
		{want: "*otlptrace.Exporter"},
		{exporter: "otlp", protocol: "grpc", want: "*otlptrace.Exporter"},
		{exporter: "otlp", protocol: "grpc", tracesProtocol: "http/protobuf", want: "*otlptrace.Exporter"},
		{exporter: "otlp", protocol: "http/json"},
		{exporter: "console", want: "*stdouttrace.Exporter"},
		{exporter: "none", want: "telemetry.noopExporter"},
		{exporter: "zipkin"},
	} {
		t.Run(fmt.Sprintf("%s,%s,%s", tc.exporter, tc.protocol, tc.tracesProtocol), func(t *testing.T) {
			t.Setenv("OTEL_TRACES_EXPORTER", tc.exporter)
			t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", tc.protocol)
			t.Setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", tc.tracesProtocol)
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
			exp, err := newSpanExporter(context.Background())
			got := ""
			if err == nil {
				got = fmt.Sprintf("%T", exp)
				_ = exp.Shutdown(context.Background())
			}
			if got != tc.want {
				t.Errorf("exporter %s (error %v), want %q", got, err, tc.want)
			}
		})
	}
}
