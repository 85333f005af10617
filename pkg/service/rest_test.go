package service

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
)

// countingListener counts the bytes the server reads from each
// connection, by the client's address.
type countingListener struct {
	net.Listener
	mu   sync.Mutex
	read map[string]*atomic.Int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	n := &atomic.Int64{}
	l.mu.Lock()
	l.read[c.RemoteAddr().String()] = n
	l.mu.Unlock()
	return countingConn{Conn: c, read: n}, nil
}

func (l *countingListener) readFrom(client string) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if n := l.read[client]; n != nil {
		return n.Load()
	}
	return -1
}

type countingConn struct {
	net.Conn
	read *atomic.Int64
}

func (c countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.read.Add(int64(n))
	return n, err
}

// recordingProxies stores what CreateProxy received.
type recordingProxies struct {
	proxyv1.UnimplementedProxyServiceServer
	creates atomic.Int64
}

func (r *recordingProxies) CreateProxy(_ context.Context, req *proxyv1.CreateProxyRequest) (*proxyv1.CreateProxyResponse, error) {
	r.creates.Add(1)
	return &proxyv1.CreateProxyResponse{Proxy: &proxyv1.Proxy{Name: req.GetName()}, Created: true}, nil
}

func startGuarded(t *testing.T, opts Options) (*Service, *countingListener, *recordingProxies) {
	t.Helper()
	tokens := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(tokens, []byte("ops tok-admin admin\nboard tok-viewer viewer\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	opts.Name, opts.GRPCListen, opts.HTTPListen, opts.LogLevel = "guard", "127.0.0.1:0", "127.0.0.1:0", "error"
	opts.ShutdownTimeout, opts.Auth = 5*time.Second, &auth.Config{TokenFile: tokens}
	ctx, cancel := context.WithCancel(context.Background())
	s, err := New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	read := &countingListener{Listener: s.httpLis, read: map[string]*atomic.Int64{}}
	s.httpLis = read
	rec := &recordingProxies{}
	proxyv1.RegisterProxyServiceServer(s.GRPC, rec)
	s.MountREST(proxyv1.RegisterProxyServiceHandler)
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return s, read, rec
}

// rawPost sends a POST of size bytes of one JSON string over a raw
// connection (chunked when contentLength is false) and returns the status
// the server answered with and how many bytes the server read from the
// connection until it closed it. It does not wait for the body to be sent:
// the server may answer and close long before.
func rawPost(t *testing.T, l *countingListener, addr, token string, size int64, contentLength bool) (int, int64) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(60 * time.Second))
	head := "POST /v1/proxies HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
	if token != "" {
		head += "Authorization: Bearer " + token + "\r\n"
	}
	if contentLength {
		head += fmt.Sprintf("Content-Length: %d\r\n", size)
	} else {
		head += "Transfer-Encoding: chunked\r\n"
	}
	if _, err := io.WriteString(conn, head+"\r\n"); err != nil {
		t.Fatal(err)
	}
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		// One long JSON string: the decoder keeps reading until the limit.
		first := []byte(`{"name":"` + strings.Repeat("a", 64<<10-9))
		rest := []byte(strings.Repeat("a", 64<<10))
		for n, chunk := int64(0), first; n < size; n, chunk = n+int64(len(chunk)), rest {
			var err error
			if contentLength {
				_, err = conn.Write(chunk)
			} else {
				_, err = fmt.Fprintf(conn, "%x\r\n%s\r\n", len(chunk), chunk)
			}
			if err != nil {
				return // the server closed the connection: what it should do
			}
		}
	}()
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	resp.Body.Close()
	if !resp.Close {
		t.Errorf("the answer %d keeps the connection open", resp.StatusCode)
	}
	// Wait until the server has closed the connection, so the count is
	// final.
	_, _ = io.Copy(io.Discard, br)
	_ = conn.Close()
	<-sent
	return resp.StatusCode, l.readFrom(conn.LocalAddr().String())
}

// readAhead bounds what the server reads past what the guard asks for: its
// connection's 4 KiB read-ahead, the request line and headers, and chunk
// framing (a few bytes per 64 KiB chunk).
const readAhead = 8 << 10

// A 300 MB body: without a token it is refused before any of it is read;
// with one it is cut off at --max-request-bytes with 413, whether it
// declares its length or streams chunks. The server never reads more than
// the limit.
func TestBodyLimitAndAuthBeforeTheBody(t *testing.T) {
	t.Parallel()
	const limit = 256 << 10
	const huge = 300 << 20
	s, read, rec := startGuarded(t, Options{MaxRequestBytes: limit})
	cases := []struct {
		name          string
		token         string
		contentLength bool
		want          int
		maxRead       int64
	}{
		// Beyond what the guard reads (nothing of an unauthenticated body,
		// the limit of an authenticated one) the server reads only what
		// its connection's 4 KiB buffer read ahead, and chunk framing:
		// net/http's own drain of up to 256 KiB after the handler never
		// runs (closeUnread).
		{"no token, declared length", "", true, http.StatusUnauthorized, readAhead},
		{"no token, chunked", "", false, http.StatusUnauthorized, readAhead},
		{"wrong token, chunked", "nope", false, http.StatusUnauthorized, readAhead},
		{"token, declared length", "tok-admin", true, http.StatusRequestEntityTooLarge, readAhead},
		{"token, chunked", "tok-admin", false, http.StatusRequestEntityTooLarge, limit + readAhead},
	}
	for _, tc := range cases {
		got, n := rawPost(t, read, s.HTTPAddr(), tc.token, huge, tc.contentLength)
		if got != tc.want {
			t.Errorf("%s: status %d, want %d", tc.name, got, tc.want)
		}
		if n < 0 || n > tc.maxRead {
			t.Errorf("%s: the server read %d bytes, want at most %d", tc.name, n, tc.maxRead)
		}
	}
	if n := rec.creates.Load(); n != 0 {
		t.Errorf("%d oversized or anonymous creates reached the handler", n)
	}

	// Within the limit everything works as before.
	req, _ := http.NewRequest(http.MethodPost, "http://"+s.HTTPAddr()+"/v1/proxies", strings.NewReader(`{"name":"p1","spec":{"mode":"PROXY_MODE_MANAGED","provider":"local"}}`))
	req.Header.Set("Authorization", "Bearer tok-admin")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"name":"p1"`) {
		t.Errorf("a small create = %d %s", resp.StatusCode, body)
	}
	// The 413 body is the REST layer's error shape.
	req, _ = http.NewRequest(http.MethodPost, "http://"+s.HTTPAddr()+"/v1/proxies", strings.NewReader(strings.Repeat(" ", limit+1)))
	req.Header.Set("Authorization", "Bearer tok-admin")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge || !strings.Contains(string(body), `"message":"the request body exceeds the limit of 262144 bytes`) {
		t.Errorf("one byte over = %d %s", resp.StatusCode, body)
	}
}

// A chunked body far over a small limit: 413 once the limit is read, and
// nothing more read from the connection, although net/http alone would
// read up to 256 KiB more (sixteen times this limit) into io.Discard after
// the handler, and would not learn from http.MaxBytesReader that the limit
// was hit. The client gets the whole answer before the connection closes.
func TestChunkedBodyFarOverTheLimit(t *testing.T) {
	t.Parallel()
	const limit = 16 << 10
	s, read, rec := startGuarded(t, Options{MaxRequestBytes: limit})
	for range 3 { // the same every time, not by luck of timing
		got, n := rawPost(t, read, s.HTTPAddr(), "tok-admin", 100<<20, false)
		if got != http.StatusRequestEntityTooLarge {
			t.Errorf("status %d, want 413", got)
		}
		if n < limit || n > limit+readAhead {
			t.Errorf("the server read %d bytes, want the limit %d and at most %d more", n, limit, readAhead)
		}
	}
	if n := rec.creates.Load(); n != 0 {
		t.Errorf("%d oversized creates reached the handler", n)
	}
}

// gRPC's receive limit is the same --max-request-bytes.
func TestGRPCReceiveLimit(t *testing.T) {
	t.Parallel()
	const limit = 64 << 10
	s, _, rec := startGuarded(t, Options{MaxRequestBytes: limit})
	conn, err := grpc.NewClient(s.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(auth.BearerToken("tok-admin")))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c := proxyv1.NewProxyServiceClient(conn)
	if _, err := c.CreateProxy(ctx, &proxyv1.CreateProxyRequest{Name: strings.Repeat("a", limit)}, grpc.WaitForReady(true)); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("a message over the limit = %v, want RESOURCE_EXHAUSTED", err)
	}
	if _, err := c.CreateProxy(ctx, &proxyv1.CreateProxyRequest{Name: "p1", Spec: managed}); err != nil {
		t.Errorf("a small message: %v", err)
	}
	if n := rec.creates.Load(); n != 1 {
		t.Errorf("creates = %d, want 1", n)
	}
}

// Per-client rate limits: the client over its budget gets 429 with
// Retry-After over REST and RESOURCE_EXHAUSTED over gRPC; another client
// and unlimited methods are unaffected.
func TestRateLimitOverRESTAndGRPC(t *testing.T) {
	t.Parallel()
	s, _, _ := startGuarded(t, Options{Limits: auth.Limits{ProxyWrites: auth.RateLimit{Rate: 0.01, Burst: 2}}})
	post := func(token string) *http.Response {
		req, _ := http.NewRequest(http.MethodPost, "http://"+s.HTTPAddr()+"/v1/proxies", strings.NewReader(`{"name":"p1","spec":{"mode":"PROXY_MODE_MANAGED","provider":"local"}}`))
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	for i := range 2 {
		if resp := post("tok-admin"); resp.StatusCode != 200 {
			t.Fatalf("create %d inside the burst = %d", i, resp.StatusCode)
		}
	}
	resp := post("tok-admin")
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "100" {
		t.Errorf("over the limit = %d Retry-After %q, want 429 with Retry-After 100", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	conn, err := grpc.NewClient(s.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(auth.BearerToken("tok-admin")))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = proxyv1.NewProxyServiceClient(conn).CreateProxy(ctx, &proxyv1.CreateProxyRequest{Name: "p2", Spec: managed})
	if st := status.Convert(err); st.Code() != codes.ResourceExhausted || !auth.IsRateLimited(st) {
		t.Errorf("over the limit over gRPC = %v, want RESOURCE_EXHAUSTED (rate limited)", err)
	}
	// A viewer's call is another client's, and reads are not limited.
	req, _ := http.NewRequest(http.MethodGet, "http://"+s.HTTPAddr()+"/v1/providers", nil)
	req.Header.Set("Authorization", "Bearer tok-admin")
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusNotImplemented {
		t.Errorf("an unlimited method after the limit = %v %v, want it through (501)", resp.StatusCode, err)
	} else {
		resp.Body.Close()
	}
}

// managed is the smallest spec the contract accepts.
var managed = &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "local"}
