package integration

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/elazarl/goproxy"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/egress-proxies/egress-proxies/clients/go/egress"
	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const token = "tok-crawler-0123456789"

// suite is one lease service (a real process) with its database and NATS,
// forward proxies it knows about, and the sites they reach.
type suite struct {
	t       *testing.T
	nats    *natstest.Server
	lease   servicetest.Addrs
	proc    *proctest.Process
	proxies []*forwardProxy
	site    *site
	raw     leasev1.LeaseServiceClient
}

// newSuite starts a lease service fed n proxies of capacity 1 over NATS,
// as the orchestrator publishes them. TTLs down to 1s are allowed and
// expired leases are swept every 200ms.
func newSuite(t *testing.T, n int) *suite {
	t.Helper()
	return newSuiteTLS(t, n, nil)
}

// newSuiteTLS is newSuite with the lease service serving TLS with tf's
// certificate when tf is set.
func newSuiteTLS(t *testing.T, n int, tf *tlsFiles, extraArgs ...string) *suite {
	t.Helper()
	s := &suite{t: t, nats: natstest.New(t), site: newSite(t)}
	dsn := pgtest.NewDatabase(t, pgtest.Template{Name: "clients_empty", Fingerprint: "none",
		Migrate: func(context.Context, string) error { return nil }})
	tokens := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(tokens, []byte("crawler-a "+token+" crawler\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	args := []string{
		"--database-url=" + dsn, "--nats-url=" + s.nats.URL(), "--auth-token-file=" + tokens,
		"--min-ttl=1s", "--sweep-interval=200ms", "--mirror-refresh-interval=200ms",
	}
	args = append(args, extraArgs...)
	creds := insecure.NewCredentials()
	if tf != nil {
		args = append(args, "--tls-cert-file="+tf.certFile, "--tls-key-file="+tf.keyFile)
		creds = credentials.NewTLS(&tls.Config{RootCAs: tf.pool, ServerName: tlsServerName})
	}
	s.proc, s.lease = servicetest.Start(t, "../../../services/lease", args)
	conn, err := grpc.NewClient(s.lease.GRPC, grpc.WithTransportCredentials(creds),
		grpc.WithPerRPCCredentials(auth.BearerToken(token)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	s.raw = leasev1.NewLeaseServiceClient(conn)
	for i := range n {
		p := startForwardProxy(t, s.site, net.IPv4(127, 0, 0, byte(20+i)))
		s.proxies = append(s.proxies, p)
		s.publish(proxySnapshot(i, p), 1)
	}
	s.waitLeasable(n)
	return s
}

// proxySnapshot is proxy i as the orchestrator publishes it: Ready and
// healthy, one lease at a time.
func proxySnapshot(i int, p *forwardProxy) *proxyv1.Proxy {
	one := uint32(1)
	return &proxyv1.Proxy{
		Uid:    fmt.Sprintf("c1000000-0000-4000-8000-%012d", i),
		Name:   fmt.Sprintf("proxy-%d", i),
		Labels: map[string]string{"id": fmt.Sprintf("proxy-%d", i)},
		Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "local",
			Lease: &proxyv1.LeaseSpec{MaxLeases: &one}},
		Status: &proxyv1.ProxyStatus{
			Phase: proxyv1.ProxyPhase_PROXY_PHASE_READY, ProviderId: fmt.Sprintf("instance-%d", i),
			Ip: "127.0.0.1", Port: uint32(p.port), Healthy: true,
			HealthTransitionTime: timestamppb.New(time.Now().Add(-time.Minute)),
		},
	}
}

func (s *suite) publish(p *proxyv1.Proxy, revision int64) {
	s.t.Helper()
	ev := &busv1.ProxyEvent{Revision: revision, Type: proxyv1.ChangeType_CHANGE_TYPE_UPDATED, Proxy: p, ChangeTime: timestamppb.Now()}
	if _, err := bus.Publish(ctx(s.t), s.nats.JetStream(s.t), bus.Names{}.ProxyEventSubject(p.GetUid()), ev); err != nil {
		s.t.Fatal(err)
	}
}

// waitLeasable waits until the service offers n proxies.
func (s *suite) waitLeasable(n int) {
	s.t.Helper()
	waittest.For(s.t, 20*time.Second, fmt.Sprintf("%d proxies leasable", n), func() bool {
		// The service may still be starting: an error is "not yet".
		resp, err := s.raw.ListProxies(ctx(s.t), &leasev1.ListProxiesRequest{})
		return err == nil && len(resp.GetProxies()) == n
	})
}

// list is the service's leasable proxies. A failed call fails the test
// (Errorf, so that subtests' goroutines may call it): an empty answer
// would read as "no active lease" and pass a check it should fail.
func (s *suite) list() []*leasev1.LeasableProxy {
	s.t.Helper()
	resp, err := s.raw.ListProxies(ctx(s.t), &leasev1.ListProxiesRequest{})
	if err != nil {
		s.t.Errorf("ListProxies: %v", err)
		return nil
	}
	return resp.GetProxies()
}

// proxy returns the service's view of the named proxy.
func (s *suite) proxy(name string) *leasev1.LeasableProxy {
	s.t.Helper()
	for _, p := range s.list() {
		if p.GetProxyName() == name {
			return p
		}
	}
	s.t.Fatalf("proxy %s not leasable", name)
	return nil
}

func (s *suite) activeLeases() int {
	n := 0
	for _, p := range s.list() {
		n += int(p.GetActiveLeases())
	}
	return n
}

// proxyByName maps a lease's proxy name to its forward proxy.
func (s *suite) proxyByName(name string) *forwardProxy {
	s.t.Helper()
	i, err := strconv.Atoi(strings.TrimPrefix(name, "proxy-"))
	if err != nil || i >= len(s.proxies) {
		s.t.Fatalf("unknown proxy %q", name)
	}
	return s.proxies[i]
}

// client is a Go client of the suite trusting the sites' CAs.
func (s *suite) client(o egress.Options) *egress.Client {
	s.t.Helper()
	o.Token, o.Insecure = token, true
	o.BaseTransport = &http.Transport{TLSClientConfig: &tls.Config{RootCAs: s.site.roots}}
	c, err := egress.New(s.lease.GRPC, o)
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { c.Close() })
	return c
}

// site serves https://example.com (the TLS test server's certificate names
// it) and plain-HTTP hosts ending in .test; the forward proxies route both
// names to it. Every answer is decided by answer, by the proxy it came
// through (the source address) and the host asked for.
type site struct {
	tls, plain *httptest.Server
	roots      *x509.CertPool

	slow chan struct{} // a request for /slow (never answered) or /hold arrived
	hold chan struct{} // a request for /hold waits for a value

	mu     sync.Mutex
	seen   map[string][]string // host → source IPs in order
	answer func(host, ip string, first bool) (int, string)
}

func newSite(t *testing.T) *site {
	s := &site{seen: map[string][]string{}, slow: make(chan struct{}, 16), hold: make(chan struct{})}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ip, _, _ := net.SplitHostPort(r.RemoteAddr)
		host := strings.ToLower(r.Host)
		if h, _, err := net.SplitHostPort(host); err == nil {
			host = h
		}
		s.mu.Lock()
		first := true
		for _, seen := range s.seen[host] {
			if seen == ip {
				first = false
			}
		}
		s.seen[host] = append(s.seen[host], ip)
		answer := s.answer
		s.mu.Unlock()
		code, body := http.StatusOK, "page "+r.URL.Path+" via "+ip
		if answer != nil {
			if c, b := answer(host, ip, first); c != 0 {
				code, body = c, b
			}
		}
		if r.URL.Path == "/hold" {
			s.slow <- struct{}{}
			<-s.hold
		}
		if r.URL.Path == "/slow" {
			s.slow <- struct{}{}
			<-r.Context().Done()
			// Never answer. Returning would answer 200 with an empty body
			// once the client's close_notify ends the request here, and a
			// client still reading gets that answer instead of its own
			// cancellation (TestSlowIsNeverAnswered). The abort closes the
			// connection without a response.
			panic(http.ErrAbortHandler)
		}
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(code)
		io.WriteString(w, body)
	})
	s.tls = httptest.NewTLSServer(h)
	s.plain = httptest.NewServer(h)
	t.Cleanup(s.tls.Close)
	t.Cleanup(s.plain.Close)
	s.roots = x509.NewCertPool()
	s.roots.AddCert(s.tls.Certificate())
	return s
}

func (s *site) setAnswer(f func(host, ip string, first bool) (int, string)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.answer = f
}

// sources returns the source IPs that reached host, in order.
func (s *site) sources(host string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.seen[host]...)
}

// forwardProxy is a real HTTP forward proxy (CONNECT tunnels and plain
// HTTP) whose outgoing connections leave from its own loopback address, so
// the site can tell proxies apart as a real target tells IPs apart.
type forwardProxy struct {
	port int
	ip   string
}

func startForwardProxy(t *testing.T, st *site, source net.IP) *forwardProxy {
	t.Helper()
	dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: source}, Timeout: 5 * time.Second}
	route := func(addr string) string {
		host, _, _ := net.SplitHostPort(addr)
		switch {
		case host == "example.com":
			return st.tls.Listener.Addr().String()
		case strings.HasSuffix(host, ".test"):
			return st.plain.Listener.Addr().String()
		}
		return addr
	}
	p := goproxy.NewProxyHttpServer()
	p.Tr = &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return dialer.DialContext(ctx, network, route(addr))
		},
		DisableKeepAlives: true,
	}
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	_, port, _ := net.SplitHostPort(srv.Listener.Addr().String())
	n, _ := strconv.Atoi(port)
	return &forwardProxy{port: n, ip: source.String()}
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

// get fetches url through rt and returns status and body.
func get(t *testing.T, rt http.RoundTripper, url string) (int, string, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx(t), http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}
