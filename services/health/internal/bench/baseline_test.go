package bench

// The probe as it was before the probe path was made lean (TLS 1.3 with an
// X25519 exchange on every resumption, net/http's response parser, one
// write per message): the baseline BenchmarkProbeCPU measures the current
// probe against, side by side in one run. Frozen; not used by the service.

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/egress-proxies/egress-proxies/services/health/internal/probe"
)

// baselineProber probes proxies against one target.
type baselineProber struct {
	target    *url.URL
	redacted  string
	tlsConfig *tls.Config
	userAgent string
	dialer    net.Dialer
}

// baselineOptions configure a baselineProber.
type baselineOptions struct {
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
func newBaseline(o baselineOptions) (*baselineProber, error) {
	u, err := probe.ParseTarget(o.Target)
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
	return &baselineProber{target: u, redacted: redacted, tlsConfig: cfg, userAgent: ua}, nil
}

func (p *baselineProber) targetHostPort() string {
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
func (p *baselineProber) Probe(ctx context.Context, proxyAddr string) probe.Result {
	start := time.Now()
	r := p.probe(ctx, proxyAddr)
	r.Latency = time.Since(start)
	if len(r.Message) > 512 {
		r.Message = r.Message[:512]
	}
	return r
}

func (p *baselineProber) probe(ctx context.Context, proxyAddr string) probe.Result {
	conn, err := p.dialer.DialContext(ctx, "tcp", proxyAddr)
	if err != nil {
		return failure(ctx, probe.ReasonConnectFailed, "connecting to the proxy", err)
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
func (p *baselineProber) tunnel(ctx context.Context, conn net.Conn) probe.Result {
	hostPort := p.targetHostPort()
	req := "CONNECT " + hostPort + " HTTP/1.1\r\nHost: " + hostPort + "\r\nUser-Agent: " + p.userAgent + "\r\n\r\n"
	if _, err := io.WriteString(conn, req); err != nil {
		return failure(ctx, probe.ReasonConnectFailed, "sending CONNECT", err)
	}
	br := bufio.NewReaderSize(conn, 1024)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		return failure(ctx, probe.ReasonConnectFailed, "reading the CONNECT response", err)
	}
	if resp.StatusCode != http.StatusOK {
		_ = resp.Body.Close()
		reason := probe.ReasonBadStatus
		switch resp.StatusCode {
		case http.StatusForbidden, http.StatusMethodNotAllowed, http.StatusProxyAuthRequired:
			reason = probe.ReasonConnectRefused
		}
		return probe.Result{Reason: reason, Message: "CONNECT " + hostPort + ": proxy answered " + resp.Status}
	}
	if br.Buffered() > 0 {
		return probe.Result{Reason: probe.ReasonBadStatus, Message: "proxy sent data after its CONNECT response"}
	}

	tc := tls.Client(conn, p.tlsConfig)
	if err := tc.HandshakeContext(ctx); err != nil {
		return failure(ctx, probe.ReasonTLSFailed, "TLS handshake with "+hostPort+" through the proxy", err)
	}
	return p.request(ctx, tc, p.target.RequestURI())
}

// forward asks the proxy for the absolute URL of an http:// target.
func (p *baselineProber) forward(ctx context.Context, conn net.Conn) probe.Result {
	return p.request(ctx, conn, p.target.String())
}

// request sends one GET for uri and reads the response status; 2xx and
// 3xx pass.
func (p *baselineProber) request(ctx context.Context, conn net.Conn, uri string) probe.Result {
	req := "GET " + uri + " HTTP/1.1\r\nHost: " + p.target.Host + "\r\nUser-Agent: " + p.userAgent +
		"\r\nAccept: */*\r\nConnection: close\r\n\r\n"
	if _, err := io.WriteString(conn, req); err != nil {
		return failure(ctx, probe.ReasonConnectFailed, "sending the request", err)
	}
	resp, err := http.ReadResponse(bufio.NewReaderSize(conn, 1024), &http.Request{Method: http.MethodGet})
	if err != nil {
		return failure(ctx, probe.ReasonConnectFailed, "reading the response", err)
	}
	// Read a little of the body so the server is not reset mid-write; the
	// connection closes right after anyway.
	_, _ = io.CopyN(io.Discard, resp.Body, 4096)
	_ = resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 399 {
		return probe.Result{Reason: probe.ReasonBadStatus, Message: "GET " + p.redacted + ": " + resp.Status}
	}
	return probe.Result{OK: true, Reason: probe.ReasonSucceeded, Message: resp.Status}
}

// failure classifies err: a deadline (ours or the socket's) is Timeout,
// whatever the step.
func failure(ctx context.Context, reason, step string, err error) probe.Result {
	var ne net.Error
	if errors.Is(ctx.Err(), context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) ||
		(errors.As(err, &ne) && ne.Timeout()) {
		return probe.Result{Reason: probe.ReasonTimeout, Message: step + ": timed out"}
	}
	if ctx.Err() != nil {
		return probe.Result{Reason: probe.ReasonTimeout, Message: step + ": " + ctx.Err().Error()}
	}
	msg := err.Error()
	if errors.Is(err, syscall.ECONNREFUSED) {
		msg = "connection refused"
	}
	return probe.Result{Reason: reason, Message: step + ": " + strings.TrimSpace(msg)}
}
