package tunnel

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"io"
	"log/slog"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/egress-proxies/egress-proxies/services/gateway/internal/metrics"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/upstream"
)

// tcpPair is two ends of one loopback TCP connection.
func tcpPair(t testing.TB) (net.Conn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	a, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b := <-accepted
	if b == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { _ = a.Close(); _ = b.Close() })
	return a, b
}

// Bytes that arrive in bursts with pauses longer than the activity window
// (so the copy's read deadline fires between and during them) all arrive,
// in order, and are counted.
func TestPipeCopiesAcrossActivityWindows(t *testing.T) {
	t.Parallel()
	sender, src := tcpPair(t)
	dst, receiver := tcpPair(t)
	payload := make([]byte, 6<<20)
	if _, err := rand.Read(payload); err != nil {
		t.Fatal(err)
	}
	go func() {
		for off := 0; off < len(payload); off += 1 << 20 {
			_, _ = sender.Write(payload[off : off+1<<20])
			time.Sleep(30 * time.Millisecond) // a pause longer than the window
		}
		_ = sender.Close()
	}()
	type got struct {
		sum [32]byte
		n   int
	}
	received := make(chan got, 1)
	go func() {
		b, _ := io.ReadAll(receiver)
		received <- got{sha256.Sum256(b), len(b)}
	}()
	var last atomic.Int64
	n, err := Pipe(dst, src, 5*time.Millisecond, &last)
	if err != nil {
		t.Fatalf("Pipe: %v", err)
	}
	closeWrite(dst)
	if n != int64(len(payload)) {
		t.Fatalf("Pipe counted %d bytes, want %d", n, len(payload))
	}
	g := <-received
	if g.n != len(payload) || !bytes.Equal(g.sum[:], func() []byte { s := sha256.Sum256(payload); return s[:] }()) {
		t.Fatalf("received %d bytes that differ from the %d sent", g.n, len(payload))
	}
	if last.Load() == 0 {
		t.Fatal("no activity recorded")
	}
}

// A silent source leaves the activity time alone however many windows
// pass; a byte moves it within a window.
func TestPipeRecordsActivityOnlyWhenBytesMove(t *testing.T) {
	t.Parallel()
	sender, src := tcpPair(t)
	dst, receiver := tcpPair(t)
	var last atomic.Int64
	done := make(chan int64, 1)
	go func() {
		n, _ := Pipe(dst, src, 10*time.Millisecond, &last)
		done <- n
	}()
	time.Sleep(100 * time.Millisecond) // ten windows without a byte
	if v := last.Load(); v != 0 {
		t.Fatalf("activity recorded at %v with no byte sent", time.Unix(0, v))
	}
	before := time.Now()
	if _, err := sender.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	if _, err := io.ReadFull(receiver, buf); err != nil || buf[0] != 'x' {
		t.Fatalf("the byte did not arrive: %q %v", buf, err)
	}
	deadline := time.Now().Add(time.Second)
	for last.Load() < before.UnixNano() {
		if time.Now().After(deadline) {
			t.Fatal("the byte was not recorded as activity")
		}
		time.Sleep(time.Millisecond) // polling the recorded time
	}
	_ = sender.Close()
	if n := <-done; n != 1 {
		t.Fatalf("Pipe counted %d bytes, want 1", n)
	}
}

// relayed starts Relay over a tunnel whose both ends are loopback TCP
// connections (a session's lease, so nothing is released to the lease
// service) and returns the crawler's end, the target's end and a channel
// closed when Relay returns.
func relayed(t testing.TB, c *Core) (crawler, target net.Conn, done chan struct{}) {
	t.Helper()
	crawler, clientSide := tcpPair(t)
	upSide, target := tcpPair(t)
	tun := &Tunnel{Up: upSide, Kind: "connect", Target: "example.test:443",
		Lease:   &upstream.Lease{ID: "l1", SessionKey: "gw/c/s", TTL: time.Hour},
		release: func() {}}
	done = make(chan struct{})
	go func() {
		c.Relay(tun, clientSide, nil)
		close(done)
	}()
	return crawler, target, done
}

// A tunnel that trickles a byte more often than the idle timeout stays
// open however long it lives; one that goes quiet is closed after the idle
// timeout, counted as the idle limit, and its bytes counted both ways.
func TestRelayIdleTimeoutSeesSplicedActivity(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	c := &Core{Metrics: metrics.New(reg), IdleTimeout: 500 * time.Millisecond, Log: slog.New(slog.DiscardHandler)}
	crawler, target, done := relayed(t, c)
	go func() { _, _ = io.Copy(io.Discard, target) }()
	buf := []byte("x")
	var lastWrite time.Time
	for range 20 { // a second, two idle timeouts; a late wake-up has 450ms to spare
		lastWrite = time.Now()
		if _, err := crawler.Write(buf); err != nil {
			t.Fatalf("the trickling tunnel was closed: %v", err)
		}
		time.Sleep(50 * time.Millisecond) // the trickle's pace
		select {
		case <-done:
			t.Fatal("the trickling tunnel was closed as idle")
		default:
		}
	}
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the quiet tunnel was not closed")
	}
	if waited := time.Since(lastWrite); waited < c.IdleTimeout {
		t.Fatalf("closed %v after the last byte, before the idle timeout", waited)
	}
	if got := testutil.ToFloat64(c.Metrics.Refusals.WithLabelValues("idle")); got != 1 {
		t.Fatalf("idle refusals = %v, want 1", got)
	}
	if got := testutil.ToFloat64(c.Metrics.Bytes.WithLabelValues("up", "", "", "")); got != 20 {
		t.Fatalf("bytes up = %v, want 20", got)
	}
}
