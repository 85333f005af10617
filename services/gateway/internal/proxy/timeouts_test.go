package proxy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// A real server under Serve: connections dropped over the read-header and
// idle timeouts are counted apart, and a served request is not counted.
func TestServeCountsTimedOutConnections(t *testing.T) {
	refusals := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "refusals_total"}, []string{"limit"})
	srv := &http.Server{
		Handler:           http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "ok") }),
		ReadHeaderTimeout: 200 * time.Millisecond,
		IdleTimeout:       300 * time.Millisecond,
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, srv, lis, refusals) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	dial := func() net.Conn {
		c, err := net.Dial("tcp", lis.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	// closed waits for the server to drop c.
	closed := func(c net.Conn) {
		t.Helper()
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.Copy(io.Discard, c); err != nil {
			t.Fatalf("the server did not close the connection: %v", err)
		}
	}
	count := func(limit string) int { return int(testutil.ToFloat64(refusals.WithLabelValues(limit))) }

	stalled := dial()
	fmt.Fprint(stalled, "GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\nX-Slow: ")
	closed(stalled)
	silent := dial()
	closed(silent)
	if got := count("read_header_timeout"); got != 2 {
		t.Fatalf("read_header_timeout = %d, want 2 (a stalled and a silent client)", got)
	}

	keepAlive := dial()
	fmt.Fprint(keepAlive, "GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(keepAlive), nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("a served request: %v %v", resp, err)
	}
	resp.Body.Close()
	closed(keepAlive)
	if got, idle := count("read_header_timeout"), count("client_idle"); got != 2 || idle != 1 {
		t.Fatalf("after an idle keep-alive connection: read_header_timeout = %d, client_idle = %d; want 2 and 1", got, idle)
	}
}
