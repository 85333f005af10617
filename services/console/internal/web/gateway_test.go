package web

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// The gateway's counters, read twice, become rates; a counter that is
// missing, an endpoint that fails and a counter that went down (a
// restart) are said, not guessed.
func TestGatewayRates(t *testing.T) {
	var requests, bytes atomic.Int64
	var fail atomic.Bool
	gw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if fail.Load() {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintf(w, "# TYPE egress_gateway_requests_total counter\negress_gateway_requests_total{client=\"a\"} %d\negress_gateway_requests_total{client=\"b\"} 0\n"+
			"# TYPE egress_gateway_bytes_total counter\negress_gateway_bytes_total{direction=\"up\"} %d\n", requests.Load(), bytes.Load())
	}))
	defer gw.Close()
	g := &GatewayMetrics{URL: gw.URL, Requests: "egress_gateway_requests_total", Bytes: "egress_gateway_bytes_total"}
	ctx := context.Background()
	requests.Store(100)
	bytes.Store(1 << 20)
	if r := g.Rates(ctx); !r.Warming || r.Requests != 100 || r.Error != "" {
		t.Fatalf("first reading %+v, want warming at 100 requests", r)
	}
	g.mu.Lock()
	g.last.at = g.last.at.Add(-2 * time.Second) // as if read two seconds ago
	g.mu.Unlock()
	requests.Store(300)
	bytes.Store(3 << 20)
	r := g.Rates(ctx)
	if r.Warming || r.RequestsPerSecond < 90 || r.RequestsPerSecond > 101 || r.BytesPerSecond < 0.9*(1<<20) {
		t.Errorf("rates %+v, want about 100 req/s and 1 MiB/s", r)
	}
	if again := g.Rates(ctx); again != r {
		t.Errorf("a second page within a second got %+v, want the same rates", again)
	}
	g.mu.Lock()
	g.last.at = g.last.at.Add(-2 * time.Second)
	g.mu.Unlock()
	requests.Store(5) // the gateway restarted
	if r := g.Rates(ctx); r.RequestsPerSecond != 0 || r.Error != "" {
		t.Errorf("after a counter reset %+v, want no rate", r)
	}
	fail.Store(true)
	if r := g.Rates(ctx); !strings.Contains(r.Error, "503") {
		t.Errorf("failing endpoint: %+v", r)
	}
	fail.Store(false)
	missing := &GatewayMetrics{URL: gw.URL, Requests: "egress_gateway_sessions_total", Bytes: "egress_gateway_bytes_total"}
	if r := missing.Rates(ctx); r.Error != "the gateway exports no egress_gateway_sessions_total" {
		t.Errorf("missing counter: %+v", r)
	}
	if got := fmtRate(3<<20, "B"); got != "3.0 MiB/s" {
		t.Errorf("fmtRate = %q", got)
	}
}
