// Package probe runs one health probe through a forward proxy: a TCP
// connection to the proxy, an HTTP CONNECT to the probe target, a TLS
// handshake with the target through the tunnel and one request, all under
// the caller's deadline. For an http:// target the probe is a plain-HTTP
// forward instead: the proxy is asked for the absolute URL.
package probe

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"syscall"
	"time"
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
	tlsConfig *tls.Config
	userAgent string
	dialer    net.Dialer
}

// Options configure a Prober.
type Options struct {
	// Target is the URL fetched through each proxy: https:// for a CONNECT
	// tunnel, http:// for a plain forward.
	Target string
	// TLSConfig verifies the target; nil means the system roots. Its
	// ServerName defaults to the target's host.
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
	if cfg.CurvePreferences == nil {
		// Classical key exchange only: the hybrid post-quantum default
		// (X25519MLKEM768) costs a third of a probe's CPU and protects
		// nothing here — a probe carries no secret.
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
	return &Prober{target: u, redacted: redacted, tlsConfig: cfg, userAgent: ua}, nil
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

func (p *Prober) targetHostPort() string {
	port := p.target.Port()
	if port == "" {
		port = "443"
		if p.target.Scheme == "http" {
			port = "80"
		}
	}
	return net.JoinHostPort(p.target.Hostname(), port)
}

// Probe probes the proxy at proxyAddr (host:port). The caller's context
// bounds it; a probe never outlives it.
func (p *Prober) Probe(ctx context.Context, proxyAddr string) Result {
	start := time.Now()
	r := p.probe(ctx, proxyAddr)
	r.Latency = time.Since(start)
	if len(r.Message) > maxMessage {
		r.Message = r.Message[:maxMessage]
	}
	return r
}

func (p *Prober) probe(ctx context.Context, proxyAddr string) Result {
	conn, err := p.dialer.DialContext(ctx, "tcp", proxyAddr)
	if err != nil {
		return failure(ctx, ReasonConnectFailed, "connecting to the proxy", err)
	}
	defer conn.Close()
	// The deadline covers every read and write; cancellation closes the
	// connection, which ends any of them at once.
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()

	if p.target.Scheme == "http" {
		return p.forward(ctx, conn)
	}
	return p.tunnel(ctx, conn)
}

// tunnel asks for a CONNECT tunnel, then talks TLS to the target through it.
func (p *Prober) tunnel(ctx context.Context, conn net.Conn) Result {
	hostPort := p.targetHostPort()
	req := "CONNECT " + hostPort + " HTTP/1.1\r\nHost: " + hostPort + "\r\nUser-Agent: " + p.userAgent + "\r\n\r\n"
	if _, err := io.WriteString(conn, req); err != nil {
		return failure(ctx, ReasonConnectFailed, "sending CONNECT", err)
	}
	br := bufio.NewReaderSize(conn, 1024)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		return failure(ctx, ReasonConnectFailed, "reading the CONNECT response", err)
	}
	if resp.StatusCode != http.StatusOK {
		_ = resp.Body.Close()
		reason := ReasonBadStatus
		switch resp.StatusCode {
		case http.StatusForbidden, http.StatusMethodNotAllowed, http.StatusProxyAuthRequired:
			reason = ReasonConnectRefused
		}
		return Result{Reason: reason, Message: "CONNECT " + hostPort + ": proxy answered " + resp.Status}
	}
	if br.Buffered() > 0 {
		return Result{Reason: ReasonBadStatus, Message: "proxy sent data after its CONNECT response"}
	}

	tc := tls.Client(conn, p.tlsConfig)
	if err := tc.HandshakeContext(ctx); err != nil {
		return failure(ctx, ReasonTLSFailed, "TLS handshake with "+hostPort+" through the proxy", err)
	}
	return p.request(ctx, tc, p.target.RequestURI())
}

// forward asks the proxy for the absolute URL of an http:// target.
func (p *Prober) forward(ctx context.Context, conn net.Conn) Result {
	return p.request(ctx, conn, p.target.String())
}

// request sends one GET for uri and reads the response status; 2xx and
// 3xx pass.
func (p *Prober) request(ctx context.Context, conn net.Conn, uri string) Result {
	req := "GET " + uri + " HTTP/1.1\r\nHost: " + p.target.Host + "\r\nUser-Agent: " + p.userAgent +
		"\r\nAccept: */*\r\nConnection: close\r\n\r\n"
	if _, err := io.WriteString(conn, req); err != nil {
		return failure(ctx, ReasonConnectFailed, "sending the request", err)
	}
	resp, err := http.ReadResponse(bufio.NewReaderSize(conn, 1024), &http.Request{Method: http.MethodGet})
	if err != nil {
		return failure(ctx, ReasonConnectFailed, "reading the response", err)
	}
	// Read a little of the body so the server is not reset mid-write; the
	// connection closes right after anyway.
	_, _ = io.CopyN(io.Discard, resp.Body, 4096)
	_ = resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 399 {
		return Result{Reason: ReasonBadStatus, Message: "GET " + p.redacted + ": " + resp.Status}
	}
	return Result{OK: true, Reason: ReasonSucceeded, Message: resp.Status}
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
