package upstream

import (
	"bufio"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"sync"
	"time"
)

// UnreachableError is a proxy that could not be reached: the proxy itself
// failed, whatever the target.
type UnreachableError struct{ Err error }

func (e *UnreachableError) Error() string { return "upstream proxy unreachable: " + e.Err.Error() }
func (e *UnreachableError) Unwrap() error { return e.Err }

// RefusedError is a proxy that answered the CONNECT with another status
// than 2xx (squid: 503 when it cannot reach the target, 403 when its rules
// deny it).
type RefusedError struct{ Status int }

func (e *RefusedError) Error() string {
	return fmt.Sprintf("upstream proxy refused the CONNECT: %d %s", e.Status, http.StatusText(e.Status))
}

// Dialer reaches leased proxies.
type Dialer struct {
	// DialTimeout bounds the TCP connect; HandshakeTimeout the CONNECT
	// answer.
	DialTimeout      time.Duration
	HandshakeTimeout time.Duration
	// ResponseHeaderTimeout bounds the wait for a forwarded request's
	// answer; IdleConnTimeout how long a kept-alive connection to a proxy
	// waits for its next request.
	ResponseHeaderTimeout time.Duration
	IdleConnTimeout       time.Duration
	MaxIdlePerProxy       int

	mu         sync.Mutex
	transports map[string]*http.Transport
}

// Connect opens a tunnel to target (host:port) through the proxy at
// proxyAddr, authenticating as user when the lease carries credentials
// (nil: none). The returned conn carries whatever the proxy sent after its
// answer.
func (d *Dialer) Connect(ctx context.Context, proxyAddr string, user *url.Userinfo, target string) (net.Conn, error) {
	nd := net.Dialer{Timeout: d.DialTimeout, KeepAlive: 30 * time.Second}
	conn, err := nd.DialContext(ctx, "tcp", proxyAddr)
	if err != nil {
		return nil, &UnreachableError{Err: err}
	}
	deadline := time.Now().Add(d.HandshakeTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	_ = conn.SetDeadline(deadline)
	req := "CONNECT " + target + " HTTP/1.1\r\nHost: " + target + "\r\n"
	if user != nil {
		req += "Proxy-Authorization: " + basicAuth(user) + "\r\n"
	}
	req += "\r\n"
	if _, err := conn.Write([]byte(req)); err != nil {
		_ = conn.Close()
		return nil, &UnreachableError{Err: err}
	}
	br := answerReaders.Get().(*bufio.Reader)
	br.Reset(conn)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		putAnswerReader(br)
		_ = conn.Close()
		return nil, &UnreachableError{Err: err}
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		putAnswerReader(br)
		_ = conn.Close()
		return nil, &RefusedError{Status: resp.StatusCode}
	}
	_ = conn.SetDeadline(time.Time{})
	if br.Buffered() > 0 {
		// The proxy sent the target's first bytes with its answer: the
		// reader holds them and stays with the tunnel.
		return &bufferedConn{Conn: conn, r: br}, nil
	}
	putAnswerReader(br)
	return conn, nil
}

// answerReaders are the readers of CONNECT answers, reused: one is needed
// for a moment per tunnel, and rarely kept (bufferedConn).
var answerReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4096) }}

func putAnswerReader(br *bufio.Reader) {
	br.Reset(nil)
	answerReaders.Put(br)
}

type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// basicAuth is the Proxy-Authorization value of user's credentials.
func basicAuth(user *url.Userinfo) string {
	pass, _ := user.Password()
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user.Username()+":"+pass))
}

// poolKey names the keep-alive pool of a proxy and the credentials it is
// used with, so that rotated credentials get connections of their own.
func poolKey(proxyAddr string, user *url.Userinfo) string {
	if user == nil {
		return proxyAddr
	}
	return proxyAddr + "\x00" + user.String()
}

// Transport is the keep-alive pool of HTTP forwarding through the proxy at
// proxyAddr (as user, when not nil: Go's transport sends the
// Proxy-Authorization of the proxy URL's user info), created at its first
// use.
func (d *Dialer) Transport(proxyAddr string, user *url.Userinfo) *http.Transport {
	key := poolKey(proxyAddr, user)
	d.mu.Lock()
	defer d.mu.Unlock()
	if t, ok := d.transports[key]; ok {
		return t
	}
	if d.transports == nil {
		d.transports = map[string]*http.Transport{}
	}
	u := &url.URL{Scheme: "http", Host: proxyAddr, User: user}
	nd := &net.Dialer{Timeout: d.DialTimeout, KeepAlive: 30 * time.Second}
	t := &http.Transport{
		Proxy:                 http.ProxyURL(u),
		DialContext:           nd.DialContext,
		MaxIdleConnsPerHost:   d.MaxIdlePerProxy,
		IdleConnTimeout:       d.IdleConnTimeout,
		ResponseHeaderTimeout: d.ResponseHeaderTimeout,
		TLSHandshakeTimeout:   d.HandshakeTimeout,
		// The client's Accept-Encoding goes through as sent, and the body
		// comes back as the target sent it.
		DisableCompression: true,
	}
	d.transports[key] = t
	return t
}

// Forget drops the pool of a proxy that failed.
func (d *Dialer) Forget(proxyAddr string, user *url.Userinfo) {
	key := poolKey(proxyAddr, user)
	d.mu.Lock()
	t := d.transports[key]
	delete(d.transports, key)
	d.mu.Unlock()
	if t != nil {
		t.CloseIdleConnections()
	}
}

// Close closes every pool's idle connections.
func (d *Dialer) Close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, t := range d.transports {
		t.CloseIdleConnections()
	}
}

// IsDialError reports whether err from a forwarded request means the proxy
// could not be reached (nothing of the request was sent).
func IsDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && (op.Op == "dial" || op.Op == "proxyconnect")
}
