package probe_test

import (
	"context"
	"encoding/base64"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/services/health/internal/probe"
)

// authProxy is a CONNECT proxy that demands user:password (HTTP Basic).
func authProxy(t *testing.T, user, password string) string {
	t.Helper()
	want := "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Proxy-Authorization") != want {
			w.Header().Set("Proxy-Authenticate", `Basic realm="test"`)
			w.WriteHeader(http.StatusProxyAuthRequired)
			return
		}
		if r.Method != http.MethodConnect {
			w.WriteHeader(http.StatusMethodNotAllowed)
			return
		}
		up, err := net.Dial("tcp", r.Host)
		if err != nil {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		conn, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			up.Close()
			return
		}
		_, _ = rw.WriteString("HTTP/1.1 200 Connection established\r\n\r\n")
		_ = rw.Flush()
		go func() { _, _ = io.Copy(up, conn); up.Close() }()
		_, _ = io.Copy(conn, up)
		conn.Close()
	}))
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

func TestProbeAuth(t *testing.T) {
	t.Parallel()
	tg := newTargets(t)
	addr := authProxy(t, "egress-0123456789ab", "right-password")
	p := newProber(t, tg.tls.URL+"/ok", tg.roots)
	cases := []struct {
		name       string
		auth       probe.Auth
		wantOK     bool
		wantReason string
	}{
		{"the proxy's credentials", probe.BasicAuth("egress-0123456789ab", "right-password"), true, probe.ReasonSucceeded},
		{"credentials the proxy refuses", probe.BasicAuth("egress-0123456789ab", "old-password"), false, probe.ReasonConnectRefused},
		{"no credentials", probe.Auth{}, false, probe.ReasonConnectRefused},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			r := p.ProbeAuth(ctx, addr, tc.auth)
			if r.OK != tc.wantOK || r.Reason != tc.wantReason {
				t.Errorf("probe = %v %s (%s), want %v %s", r.OK, r.Reason, r.Message, tc.wantOK, tc.wantReason)
			}
		})
	}
	if s := probe.BasicAuth("u", "right-password").String(); s != "basic(redacted)" {
		t.Errorf("Auth prints as %q", s)
	}
}
