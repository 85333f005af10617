// Package probe runs one health probe through a forward proxy: a TCP
// connection to the proxy, an HTTP CONNECT to the probe target, a TLS
// handshake with the target through the tunnel and one request, all under
// the caller's deadline. For an http:// target the probe is a plain-HTTP
// forward instead: the proxy is asked for the absolute URL.
//
// A probe runs thousands of times a second, so its path is kept lean (see
// docs/health.md, "The probe"): requests are built once, writes wait for
// the next read so that each round trip is one segment, responses are read
// into a pooled buffer, and TLS resumes sessions without a key exchange.
package probe

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode/utf8"
)

// Reasons of a probe, CamelCase as in healthv1.ProxyHealth.reason. TooSlow
// is decided by the engine, which knows the proxy's latency threshold.
const (
	ReasonSucceeded      = "ProbeSucceeded"
	ReasonConnectFailed  = "ConnectFailed"
	ReasonConnectRefused = "ConnectRefused"
	ReasonBadStatus      = "BadStatus"
	ReasonTLSFailed      = "TLSFailed"
	ReasonTimeout        = "Timeout"
	ReasonTooSlow        = "TooSlow"
	// ReasonCredentialsUnavailable: the proxy has credentials and the
	// orchestrator could not be asked for them, so it was not probed.
	ReasonCredentialsUnavailable = "CredentialsUnavailable"
)

// maxMessage bounds the message of a result, so an odd proxy cannot fill
// the logs or the database with its error page.
const maxMessage = 512

// Result is the outcome of one probe.
type Result struct {
	OK      bool
	Reason  string
	Message string
	// Latency is the whole probe: connect, CONNECT, handshake and request.
	Latency time.Duration
}

// Prober probes proxies against one target. It is safe for concurrent use.
type Prober struct {
	target    *url.URL
	redacted  string
	hostPort  string
	tlsConfig *tls.Config
	dialer    net.Dialer
	// The requests, built once: CONNECT, then GET through the tunnel (or
	// the absolute-URL GET of a plain forward), each whole and as its
	// head without the blank line, to which an authenticated probe adds
	// Proxy-Authorization.
	connect, get         []byte
	connectHead, getHead []byte
}

// Auth is a proxy's HTTP Basic Proxy-Authorization, built once per
// credentials by BasicAuth; the zero Auth sends none. It never shows the
// secret when printed.
type Auth struct{ header string }

// BasicAuth is the Proxy-Authorization of user and password.
func BasicAuth(user, password string) Auth {
	return Auth{header: "Proxy-Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password)) + "\r\n"}
}

// String never shows the credentials.
func (a Auth) String() string {
	if a.header == "" {
		return "none"
	}
	return "basic(redacted)"
}

// Options configure a Prober.
type Options struct {
	// Target is the URL fetched through each proxy: https:// for a CONNECT
	// tunnel, http:// for a plain forward.
	Target string
	// TLSConfig verifies the target; nil means the system roots. Its
	// ServerName defaults to the target's host, its MaxVersion to TLS 1.2
	// (see New).
	TLSConfig *tls.Config
	// UserAgent is sent on the CONNECT and on the request; it names the
	// health replica so a proxy's access log tells who probed it.
	UserAgent string
}

// New validates the target and returns a prober for it.
func New(o Options) (*Prober, error) {
	u, err := ParseTarget(o.Target)
	if err != nil {
		return nil, err
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if o.TLSConfig != nil {
		cfg = o.TLSConfig.Clone()
	}
	if cfg.ServerName == "" {
		cfg.ServerName = u.Hostname()
	}
	if cfg.MaxVersion == 0 {
		// TLS 1.2 by default: its resumed handshake is symmetric crypto
		// only, where a TLS 1.3 resumption (Go's client offers psk_dhe_ke
		// alone) still runs an X25519 exchange — 30% of a probe's CPU in
		// the profile. A probe carries no secret; it tests that the proxy
		// tunnels TLS, which either version shows.
		cfg.MaxVersion = tls.VersionTLS12
	}
	if cfg.CurvePreferences == nil {
		// Classical key exchange only, for the full handshakes (the first,
		// and TLS 1.3 when allowed): the hybrid post-quantum default
		// (X25519MLKEM768) costs a third of a handshake's CPU and protects
		// nothing here.
		cfg.CurvePreferences = []tls.CurveID{tls.X25519, tls.CurveP256}
	}
	if cfg.ClientSessionCache == nil {
		// Resumed sessions skip the certificate chain: a probe tests the
		// proxy, not the target's certificate, and this keeps the CPU cost
		// per probe low enough for thousands of proxies.
		cfg.ClientSessionCache = tls.NewLRUClientSessionCache(64)
	}
	ua := o.UserAgent
	if ua == "" {
		ua = "egress-health"
	}
	redacted := u.Scheme + "://" + u.Host + u.EscapedPath()
	if u.RawQuery != "" {
		redacted += "?…"
	}
	p := &Prober{target: u, redacted: redacted, tlsConfig: cfg, hostPort: targetHostPort(u),
		// Probes open one connection each and close it within a second:
		// keep-alive probes would never fire, and setting them up is four
		// system calls per connection.
		dialer: net.Dialer{KeepAlive: -1}}
	uri := u.RequestURI()
	if u.Scheme == "https" {
		p.connect = []byte("CONNECT " + p.hostPort + " HTTP/1.1\r\nHost: " + p.hostPort + "\r\nUser-Agent: " + ua + "\r\n")
	} else {
		uri = u.String()
	}
	p.get = []byte("GET " + uri + " HTTP/1.1\r\nHost: " + u.Host + "\r\nUser-Agent: " + ua +
		"\r\nAccept: */*\r\nConnection: close\r\n")
	p.connectHead, p.getHead = p.connect, p.get
	p.connect = append(append([]byte(nil), p.connect...), "\r\n"...)
	p.get = append(append([]byte(nil), p.get...), "\r\n"...)
	return p, nil
}

// ParseTarget checks a probe target URL: http or https, a host, no user
// information (it would travel in clear through every proxy).
func ParseTarget(raw string) (*url.URL, error) {
	if raw == "" {
		return nil, errors.New("--probe-target is required: an http(s) URL the operator runs (never a third-party site)")
	}
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("probe target: %w", err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, fmt.Errorf("probe target %q: scheme must be http or https", raw)
	}
	if u.Hostname() == "" {
		return nil, fmt.Errorf("probe target %q: no host", raw)
	}
	if u.User != nil {
		return nil, fmt.Errorf("probe target: user information is not allowed")
	}
	if u.Path == "" {
		u.Path = "/"
	}
	return u, nil
}

// Target is the probe target URL as it may be logged: without its query,
// which could carry a token.
func (p *Prober) Target() string { return p.redacted }

func targetHostPort(u *url.URL) string {
	port := u.Port()
	if port == "" {
		port = "443"
		if u.Scheme == "http" {
			port = "80"
		}
	}
	return net.JoinHostPort(u.Hostname(), port)
}

// Probe probes the proxy at proxyAddr (host:port). The caller's context
// bounds it; a probe never outlives it.
func (p *Prober) Probe(ctx context.Context, proxyAddr string) Result {
	return p.ProbeAuth(ctx, proxyAddr, Auth{})
}

// ProbeAuth probes the proxy at proxyAddr, authenticating with auth: a
// proxy that refuses it (407) fails the probe with ConnectRefused.
func (p *Prober) ProbeAuth(ctx context.Context, proxyAddr string, auth Auth) Result {
	start := time.Now()
	r := p.probe(ctx, proxyAddr, auth)
	r.Latency = time.Since(start)
	r.Message = cleanMessage(r.Message)
	return r
}

// cleanMessage makes a probe's message one that can be stored and sent:
// valid UTF-8 (protobuf strings and PostgreSQL text require it), without
// NUL bytes (PostgreSQL text refuses them), at most maxMessage bytes cut
// at a character boundary. A message carries the proxy's or the target's
// status line as sent, whatever bytes it holds. Valid messages are
// returned as they are, without allocating.
func cleanMessage(m string) string {
	m = strings.ReplaceAll(strings.ToValidUTF8(m, "\uFFFD"), "\x00", "")
	if len(m) > maxMessage {
		cut := maxMessage
		for cut > 0 && !utf8.RuneStart(m[cut]) {
			cut--
		}
		m = m[:cut]
	}
	return m
}

func (p *Prober) probe(ctx context.Context, proxyAddr string, auth Auth) Result {
	conn, err := p.dialer.DialContext(ctx, "tcp", proxyAddr)
	if err != nil {
		return failure(ctx, ReasonConnectFailed, "connecting to the proxy", err)
	}
	defer conn.Close()
	// The deadline covers every read and write; cancellation closes the
	// connection, which ends any of them at once. So the TLS handshake
	// needs no context of its own (with one, it would start a goroutine
	// per probe to watch it).
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()

	c := conns.Get().(*coalescing)
	c.Conn = conn
	defer c.release()
	if p.target.Scheme == "http" {
		return p.request(ctx, c, c.buf[:], auth)
	}
	return p.tunnel(ctx, c, auth)
}

// tunnel asks for a CONNECT tunnel, then talks TLS to the target through it.
func (p *Prober) tunnel(ctx context.Context, c *coalescing, auth Auth) Result {
	_, _ = c.Write(withAuth(p.connect, p.connectHead, auth))
	h, err := readHead(c, c.buf[:], true)
	if err != nil {
		return failure(ctx, ReasonConnectFailed, "reading the CONNECT response", err)
	}
	if h.code != 200 {
		reason := ReasonBadStatus
		switch h.code {
		case 403, 405, 407:
			reason = ReasonConnectRefused
		}
		return Result{Reason: reason, Message: "CONNECT " + p.hostPort + ": proxy answered " + string(h.status)}
	}
	if h.extra {
		return Result{Reason: ReasonBadStatus, Message: "proxy sent data after its CONNECT response"}
	}
	tc := tls.Client(c, p.tlsConfig)
	if err := tc.Handshake(); err != nil {
		return failure(ctx, ReasonTLSFailed, "TLS handshake with "+p.hostPort+" through the proxy", err)
	}
	return p.request(ctx, tc, c.buf[:], Auth{})
}

// withAuth is the request whole, or its head with auth's header and the
// blank line.
func withAuth(whole, head []byte, auth Auth) []byte {
	if auth.header == "" {
		return whole
	}
	out := make([]byte, 0, len(head)+len(auth.header)+2)
	out = append(append(append(out, head...), auth.header...), "\r\n"...)
	return out
}

// request sends the GET and reads the response's status line; 2xx and 3xx
// pass. The rest of the response is not read: the connection closes right
// after.
func (p *Prober) request(ctx context.Context, rw io.ReadWriter, buf []byte, auth Auth) Result {
	if _, err := rw.Write(withAuth(p.get, p.getHead, auth)); err != nil {
		return failure(ctx, ReasonConnectFailed, "sending the request", err)
	}
	h, err := readHead(rw, buf, false)
	if err != nil {
		return failure(ctx, ReasonConnectFailed, "reading the response", err)
	}
	if h.code < 200 || h.code > 399 {
		return Result{Reason: ReasonBadStatus, Message: "GET " + p.redacted + ": " + string(h.status)}
	}
	msg := "200 OK"
	if h.code != 200 || string(h.status) != msg {
		msg = string(h.status)
	}
	return Result{OK: true, Reason: ReasonSucceeded, Message: msg}
}

// coalescing holds writes until the next read, so that what a probe sends
// before it waits for an answer leaves in one segment: the TLS client's
// Finished and the GET, above all, which crypto/tls writes apart. Nothing
// waits for data that is still held, so this never stalls a peer.
type coalescing struct {
	net.Conn
	out []byte
	// buf holds the CONNECT response head.
	buf [headMax]byte
}

var conns = sync.Pool{New: func() any { return &coalescing{out: make([]byte, 0, 2048)} }}

func (c *coalescing) Write(b []byte) (int, error) {
	c.out = append(c.out, b...)
	return len(b), nil
}

func (c *coalescing) Read(b []byte) (int, error) {
	if len(c.out) > 0 {
		_, err := c.Conn.Write(c.out)
		c.out = c.out[:0]
		if err != nil {
			return 0, err
		}
	}
	return c.Conn.Read(b)
}

func (c *coalescing) release() {
	c.Conn = nil
	if cap(c.out) > 16<<10 {
		return // grown by an odd exchange; let it go
	}
	c.out = c.out[:0]
	conns.Put(c)
}

// failure classifies err: a deadline (ours or the socket's) is Timeout,
// whatever the step.
func failure(ctx context.Context, reason, step string, err error) Result {
	var ne net.Error
	if errors.Is(ctx.Err(), context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) ||
		(errors.As(err, &ne) && ne.Timeout()) {
		return Result{Reason: ReasonTimeout, Message: step + ": timed out"}
	}
	if ctx.Err() != nil {
		return Result{Reason: ReasonTimeout, Message: step + ": " + ctx.Err().Error()}
	}
	msg := err.Error()
	if errors.Is(err, syscall.ECONNREFUSED) {
		msg = "connection refused"
	}
	return Result{Reason: reason, Message: step + ": " + strings.TrimSpace(msg)}
}
