package upstream

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"testing"
	"time"
)

// authProxy is a forward proxy that demands user:pass: CONNECT answers 200
// and then echoes, a forwarded request answers 200 ok.
func authProxy(t *testing.T, want string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func(c net.Conn) {
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					if req.Header.Get("Proxy-Authorization") != want {
						_, _ = io.WriteString(c, "HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n")
						continue
					}
					if req.Method == http.MethodConnect {
						_, _ = io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n")
						_, _ = io.Copy(c, br)
						return
					}
					_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
				}
			}(c)
		}
	}()
	return ln.Addr().String()
}

// The lease's credentials go to the proxy on CONNECT and on forwarded
// requests; without them the proxy's 407 is a refusal.
func TestDialerSendsTheLeaseCredentials(t *testing.T) {
	user := url.UserPassword("egress-0123456789ab", "s3cret-pass")
	addr := authProxy(t, basicAuth(user))
	d := &Dialer{DialTimeout: 5 * time.Second, HandshakeTimeout: 5 * time.Second, IdleConnTimeout: time.Minute, MaxIdlePerProxy: 2}
	defer d.Close()
	ctx := context.Background()

	conn, err := d.Connect(ctx, addr, user, "example.test:443")
	if err != nil {
		t.Fatalf("CONNECT with credentials: %v", err)
	}
	if _, err := io.WriteString(conn, "ping"); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(conn, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("tunnel echo: %q %v", buf, err)
	}
	_ = conn.Close()

	var refused *RefusedError
	if _, err := d.Connect(ctx, addr, nil, "example.test:443"); !errors.As(err, &refused) || refused.Status != http.StatusProxyAuthRequired {
		t.Fatalf("CONNECT without credentials: %v, want a 407 refusal", err)
	}
	if _, err := d.Connect(ctx, addr, url.UserPassword("egress-0123456789ab", "old"), "example.test:443"); !errors.As(err, &refused) {
		t.Fatalf("CONNECT with old credentials: %v, want a refusal", err)
	}

	req, _ := http.NewRequest(http.MethodGet, "http://example.test/page", nil)
	resp, err := d.Transport(addr, user).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("forwarded with credentials: %d, want 200", resp.StatusCode)
	}
	req, _ = http.NewRequest(http.MethodGet, "http://example.test/page", nil)
	resp, err = d.Transport(addr, nil).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusProxyAuthRequired {
		t.Fatalf("forwarded without credentials: %d, want 407 (a pool of its own)", resp.StatusCode)
	}
}
