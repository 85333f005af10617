package probe_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"go.uber.org/goleak"

	"github.com/egress-proxies/egress-proxies/services/health/internal/probe"
	"github.com/egress-proxies/egress-proxies/services/health/internal/proxytest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// targets are a real TLS server and a plain-HTTP server; /fail answers
// 500 and /hang holds the request until the client goes away.
type targets struct {
	tls   *httptest.Server
	plain *httptest.Server
	roots *x509.CertPool
}

func newTargets(t *testing.T) *targets {
	t.Helper()
	h := http.NewServeMux()
	h.HandleFunc("/ok", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })
	h.HandleFunc("/fail", func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "broken", http.StatusInternalServerError) })
	h.HandleFunc("/hang", func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	ts := httptest.NewTLSServer(h)
	t.Cleanup(ts.Close)
	ps := httptest.NewServer(h)
	t.Cleanup(ps.Close)
	roots := x509.NewCertPool()
	roots.AddCert(ts.Certificate())
	return &targets{tls: ts, plain: ps, roots: roots}
}

func newProber(t *testing.T, target string, roots *x509.CertPool) *probe.Prober {
	t.Helper()
	p, err := probe.New(probe.Options{Target: target, TLSConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}, UserAgent: "health-test"})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func port(t *testing.T, rawURL string) int {
	t.Helper()
	i := strings.LastIndex(rawURL, ":")
	n, err := strconv.Atoi(rawURL[i+1:])
	if err != nil {
		t.Fatal(err)
	}
	return n
}

type probeCase struct {
	name       string
	proxy      func(t *testing.T) string // returns the proxy address
	target     func(tg *targets) string
	roots      func(tg *targets) *x509.CertPool
	timeout    time.Duration
	wantOK     bool
	wantReason string
	wantInMsg  string
}

func runCases(t *testing.T, tg *targets, cases []probeCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			roots := tg.roots
			if tc.roots != nil {
				roots = tc.roots(tg)
			}
			p := newProber(t, tc.target(tg), roots)
			timeout := tc.timeout
			if timeout == 0 {
				timeout = 10 * time.Second
			}
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			defer cancel()
			r := p.Probe(ctx, tc.proxy(t))
			if r.OK != tc.wantOK || r.Reason != tc.wantReason {
				t.Fatalf("Probe() = %+v, want ok=%v reason=%s", r, tc.wantOK, tc.wantReason)
			}
			if tc.wantInMsg != "" && !strings.Contains(r.Message, tc.wantInMsg) {
				t.Errorf("message %q does not contain %q", r.Message, tc.wantInMsg)
			}
			if r.Latency <= 0 || r.Latency > timeout+time.Second {
				t.Errorf("latency = %s, want within (0, %s]", r.Latency, timeout+time.Second)
			}
		})
	}
}

func TestProbe_goProxy(t *testing.T) {
	t.Parallel()
	tg := newTargets(t)
	goProxy := func(b proxytest.Behaviour) func(t *testing.T) string {
		return func(t *testing.T) string { return proxytest.StartProxy(t, b).Addr() }
	}
	tlsOK := func(tg *targets) string { return tg.tls.URL + "/ok" }
	runCases(t, tg, []probeCase{
		{name: "tunnel success", proxy: goProxy(proxytest.Behaviour{}), target: tlsOK, wantOK: true, wantReason: probe.ReasonSucceeded, wantInMsg: "200"},
		{name: "refused CONNECT", proxy: goProxy(proxytest.Behaviour{Status: http.StatusForbidden}), target: tlsOK, wantReason: probe.ReasonConnectRefused, wantInMsg: "403"},
		{name: "proxy auth required", proxy: goProxy(proxytest.Behaviour{Status: http.StatusProxyAuthRequired}), target: tlsOK, wantReason: probe.ReasonConnectRefused, wantInMsg: "407"},
		{name: "wrong status", proxy: goProxy(proxytest.Behaviour{Status: http.StatusBadGateway}), target: tlsOK, wantReason: probe.ReasonBadStatus, wantInMsg: "502"},
		{name: "dead proxy", proxy: func(t *testing.T) string { return "127.0.0.1:" + strconv.Itoa(proxytest.FreePort(t)) }, target: tlsOK, wantReason: probe.ReasonConnectFailed, wantInMsg: "connection refused"},
		{name: "slow proxy", proxy: goProxy(proxytest.Behaviour{Delay: time.Minute}), target: tlsOK, timeout: 300 * time.Millisecond, wantReason: probe.ReasonTimeout},
		{name: "target answers 500", proxy: goProxy(proxytest.Behaviour{}), target: func(tg *targets) string { return tg.tls.URL + "/fail" }, wantReason: probe.ReasonBadStatus, wantInMsg: "500"},
		{name: "untrusted target certificate", proxy: goProxy(proxytest.Behaviour{}), target: tlsOK, roots: func(*targets) *x509.CertPool { return x509.NewCertPool() }, wantReason: probe.ReasonTLSFailed},
		{name: "target hangs", proxy: goProxy(proxytest.Behaviour{}), target: func(tg *targets) string { return tg.tls.URL + "/hang" }, timeout: 300 * time.Millisecond, wantReason: probe.ReasonTimeout},
		{name: "plain-http forward", proxy: goProxy(proxytest.Behaviour{}), target: func(tg *targets) string { return tg.plain.URL + "/ok" }, wantOK: true, wantReason: probe.ReasonSucceeded},
		{name: "plain-http forward, target fails", proxy: goProxy(proxytest.Behaviour{}), target: func(tg *targets) string { return tg.plain.URL + "/fail" }, wantReason: probe.ReasonBadStatus},
	})
}

func TestProbe_squid(t *testing.T) {
	t.Parallel()
	tg := newTargets(t)
	deniedTarget := proxytest.StartProxy(t, proxytest.Behaviour{}) // any listener on a port squid denies
	sq := proxytest.StartSquid(t, proxytest.SquidOptions{DenyConnectPorts: []int{port(t, deniedTarget.Addr())}})
	viaSquid := func(*testing.T) string { return sq.Addr() }
	closed := proxytest.FreePort(t)
	runCases(t, tg, []probeCase{
		{name: "tunnel success", proxy: viaSquid, target: func(tg *targets) string { return tg.tls.URL + "/ok" }, wantOK: true, wantReason: probe.ReasonSucceeded},
		{name: "refused CONNECT", proxy: viaSquid, target: func(*targets) string { return "https://" + deniedTarget.Addr() + "/ok" }, wantReason: probe.ReasonConnectRefused, wantInMsg: "403"},
		{name: "wrong status: target port closed", proxy: viaSquid, target: func(*targets) string { return "https://127.0.0.1:" + strconv.Itoa(closed) + "/" }, wantReason: probe.ReasonBadStatus, wantInMsg: "503"},
		{name: "slow target", proxy: viaSquid, target: func(tg *targets) string { return tg.tls.URL + "/hang" }, timeout: 500 * time.Millisecond, wantReason: probe.ReasonTimeout},
		{name: "plain-http forward", proxy: viaSquid, target: func(tg *targets) string { return tg.plain.URL + "/ok" }, wantOK: true, wantReason: probe.ReasonSucceeded},
		{name: "plain-http forward, target fails", proxy: viaSquid, target: func(tg *targets) string { return tg.plain.URL + "/fail" }, wantReason: probe.ReasonBadStatus, wantInMsg: "500"},
	})
}

// Probes offer TLS 1.2 at most unless told otherwise (a resumed 1.2
// handshake needs no key exchange): a target that refuses 1.2 fails them
// with a message that says so, and passes with 1.3 allowed. Resumed
// handshakes pass like full ones.
func TestProbe_tlsVersions(t *testing.T) {
	t.Parallel()
	only13 := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) }))
	only13.TLS = &tls.Config{MinVersion: tls.VersionTLS13}
	only13.StartTLS()
	t.Cleanup(only13.Close)
	roots := x509.NewCertPool()
	roots.AddCert(only13.Certificate())
	proxy := proxytest.StartProxy(t, proxytest.Behaviour{}).Addr()
	probeWith := func(maxVersion uint16) (*probe.Prober, func() probe.Result) {
		p, err := probe.New(probe.Options{Target: only13.URL + "/ok", TLSConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12, MaxVersion: maxVersion}})
		if err != nil {
			t.Fatal(err)
		}
		return p, func() probe.Result {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			return p.Probe(ctx, proxy)
		}
	}
	_, run := probeWith(0)
	if r := run(); r.Reason != probe.ReasonTLSFailed || !strings.Contains(r.Message, "protocol version") {
		t.Errorf("default prober against a TLS 1.3-only target: %+v, want TLSFailed naming the protocol version", r)
	}
	_, run = probeWith(tls.VersionTLS13)
	for i := range 3 { // the first handshake is full, the next ones resumed
		if r := run(); !r.OK {
			t.Fatalf("probe %d with TLS 1.3 allowed: %+v", i, r)
		}
	}
}

// Every probe after the first resumes its TLS 1.2 session: no key
// exchange, no certificate chain.
func TestProbe_resumesSessions(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var seen []string
	target := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) }))
	target.TLS = &tls.Config{VerifyConnection: func(cs tls.ConnectionState) error {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, fmt.Sprintf("%s resumed=%v", tls.VersionName(cs.Version), cs.DidResume))
		return nil
	}}
	target.StartTLS()
	t.Cleanup(target.Close)
	roots := x509.NewCertPool()
	roots.AddCert(target.Certificate())
	p := newProber(t, target.URL+"/ok", roots)
	proxy := proxytest.StartProxy(t, proxytest.Behaviour{}).Addr()
	for i := range 4 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		r := p.Probe(ctx, proxy)
		cancel()
		if !r.OK {
			t.Fatalf("probe %d: %+v", i, r)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	want := "[TLS 1.2 resumed=false TLS 1.2 resumed=true TLS 1.2 resumed=true TLS 1.2 resumed=true]"
	if fmt.Sprint(seen) != want {
		t.Errorf("handshakes %v, want %s", seen, want)
	}
}

func TestProbe_targetQueryNeverInMessages(t *testing.T) {
	t.Parallel()
	tg := newTargets(t)
	p := newProber(t, tg.tls.URL+"/fail?token=s3cret", tg.roots)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r := p.Probe(ctx, proxytest.StartProxy(t, proxytest.Behaviour{}).Addr())
	if r.Reason != probe.ReasonBadStatus || strings.Contains(r.Message, "s3cret") || strings.Contains(p.Target(), "s3cret") {
		t.Errorf("result %+v, target %q: want BadStatus without the query", r, p.Target())
	}
}

func TestParseTarget(t *testing.T) {
	t.Parallel()
	tests := []struct {
		raw     string
		wantErr string
	}{
		{"https://health.example.internal/ok", ""},
		{"http://10.0.0.1:8080", ""},
		{"", "required"},
		{"ftp://x/", "scheme"},
		{"https:///path", "no host"},
		{"https://user:pw@host/", "user information"},
	}
	for _, tc := range tests {
		t.Run(tc.raw, func(t *testing.T) {
			t.Parallel()
			_, err := probe.ParseTarget(tc.raw)
			if tc.wantErr == "" && err != nil {
				t.Fatalf("ParseTarget(%q) = %v", tc.raw, err)
			}
			if tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("ParseTarget(%q) = %v, want an error with %q", tc.raw, err, tc.wantErr)
			}
			if err != nil && strings.Contains(err.Error(), "pw") {
				t.Errorf("error leaks the password: %v", err)
			}
		})
	}
}

// FuzzProbe_proxyAnswer feeds arbitrary bytes as a proxy's answer: the
// probe must never panic or hang, and must never call garbage a success.
func FuzzProbe_proxyAnswer(f *testing.F) {
	for _, seed := range []string{
		"HTTP/1.1 200 Connection established\r\n\r\n",
		"HTTP/1.1 200 OK\r\n\r\nextra bytes right after the tunnel opens",
		"HTTP/1.1 403 Forbidden\r\nContent-Length: 3\r\n\r\nno!",
		"HTTP/1.0 502 Bad Gateway\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
		"SSH-2.0-OpenSSH_9.6\r\n",
		"\x16\x03\x01\x00\x05hello",
		"",
	} {
		f.Add([]byte(seed))
	}
	tg := newTargetsF(f)
	f.Fuzz(func(t *testing.T, answer []byte) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		done := make(chan struct{})
		go func() {
			defer close(done)
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			buf := make([]byte, 4096)
			_, _ = c.Read(buf) // the CONNECT
			_, _ = c.Write(answer)
		}()
		p := newProber(t, tg.URL+"/ok", nil)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		r := p.Probe(ctx, ln.Addr().String())
		if r.OK {
			t.Fatalf("answer %q passed as a healthy tunnel: %+v", answer, r)
		}
		switch r.Reason {
		case probe.ReasonConnectFailed, probe.ReasonConnectRefused, probe.ReasonBadStatus, probe.ReasonTLSFailed, probe.ReasonTimeout:
		default:
			t.Fatalf("answer %q: reason %q", answer, r.Reason)
		}
		_ = ln.Close()
		<-done
	})
}

func newTargetsF(f *testing.F) *httptest.Server {
	ts := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) }))
	f.Cleanup(ts.Close)
	return ts
}

// rawProxy answers every connection's first request with head, as bytes,
// and closes it.
func rawProxy(t *testing.T, head string) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lis.Close() })
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 4096)
				_, _ = c.Read(buf)
				_, _ = c.Write([]byte(head))
			}()
		}
	}()
	return lis.Addr().String()
}

// A proxy's status line goes into the message whatever bytes it holds;
// the message stays valid UTF-8 without NUL bytes (PostgreSQL would refuse
// to store it, protobuf to send it) and is cut at a character boundary.
func TestProbe_messageFromAnyBytes(t *testing.T) {
	t.Parallel()
	tg := newTargets(t)
	p := newProber(t, tg.tls.URL+"/ok", tg.roots)
	for name, head := range map[string]string{
		"invalid UTF-8 and NUL": "HTTP/1.1 403 Forbidden \xff\xfe\x00by policy\r\n\r\n",
		"long, multi-byte":      "HTTP/1.1 403 " + strings.Repeat("é", 400) + "\r\n\r\n",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			r := p.Probe(ctx, rawProxy(t, head))
			if r.OK || r.Reason != probe.ReasonConnectRefused || !strings.Contains(r.Message, "403") {
				t.Fatalf("Probe() = %+v, want a refused CONNECT naming 403", r)
			}
			if !utf8.ValidString(r.Message) || strings.Contains(r.Message, "\x00") || len(r.Message) > 512 {
				t.Errorf("message %q (%d bytes): want valid UTF-8, no NUL, at most 512 bytes", r.Message, len(r.Message))
			}
		})
	}
}
