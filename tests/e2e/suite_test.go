//go:build e2e

// Package e2e runs the suite as it runs in production: every service a
// real process built from its binary, talking over real PostgreSQL and NATS
// JetStream, with real forward proxies from provisioner-local. Run with
// `make test-e2e`.
package e2e

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/tlstest"
)

const (
	opsToken     = "tok-ops"
	crawlerToken = "tok-crawler"
	serviceToken = "tok-service"
	viewerToken  = "tok-viewer"
	// serverName is the name on every service's certificate in TLS suites.
	serverName = "egress.test"
)

// suite is one installation: a database, a NATS server, a TLS site to
// fetch through the proxies, token files, and the processes.
type suite struct {
	t         *testing.T
	dsn       string
	nats      *natstest.Server
	dir       string
	stateDir  string
	providers string
	site      *httptest.Server
	siteCA    string
	tokens    string // every service's token file: one client per role
	svcFile   string // the service token the services call each other with
	// tls, set before starting anything, serves every API over TLS with
	// a certificate from caFile's CA, and dials them so.
	tls      bool
	caFile   string
	certFile string
	keyFile  string
	// cloudInitKeys is the orchestrator's cloud-init keyring.
	cloudInitKeys string
	// installation is the orchestrator's installation id, its own per
	// suite (two suites may share a backend).
	installation string

	orchestrator servicetest.Addrs
	lease        servicetest.Addrs
	provisioner  servicetest.Addrs
}

func newSuite(t *testing.T) *suite {
	t.Helper()
	s := &suite{t: t, dir: t.TempDir(), nats: natstest.New(t)}
	// One empty database for every service; each migrates its own schema.
	s.dsn = pgtest.NewDatabase(t, pgtest.Template{Name: "e2e_empty", Fingerprint: "none",
		Migrate: func(context.Context, string) error { return nil }})
	// squid drops to its own user, which must reach the instances.
	for d := s.dir; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		_ = os.Chmod(d, 0o755)
	}
	s.stateDir = filepath.Join(s.dir, "local")
	network := fmt.Sprintf("127.%d.%d.0/24", 150+time.Now().Nanosecond()%50, time.Now().Nanosecond()/50%250)
	s.providers = s.write("providers.yaml", fmt.Sprintf(
		"providers:\n  - name: local\n    type: local\n    local: {stateDir: %q, network: %q}\n", s.stateDir, network))
	s.tokens = s.write("tokens", "ops "+opsToken+" admin\ncrawler-a "+crawlerToken+" crawler\n"+
		"dashboard "+viewerToken+" viewer\nsuite "+serviceToken+" service\ngateway "+gatewayToken+" crawler,service\n")
	s.svcFile = s.write("service-token", serviceToken+"\n")
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		t.Fatal(err)
	}
	s.installation = fmt.Sprintf("e2e-%x", key[:6])
	s.cloudInitKeys = s.write("cloud-init-keys.yaml", "active: e2e\nkeys:\n  e2e: "+base64.StdEncoding.EncodeToString(key)+"\n")

	s.site = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from the site, %s", r.URL.Path)
	}))
	t.Cleanup(s.site.Close)
	s.siteCA = s.write("site-ca.pem", string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: s.site.Certificate().Raw})))
	t.Cleanup(s.killLocalProxies)
	return s
}

func (s *suite) write(name, content string) string {
	p := filepath.Join(s.dir, name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		s.t.Fatal(err)
	}
	return p
}

// killLocalProxies stops every proxy process of this suite's instances.
func (s *suite) killLocalProxies() { killInstancesUnder(s.stateDir) }

// killInstancesUnder kills the local instances whose state is under dir.
func killInstancesUnder(dir string) {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(cmdline), dir+"/") {
			if p, err := os.FindProcess(atoi(e.Name())); err == nil {
				_ = p.Kill()
			}
		}
	}
}

func atoi(s string) int {
	n := 0
	for _, c := range s {
		if c < '0' || c > '9' {
			return -1
		}
		n = n*10 + int(c-'0')
	}
	return n
}

func (s *suite) common() []string {
	return append([]string{"--database-url=" + s.dsn, "--nats-url=" + s.nats.URL(), "--log-level=debug"}, s.serving()...)
}

// serving are the flags every service serves its APIs with: the token file,
// and the certificate in TLS suites.
func (s *suite) serving() []string {
	args := []string{"--auth-token-file=" + s.tokens}
	if s.tls {
		if s.caFile == "" {
			// Only the name: clients must set it, the loopback address
			// the services are dialled at will not do.
			ca := tlstest.NewCA(s.t, "egress e2e CA")
			s.caFile = ca.File
			s.certFile, s.keyFile = ca.Issue(s.t, serverName)
		}
		// The REST layer verifies its own gRPC port like every client.
		args = append(args, "--tls-cert-file="+s.certFile, "--tls-key-file="+s.keyFile,
			"--rest-ca-file="+s.caFile, "--rest-server-name="+serverName)
	}
	return args
}

// peer are the flags a service reaches another with (prefix orchestrator
// or provisioner): the service token, and the CA and name in TLS suites.
func (s *suite) peer(prefix string) []string {
	args := []string{"--" + prefix + "-token-file=" + s.svcFile}
	if s.tls {
		args = append(args, "--"+prefix+"-ca-file="+s.caFile, "--"+prefix+"-server-name="+serverName)
	}
	return args
}

// client is how the test reaches a service's gRPC API with token.
func (s *suite) client(addr, token string) service.Client {
	c := service.Client{Addr: addr, Token: token}
	if s.tls {
		c.CAFile, c.ServerName = s.caFile, serverName
	}
	return c
}

// httpClient and base are how the test reaches a service's HTTP port.
func (s *suite) httpClient() *http.Client {
	if !s.tls {
		return http.DefaultClient
	}
	pem, err := os.ReadFile(s.caFile)
	if err != nil {
		s.t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: serverName}}}
}

func (s *suite) base(httpAddr string) string {
	if s.tls {
		return "https://" + httpAddr
	}
	return "http://" + httpAddr
}

func (s *suite) startOrchestrator() *proctest.Process {
	p, a := servicetest.Start(s.t, "../../services/orchestrator", append(s.common(),
		"--providers-config="+s.providers, "--cloud-init-key-file="+s.cloudInitKeys, "--installation-id="+s.installation,
		"--gc-interval=2s", "--gc-grace=1s", "--resync-interval=3s",
		"--provisioning-poll=200ms", "--deletion-poll=200ms", "--create-deadline=30s", "--get-deadline=10s", "--delete-deadline=20s"))
	s.orchestrator = a
	return p
}

func (s *suite) startLease(extra ...string) *proctest.Process {
	p, a := servicetest.Start(s.t, "../../services/lease", append(append(append(s.common(), s.peer("orchestrator")...),
		"--orchestrator-addr="+s.orchestrator.GRPC, "--resync-interval=5s"), extra...))
	s.lease = a
	return p
}

func (s *suite) startHealth(replica string) (*proctest.Process, servicetest.Addrs) {
	return s.startHealthWith(replica)
}

// startHealthWith starts a health replica with extra flags.
func (s *suite) startHealthWith(replica string, extra ...string) (*proctest.Process, servicetest.Addrs) {
	return servicetest.Start(s.t, "../../services/health", append(append(append(s.common(), s.peer("provisioner")...),
		"--providers-config="+s.providers, "--replica-id="+replica,
		"--probe-target="+s.site.URL+"/probe", "--probe-ca-file="+s.siteCA, "--probe-interval=500ms", "--probe-timeout=500ms",
		"--membership-ttl=3s", "--provisioner=local="+s.provisioner.GRPC, "--provider-check-interval=10s"), extra...))
}

func (s *suite) startProvisioner(replica string, extra ...string) *proctest.Process {
	args := append(append([]string{"--nats-url=" + s.nats.URL(), "--log-level=debug",
		"--providers-config=" + s.providers, "--provider=local", "--replica-id=" + replica, "--ack-wait=5s"}, s.serving()...), extra...)
	p, a := servicetest.Start(s.t, "../../services/provisioner-local", args)
	if s.provisioner.GRPC == "" {
		s.provisioner = a
	}
	return p
}

// startAll starts one of everything.
func (s *suite) startAll() {
	s.startProvisioner("prov-1")
	s.startOrchestrator()
	s.startLease()
	s.startHealth("health-1")
}

func (s *suite) conn(addr, token string) *grpc.ClientConn {
	s.t.Helper()
	c := s.client(addr, token)
	conn, err := c.Dial()
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { conn.Close() })
	return conn
}

func (s *suite) proxies() proxyv1.ProxyServiceClient {
	return proxyv1.NewProxyServiceClient(s.conn(s.orchestrator.GRPC, opsToken))
}

func (s *suite) leases() leasev1.LeaseServiceClient {
	return leasev1.NewLeaseServiceClient(s.conn(s.lease.GRPC, crawlerToken))
}

func (s *suite) health(addr string) healthv1.HealthServiceClient {
	return healthv1.NewHealthServiceClient(s.conn(addr, viewerToken))
}

func ctx(t *testing.T, d time.Duration) context.Context {
	c, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return c
}

// createProxies creates n managed proxies named prefix-NN on local.
func (s *suite) createProxies(prefix string, n int) []*proxyv1.Proxy {
	s.t.Helper()
	c := s.proxies()
	var out []*proxyv1.Proxy
	for i := range n {
		name := fmt.Sprintf("%s-%02d", prefix, i)
		resp, err := c.CreateProxy(ctx(s.t, 30*time.Second), &proxyv1.CreateProxyRequest{
			Name: name, Labels: map[string]string{"id": name},
			Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "local"},
		})
		if err != nil {
			s.t.Fatalf("create %s: %v", name, err)
		}
		out = append(out, resp.GetProxy())
	}
	return out
}

// waitAll polls ListProxies until cond holds for every proxy with prefix
// (and there are want of them), failing after timeout.
func (s *suite) waitAll(prefix string, want int, what string, timeout time.Duration, cond func(*proxyv1.Proxy) bool) []*proxyv1.Proxy {
	s.t.Helper()
	c := s.proxies()
	deadline := time.Now().Add(timeout)
	for {
		resp, err := c.ListProxies(ctx(s.t, 10*time.Second), &proxyv1.ListProxiesRequest{PageSize: 1000})
		var matched []*proxyv1.Proxy
		ok := 0
		if err == nil {
			for _, p := range resp.GetProxies() {
				if strings.HasPrefix(p.GetName(), prefix+"-") {
					matched = append(matched, p)
					if cond(p) {
						ok++
					}
				}
			}
			if len(matched) == want && ok == want {
				return matched
			}
		}
		if time.Now().After(deadline) {
			var states []string
			for _, p := range matched {
				states = append(states, p.GetName()+"="+p.GetStatus().GetPhase().String()+"/"+p.GetStatus().GetReason()+":"+p.GetStatus().GetMessage())
			}
			s.t.Fatalf("%s: %d of %d proxies %s after %s (err %v): %v", prefix, ok, want, what, timeout, err, states)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func ready(p *proxyv1.Proxy) bool {
	return p.GetStatus().GetPhase() == proxyv1.ProxyPhase_PROXY_PHASE_READY && p.GetStatus().GetHealthy()
}

func running(p *proxyv1.Proxy) bool {
	ph := p.GetStatus().GetPhase()
	return ph == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING || ph == proxyv1.ProxyPhase_PROXY_PHASE_READY
}

// fetchThrough fetches path from the site through the proxy at host:port.
func (s *suite) fetchThrough(host string, port uint32, path string) (string, error) {
	pool := s.site.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		Proxy:           http.ProxyURL(&url.URL{Scheme: "http", Host: fmt.Sprintf("%s:%d", host, port)}),
		TLSClientConfig: &tls.Config{RootCAs: pool},
	}}
	resp, err := client.Get(s.site.URL + path)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// instanceDirs lists the local backend's instance directories.
func (s *suite) instanceDirs() []string {
	entries, _ := os.ReadDir(s.stateDir)
	var out []string
	for _, e := range entries {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out
}
