package socks

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/access"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/metrics"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/tunnel"
)

func TestReadRequest(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		in     []byte
		target string
		code   byte
	}{
		{"ipv4", []byte{5, 1, 0, 1, 127, 0, 0, 1, 0x01, 0xbb}, "127.0.0.1:443", tunnel.SocksOK},
		{"domain", append(append([]byte{5, 1, 0, 3, 11}, "example.com"...), 0, 80), "example.com:80", tunnel.SocksOK},
		{"ipv6", append(append([]byte{5, 1, 0, 4}, bytes.Repeat([]byte{0}, 15)...), 1, 0x1f, 0x90), "[::1]:8080", tunnel.SocksOK},
		{"bind", []byte{5, 2, 0, 1, 127, 0, 0, 1, 0, 80}, "", tunnel.SocksCmdUnsupported},
		{"udp associate", []byte{5, 3, 0, 1, 127, 0, 0, 1, 0, 80}, "", tunnel.SocksCmdUnsupported},
		{"unknown address type", []byte{5, 1, 0, 9, 0, 0}, "", tunnel.SocksAddrUnsupport},
		{"empty domain", []byte{5, 1, 0, 3, 0, 0, 80}, "", tunnel.SocksFailure},
		{"version 4", []byte{4, 1, 0, 1, 127, 0, 0, 1, 0, 80}, "", tunnel.SocksFailure},
		{"truncated", []byte{5, 1, 0, 1, 127}, "", tunnel.SocksFailure},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			target, code := readRequest(bufio.NewReader(bytes.NewReader(c.in)))
			if target != c.target || code != c.code {
				t.Fatalf("readRequest = %q, %#x; want %q, %#x", target, code, c.target, c.code)
			}
		})
	}
}

func FuzzReadRequest(f *testing.F) {
	f.Add([]byte{5, 1, 0, 1, 127, 0, 0, 1, 0x01, 0xbb})
	f.Add(append(append([]byte{5, 1, 0, 3, 11}, "example.com"...), 0, 80))
	f.Fuzz(func(t *testing.T, in []byte) {
		target, code := readRequest(bufio.NewReader(bytes.NewReader(in)))
		if (code == tunnel.SocksOK) != (target != "") {
			t.Fatalf("readRequest(%x) = %q, %#x", in, target, code)
		}
	})
}

// A real server: clients that do not finish the handshake in time are
// dropped and counted as limit "socks_handshake_timeout"; one that sends a
// bad greeting is dropped and not counted as a timeout.
func TestHandshakeTimeoutIsCounted(t *testing.T) {
	reg := prometheus.NewRegistry()
	authn, err := auth.New(auth.Config{Disabled: true}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	srv := &Server{
		Core:             &tunnel.Core{Metrics: metrics.New(reg)},
		Access:           access.NewChecker(authn, 10),
		HandshakeTimeout: 200 * time.Millisecond,
		Log:              slog.New(slog.DiscardHandler),
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	// dropped sends what it is given, then waits for the server to close.
	dropped := func(send []byte) {
		t.Helper()
		c, err := net.Dial("tcp", lis.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := c.Write(send); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.Copy(io.Discard, c); err != nil {
			t.Fatalf("the server did not drop the connection: %v", err)
		}
	}
	timeouts := func() int {
		return int(testutil.ToFloat64(srv.Core.Metrics.Refusals.WithLabelValues("socks_handshake_timeout")))
	}
	dropped(nil)                            // says nothing
	dropped([]byte{0x05})                   // stalls mid-greeting
	dropped([]byte{0x05, 0x01, 0x00, 0x05}) // greeted, stalls mid-request
	if got := timeouts(); got != 3 {
		t.Errorf("socks_handshake_timeout = %d after three stalled clients, want 3", got)
	}
	dropped([]byte{0x04, 0x01, 0x00}) // not SOCKS5: dropped at once
	if got := timeouts(); got != 3 {
		t.Errorf("socks_handshake_timeout = %d after a bad greeting, want it unchanged at 3", got)
	}
}
