//go:build e2e

package e2e

import (
	"bufio"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// gatewayToken is the gateway's own token: its leases are the gateway's.
const gatewayToken = "tok-gateway"

// gateway is one started gateway replica.
type gateway struct {
	proc  *proctest.Process
	api   servicetest.Addrs
	proxy string // host:port of the HTTP proxy
	socks string // host:port of the SOCKS5 proxy
}

func (s *suite) startGateway(extra ...string) *gateway {
	s.t.Helper()
	return s.startGatewayEnv(nil, extra...)
}

// startGatewayEnv is startGateway with environment variables added.
func (s *suite) startGatewayEnv(env []string, extra ...string) *gateway {
	s.t.Helper()
	tokenFile := s.write("gateway-token-"+fmt.Sprint(time.Now().UnixNano()), gatewayToken+"\n")
	args := append(append(s.serving(), "--log-level=debug", "--lease-addr="+s.lease.GRPC, "--lease-token-file="+tokenFile,
		"--proxy-listen=127.0.0.1:0", "--socks-listen=127.0.0.1:0"), extra...)
	p, a := servicetest.Start(s.t, "../../services/gateway", args, env...)
	line := p.WaitLog(s.t, 5*time.Second, proctest.Msg("proxy listeners"))
	g := &gateway{proc: p, api: a, proxy: strOf(line["http"]), socks: strOf(line["socks5"])}
	if g.proxy == "" || g.socks == "" {
		s.t.Fatalf("the gateway logged no listeners: %v", line)
	}
	return g
}

func strOf(v any) string {
	s, _ := v.(string)
	return s
}

// plainSite is a plain-HTTP target on host that answers /ban with 418 and
// anything else with 200, recording every path it was asked for.
type plainSite struct {
	*httptest.Server
	mu    sync.Mutex
	paths []string
}

func newPlainSite(t *testing.T, host string) *plainSite {
	t.Helper()
	lis, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	ps := &plainSite{}
	ps.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ps.mu.Lock()
		ps.paths = append(ps.paths, r.URL.Path)
		ps.mu.Unlock()
		if r.Header.Get("Proxy-Authorization") != "" {
			http.Error(w, "credentials reached the target", http.StatusInternalServerError)
			return
		}
		if r.URL.Path == "/ban" {
			http.Error(w, "go away", http.StatusTeapot)
			return
		}
		fmt.Fprintf(w, "plain %s", r.URL.Path)
	}))
	ps.Listener = lis
	ps.Start()
	t.Cleanup(ps.Close)
	return ps
}

func (ps *plainSite) saw(path string) bool {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for _, p := range ps.paths {
		if p == path {
			return true
		}
	}
	return false
}

// through is a Go net/http client using the gateway at addr with the
// given username and token.
func (s *suite) through(addr, user, token string) *http.Client {
	pool := s.site.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs
	return &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{
		Proxy:             http.ProxyURL(&url.URL{Scheme: "http", Host: addr, User: url.UserPassword(user, token)}),
		TLSClientConfig:   &tls.Config{RootCAs: pool},
		DisableKeepAlives: true,
	}}
}

func getVia(t *testing.T, c *http.Client, u string) (*http.Response, string) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func curl(t *testing.T, args ...string) (string, string) {
	t.Helper()
	cmd := exec.Command("curl", append([]string{"-sS", "--max-time", "20"}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("curl %v: %v\n%s", args, err, stderr.String())
	}
	return string(out), stderr.String()
}

// rawConnect sends a CONNECT with the given Proxy-Authorization user and
// token and returns the gateway's status line and body.
func rawConnect(t *testing.T, addr, target, user, token string) (int, string) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	req := &http.Request{Method: http.MethodConnect, URL: &url.URL{Opaque: target}, Host: target, Header: http.Header{}}
	if user != "" || token != "" {
		req.Header.Set("Proxy-Authorization", "Basic "+basic(user, token))
	}
	if err := req.Write(conn); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode == http.StatusOK {
		return resp.StatusCode, resp.Header.Get("X-Egress-Lease")
	}
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// openTunnel sends a CONNECT to target through the gateway at addr and,
// when it is answered 200, returns the open tunnel and the lease id the
// gateway named; otherwise the status and a nil conn.
func openTunnel(t *testing.T, addr, target, user, token string) (net.Conn, int, string) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	req := &http.Request{Method: http.MethodConnect, URL: &url.URL{Opaque: target}, Host: target,
		Header: http.Header{"Proxy-Authorization": {"Basic " + basic(user, token)}}}
	if err := req.Write(conn); err != nil {
		t.Fatal(err)
	}
	// The answer to a CONNECT has no body: reading it byte-exactly leaves
	// the tunnel's bytes on conn.
	resp, err := http.ReadResponse(bufio.NewReaderSize(conn, 1), req)
	if err != nil {
		t.Fatal(err)
	}
	_ = conn.SetDeadline(time.Time{})
	if resp.StatusCode != http.StatusOK {
		conn.Close()
		return nil, resp.StatusCode, ""
	}
	return conn, resp.StatusCode, resp.Header.Get("X-Egress-Lease")
}

// closedWithin reports whether the peer closes conn within d (reading
// whatever it still sends).
func closedWithin(conn net.Conn, d time.Duration) bool {
	_ = conn.SetReadDeadline(time.Now().Add(d))
	_, err := io.Copy(io.Discard, conn)
	var ne net.Error
	return err == nil || !(errors.As(err, &ne) && ne.Timeout())
}

func basic(user, pass string) string {
	u := url.UserPassword(user, pass)
	r := &http.Request{Header: http.Header{}}
	p, _ := u.Password()
	r.SetBasicAuth(u.Username(), p)
	return strings.TrimPrefix(r.Header.Get("Authorization"), "Basic ")
}

// The gateway end to end: two replicas over four squids; rotation, the
// three ways in (HTTP, CONNECT, SOCKS5) with curl, Go, Python requests
// and Scrapy, refusals of bad credentials and options, a session shared
// by both replicas, a ban rule cooling a proxy down for its target only,
// the admin API, spans, each limit, a gateway killed mid-tunnel, the Python
// package's Scrapy middleware in gateway mode, a killed proxy retried
// transparently with the session's move shown, and a session moving off
// its deleted proxy.
func TestGateway(t *testing.T) {
	s := newSuite(t)
	s.startProvisioner("prov-1")
	s.startOrchestrator()
	// Proxies of capacity 8: each gateway replica holds leases ahead
	// (its reservoir), a capacity unit each.
	s.startLease("--default-max-leases=8")
	healthProc, _ := s.startHealth("health-1")
	s.createProxies("gw", 4)
	s.waitAll("gw", 4, "Ready and healthy", 3*time.Minute, ready)
	rulesFile := s.write("gateway-rules.yaml", "rules:\n  - name: teapot\n    outcome: banned\n    status: [418]\n")
	gwA := s.startGateway("--rules-file="+rulesFile, "--retries=1")
	gwB := s.startGateway("--rules-file="+rulesFile, "--retries=1")
	plain := newPlainSite(t, "127.0.0.1")
	banSite := newPlainSite(t, "127.0.0.2")

	// The lease service learns Ready proxies from events: wait until the
	// gateway gets one.
	crawler := s.through(gwA.proxy, "", crawlerToken)
	waittest.ForErr(t, 30*time.Second, "a request through the gateway", func() error {
		resp, err := crawler.Get(plain.URL + "/warmup")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	})

	t.Run("rotation over Go net/http", func(t *testing.T) {
		seen := map[string]int{}
		for i := range 8 {
			resp, body := getVia(t, crawler, fmt.Sprintf("%s/rot%d", plain.URL, i))
			if resp.StatusCode != 200 || body != fmt.Sprintf("plain /rot%d", i) {
				t.Fatalf("request %d: %d %q", i, resp.StatusCode, body)
			}
			seen[resp.Header.Get("X-Egress-Proxy")]++
		}
		if len(seen) < 2 || seen[""] > 0 {
			t.Fatalf("8 requests went through %v; want at least 2 proxies, each named", seen)
		}
	})

	t.Run("curl over HTTP, CONNECT and SOCKS5", func(t *testing.T) {
		out, _ := curl(t, "-x", "http://"+gwB.proxy, "-U", ":"+crawlerToken, plain.URL+"/curl-http")
		if out != "plain /curl-http" {
			t.Fatalf("curl over HTTP: %q", out)
		}
		out, _ = curl(t, "-x", "http://"+gwA.proxy, "--proxy-user", ":"+crawlerToken, "--cacert", s.siteCA, s.site.URL+"/curl-connect")
		if out != "hello from the site, /curl-connect" {
			t.Fatalf("curl over CONNECT: %q", out)
		}
		out, _ = curl(t, "--proxy", "socks5h://provider-local:"+crawlerToken+"@"+gwB.socks, "--cacert", s.siteCA, s.site.URL+"/curl-socks")
		if out != "hello from the site, /curl-socks" {
			t.Fatalf("curl over SOCKS5: %q", out)
		}
		// Go over CONNECT.
		resp, body := getVia(t, s.through(gwB.proxy, "", crawlerToken), s.site.URL+"/go-connect")
		if resp.StatusCode != 200 || body != "hello from the site, /go-connect" {
			t.Fatalf("Go over CONNECT: %d %q", resp.StatusCode, body)
		}
	})

	t.Run("Python requests and a Scrapy spider", func(t *testing.T) {
		py := pythonWithScrapy(t)
		script := s.write("gw-requests.py", `import sys, requests
proxy = "http://provider-local:%s@%s" % (sys.argv[1], sys.argv[2])
r = requests.get(sys.argv[3] + "/py-http", proxies={"http": proxy, "https": proxy}, timeout=20)
print(r.status_code, r.text, r.headers.get("X-Egress-Proxy") != None)
r = requests.get(sys.argv[4] + "/py-https", proxies={"http": proxy, "https": proxy}, verify=sys.argv[5], timeout=20)
print(r.status_code, r.text)
`)
		out, err := exec.Command(py, script, crawlerToken, gwA.proxy, plain.URL, s.site.URL, s.siteCA).CombinedOutput()
		if err != nil || string(out) != "200 plain /py-http True\n200 hello from the site, /py-https\n" {
			t.Fatalf("requests: %v\n%s", err, out)
		}
		feed := filepath.Join(s.dir, "scrapy.json")
		spider := s.write("gw-spider.py", `import sys, scrapy
from scrapy.crawler import CrawlerProcess
base, proxy, feed = sys.argv[1:4]
class Spider(scrapy.Spider):
    name = "gateway"
    def start_requests(self):
        for i in range(4):
            yield scrapy.Request("%s/scrapy%d" % (base, i), meta={"proxy": proxy}, dont_filter=True)
    def parse(self, response):
        yield {"status": response.status, "body": response.text,
               "via": response.headers.get("X-Egress-Proxy", b"").decode()}
p = CrawlerProcess(settings={"FEEDS": {feed: {"format": "json"}}, "LOG_LEVEL": "ERROR",
                             "CONCURRENT_REQUESTS": 2, "TELNETCONSOLE_ENABLED": False})
p.crawl(Spider)
p.start()
`)
		if out, err := exec.Command(py, spider, plain.URL, "http://provider-local:"+crawlerToken+"@"+gwB.proxy, feed).CombinedOutput(); err != nil {
			t.Fatalf("scrapy: %v\n%s", err, out)
		}
		raw, err := os.ReadFile(feed)
		if err != nil {
			t.Fatal(err)
		}
		var items []struct {
			Status    int
			Body, Via string
		}
		if err := json.Unmarshal(raw, &items); err != nil || len(items) != 4 {
			t.Fatalf("scrapy items: %v %s", err, raw)
		}
		for _, it := range items {
			if it.Status != 200 || !strings.HasPrefix(it.Body, "plain /scrapy") || it.Via == "" {
				t.Fatalf("scrapy item %+v", it)
			}
		}
	})

	t.Run("bad credentials get 407 and reach nothing", func(t *testing.T) {
		for _, tok := range []string{"wrong-token", ""} {
			resp, body := getVia(t, s.through(gwA.proxy, "", tok), plain.URL+"/badcred")
			if resp.StatusCode != http.StatusProxyAuthRequired || !strings.HasPrefix(resp.Header.Get("Proxy-Authenticate"), "Basic") {
				t.Fatalf("token %q: %d %v %q", tok, resp.StatusCode, resp.Header, body)
			}
		}
		if code, body := rawConnect(t, gwB.proxy, strings.TrimPrefix(s.site.URL, "https://"), "", "wrong-token"); code != http.StatusProxyAuthRequired {
			t.Fatalf("CONNECT with a wrong token: %d %q", code, body)
		}
		// A viewer's token is valid but lacks the crawler role.
		if resp, _ := getVia(t, s.through(gwA.proxy, "", viewerToken), plain.URL+"/badcred"); resp.StatusCode != http.StatusProxyAuthRequired {
			t.Fatalf("a viewer token: %d", resp.StatusCode)
		}
		if plain.saw("/badcred") {
			t.Fatal("a request with bad credentials reached the target")
		}
		if l := proctest.MetricLine(t, gwA.api.HTTP, `egress_gateway_auth_failures_total{listener="http",reason="invalid"}`); !strings.HasSuffix(l, " 1") {
			t.Fatalf("auth failures metric: %q", l)
		}
	})

	t.Run("a bad option is refused naming it", func(t *testing.T) {
		resp, body := getVia(t, s.through(gwA.proxy, "session-a,country-us", crawlerToken), plain.URL+"/badopt")
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, `"country-us"`) || !strings.Contains(body, "unknown option country") {
			t.Fatalf("HTTP: %d %q", resp.StatusCode, body)
		}
		code, body := rawConnect(t, gwB.proxy, strings.TrimPrefix(s.site.URL, "https://"), "lifetime-forever", crawlerToken)
		if code != http.StatusBadRequest || !strings.Contains(body, `"lifetime-forever"`) {
			t.Fatalf("CONNECT: %d %q", code, body)
		}
		if plain.saw("/badopt") {
			t.Fatal("a request with a bad option reached the target")
		}
	})

	t.Run("a session stays on one proxy across both replicas", func(t *testing.T) {
		var first string
		for i := range 6 {
			g := []*gateway{gwA, gwB}[i%2]
			resp, _ := getVia(t, s.through(g.proxy, "session-s1,lifetime-10m", crawlerToken), plain.URL+"/session")
			name := resp.Header.Get("X-Egress-Proxy")
			if resp.StatusCode != 200 || name == "" {
				t.Fatalf("request %d: %d %q", i, resp.StatusCode, name)
			}
			if first == "" {
				first = name
			}
			if name != first {
				t.Fatalf("request %d of the session went through %s, the first through %s", i, name, first)
			}
		}
		// A tunnel of the session goes there too.
		out, _ := curl(t, "-x", "http://"+gwB.proxy, "-U", "session-s1:"+crawlerToken, "-D", "-", "-o", "/dev/null",
			"--cacert", s.siteCA, s.site.URL+"/session-tunnel")
		if !strings.Contains(out, "X-Egress-Proxy: "+first) {
			t.Fatalf("the session's tunnel answer: %q; want it through %s", out, first)
		}
	})

	t.Run("a ban rule cools the proxy down for its target only", func(t *testing.T) {
		resp, _ := getVia(t, crawler, banSite.URL+"/ban")
		if resp.StatusCode != http.StatusTeapot || resp.Header.Get("X-Egress-Rule") != "teapot" {
			t.Fatalf("the banned answer: %d %v", resp.StatusCode, resp.Header)
		}
		viewer := leasev1.NewLeaseServiceClient(s.conn(s.lease.GRPC, viewerToken))
		cds, err := viewer.ListCooldowns(ctx(t, 10*time.Second), &leasev1.ListCooldownsRequest{})
		if err != nil {
			t.Fatal(err)
		}
		banned := map[string]bool{}
		for _, c := range cds.GetCooldowns() {
			if c.GetCooldown().GetTargetHost() != "127.0.0.2" || c.GetCooldown().GetOutcome() != leasev1.Outcome_OUTCOME_BANNED {
				t.Fatalf("cooldown %v: want BANNED for 127.0.0.2 only", c)
			}
			banned[c.GetProxyName()] = true
		}
		// One try and one retry: two proxies banned.
		if len(banned) != 2 {
			t.Fatalf("cooldowns on %v; want two proxies", banned)
		}
		resp, body := getVia(t, crawler, banSite.URL+"/after-ban")
		if resp.StatusCode != 200 || banned[resp.Header.Get("X-Egress-Proxy")] {
			t.Fatalf("the banned target after the ban: %d %q via %s", resp.StatusCode, body, resp.Header.Get("X-Egress-Proxy"))
		}
		// The banned proxies still serve other targets.
		waittest.For(t, 30*time.Second, "a banned proxy serving another target", func() bool {
			resp, _ := getVia(t, crawler, plain.URL+"/other-target")
			return resp.StatusCode == 200 && banned[resp.Header.Get("X-Egress-Proxy")]
		})
	})

	t.Run("a cooldown reported elsewhere keeps a replica's reservoir away within a second", func(t *testing.T) {
		// Four at once, twice: replica A's reservoir holds leases on
		// several proxies.
		for range 2 {
			var wg sync.WaitGroup
			for i := range 4 {
				wg.Go(func() {
					resp, _ := getVia(t, crawler, fmt.Sprintf("%s/warm%d", plain.URL, i))
					if resp.StatusCode != 200 {
						t.Errorf("warm-up request: %d", resp.StatusCode)
					}
				})
			}
			wg.Wait()
		}
		hits := func() string {
			return proctest.MetricLine(t, gwA.api.HTTP, `egress_gateway_lease_cache_total{result="hit"}`)
		}
		waittest.For(t, 10*time.Second, "replica A to answer from its reservoir", func() bool {
			resp, _ := getVia(t, crawler, plain.URL+"/warm")
			return resp.StatusCode == 200 && !strings.HasSuffix(hits(), " 0")
		})
		// Which proxies A's reservoir serves plain from.
		served := map[string]bool{}
		for i := range 8 {
			resp, _ := getVia(t, crawler, fmt.Sprintf("%s/which%d", plain.URL, i))
			served[resp.Header.Get("X-Egress-Proxy")] = true
		}
		var victim string
		for name := range served {
			victim = name
		}
		// Another client reports a ban of victim for the third site,
		// straight to the lease service.
		third := newPlainSite(t, "127.0.0.3")
		direct := leasev1.NewLeaseServiceClient(s.conn(s.lease.GRPC, crawlerToken))
		l, err := direct.AcquireLease(ctx(t, 10*time.Second), &leasev1.AcquireLeaseRequest{
			Selector: &leasev1.ProxySelector{Labels: map[string]string{"id": victim}}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := direct.ReportOutcome(ctx(t, 10*time.Second), &leasev1.ReportOutcomeRequest{LeaseId: l.GetLease().GetLeaseId(),
			Outcome: leasev1.Outcome_OUTCOME_BANNED, TargetHost: "127.0.0.3"}); err != nil {
			t.Fatal(err)
		}
		reported := time.Now()
		if _, err := direct.ReleaseLease(ctx(t, 10*time.Second), &leasev1.ReleaseLeaseRequest{LeaseId: l.GetLease().GetLeaseId()}); err != nil {
			t.Fatal(err)
		}
		// Within a second of the report, replica A sends nothing for the
		// third site through victim, and still sends plain through it.
		victimServesPlain := false
		for i := range 12 {
			start := time.Now()
			resp, _ := getVia(t, crawler, fmt.Sprintf("%s/third%d", third.URL, i))
			if resp.StatusCode != 200 {
				t.Fatalf("request %d to the third site: %d", i, resp.StatusCode)
			}
			if resp.Header.Get("X-Egress-Proxy") == victim && start.Sub(reported) > time.Second {
				t.Fatalf("request %d to the third site went through %s %v after its ban was reported", i, victim, start.Sub(reported))
			}
			resp, _ = getVia(t, crawler, fmt.Sprintf("%s/plain%d", plain.URL, i))
			victimServesPlain = victimServesPlain || resp.Header.Get("X-Egress-Proxy") == victim
		}
		if !victimServesPlain {
			t.Errorf("%s, banned for the third site only, served no request to another", victim)
		}
	})

	t.Run("the admin API: sessions, ending one, a tunnel's report", func(t *testing.T) {
		call := func(g *gateway, method, path, body string, out any) int {
			req, _ := http.NewRequest(method, "http://"+g.api.HTTP+path, strings.NewReader(body))
			req.Header.Set("Authorization", "Bearer "+crawlerToken)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			raw, _ := io.ReadAll(resp.Body)
			if out != nil && resp.StatusCode == 200 {
				if err := json.Unmarshal(raw, out); err != nil {
					t.Fatalf("%s %s: %v: %s", method, path, err, raw)
				}
			}
			return resp.StatusCode
		}
		var list struct {
			Sessions []struct {
				SessionID string `json:"sessionId"`
				ClientID  string `json:"clientId"`
				ProxyName string `json:"proxyName"`
				Requests  string `json:"requests"`
				BytesDown string `json:"bytesDown"`
			} `json:"sessions"`
		}
		if code := call(gwA, "GET", "/v1/sessions", "", &list); code != 200 || len(list.Sessions) == 0 {
			t.Fatalf("ListSessions = %d %+v", code, list)
		}
		s1 := list.Sessions[0]
		if s1.SessionID != "s1" || s1.ClientID != "crawler-a" || s1.Requests != "3" || s1.BytesDown == "0" || s1.BytesDown == "" {
			t.Fatalf("session s1 on replica A: %+v", s1)
		}
		if code := call(gwB, "GET", "/v1/sessions/s1", "", nil); code != 200 {
			t.Fatalf("GetSession on replica B = %d", code)
		}
		if code := call(gwA, "GET", "/v1/sessions/never", "", nil); code != http.StatusNotFound {
			t.Fatalf("GetSession of an unknown session = %d", code)
		}
		var ended struct {
			Ended bool `json:"ended"`
		}
		if code := call(gwB, "POST", "/v1/sessions/s1:end", "{}", &ended); code != 200 || !ended.Ended {
			t.Fatalf("EndSession = %d %+v", code, ended)
		}
		if code := call(gwA, "POST", "/v1/sessions/s1:end", "{}", &ended); code != 200 || ended.Ended {
			t.Fatalf("EndSession again = %d %+v; want ended false", code, ended)
		}
		// A tunnel's outcome, by the lease id on the CONNECT answer.
		code, leaseID := rawConnect(t, gwA.proxy, strings.TrimPrefix(s.site.URL, "https://"), "", crawlerToken)
		if code != 200 || leaseID == "" {
			t.Fatalf("CONNECT = %d, lease %q", code, leaseID)
		}
		body := `{"leaseId":"` + leaseID + `","outcome":"OUTCOME_CAPTCHA","targetHost":"tunnel.example"}`
		if code := call(gwB, "POST", "/v1/outcomes", body, nil); code != 200 {
			t.Fatalf("ReportOutcome = %d", code)
		}
		if code := call(gwB, "POST", "/v1/outcomes", `{"outcome":"OUTCOME_CAPTCHA","targetHost":"x"}`, nil); code != http.StatusBadRequest {
			t.Fatalf("ReportOutcome with neither id = %d", code)
		}
		viewer := leasev1.NewLeaseServiceClient(s.conn(s.lease.GRPC, viewerToken))
		cds, err := viewer.ListCooldowns(ctx(t, 10*time.Second), &leasev1.ListCooldownsRequest{})
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, c := range cds.GetCooldowns() {
			found = found || (c.GetCooldown().GetTargetHost() == "tunnel.example" && c.GetCooldown().GetOutcome() == leasev1.Outcome_OUTCOME_CAPTCHA)
		}
		if !found {
			t.Fatalf("no captcha cooldown for tunnel.example: %v", cds.GetCooldowns())
		}
	})

	t.Run("one span per request and tunnel, its lease calls its children", func(t *testing.T) {
		// The console exporter writes each span as JSON to stdout, within
		// 100 ms.
		gwT := s.startGatewayEnv([]string{"OTEL_TRACES_EXPORTER=console", "OTEL_BSP_SCHEDULE_DELAY=100"})
		code, tunnelLease := rawConnect(t, gwT.proxy, strings.TrimPrefix(s.site.URL, "https://"), "session-traced", crawlerToken)
		if code != 200 || tunnelLease == "" {
			t.Fatalf("CONNECT: %d %q", code, tunnelLease)
		}
		resp, _ := getVia(t, s.through(gwT.proxy, "", crawlerToken), plain.URL+"/traced")
		requestLease := resp.Header.Get("X-Egress-Lease")
		type span struct {
			Name        string
			SpanContext struct{ TraceID, SpanID string }
			Parent      struct{ TraceID, SpanID string }
			Attributes  []struct {
				Key   string
				Value struct{ Value any }
			}
		}
		attr := func(sp span, key string) string {
			for _, a := range sp.Attributes {
				if a.Key == key {
					return fmt.Sprint(a.Value.Value)
				}
			}
			return ""
		}
		var spans []span
		waittest.For(t, 15*time.Second, "the gateway's spans of both leases", func() bool {
			spans = spans[:0]
			dec := json.NewDecoder(strings.NewReader(gwT.proc.Output()))
			for {
				var sp span
				if err := dec.Decode(&sp); err != nil {
					break
				}
				if sp.Name != "" && sp.SpanContext.SpanID != "" {
					spans = append(spans, sp)
				}
			}
			found := 0
			for _, sp := range spans {
				if (sp.Name == "gateway.connect" && attr(sp, "egress.lease_id") == tunnelLease) ||
					(sp.Name == "gateway.forward" && attr(sp, "egress.lease_id") == requestLease) {
					found++
				}
			}
			return found == 2
		})
		for _, sp := range spans {
			if !strings.HasPrefix(sp.Name, "gateway.") {
				continue
			}
			var acquire bool
			for _, child := range spans {
				acquire = acquire || (child.Name == "egress.lease.v1.LeaseService/AcquireLease" &&
					child.Parent.SpanID == sp.SpanContext.SpanID && child.SpanContext.TraceID == sp.SpanContext.TraceID)
			}
			if !acquire || attr(sp, "egress.client_id") != "crawler-a" || attr(sp, "egress.proxy") == "" {
				t.Fatalf("span %s (%+v): want client crawler-a, its proxy, and its AcquireLease call as a child", sp.Name, sp)
			}
			if sp.Name == "gateway.connect" && attr(sp, "egress.session") != "traced" {
				t.Fatalf("the tunnel's span lacks its session: %+v", sp)
			}
		}
		if out := gwT.proc.Output(); strings.Contains(out, crawlerToken) || strings.Contains(out, gatewayToken) {
			t.Fatal("a token reached the gateway's output")
		}
		// Give the session's proxy back: every proxy holds one lease.
		req, _ := http.NewRequest("POST", "http://"+gwT.api.HTTP+"/v1/sessions/traced:end", strings.NewReader("{}"))
		req.Header.Set("Authorization", "Bearer "+crawlerToken)
		if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 200 {
			t.Fatalf("ending session traced: %v %v", resp, err)
		}
	})

	t.Run("each limit refuses with its status and a metric", func(t *testing.T) {
		gwL := s.startGateway("--max-client-tunnels=2", "--max-tunnels=3", "--max-header-bytes=2048",
			"--read-header-timeout=1s", "--tunnel-idle-timeout=2s", "--tunnel-max-lifetime=4s")
		target := strings.TrimPrefix(plain.URL, "http://")
		refusals := func(limit string) string {
			return proctest.MetricLine(t, gwL.api.HTTP, `egress_gateway_limit_refusals_total{limit="`+limit+`"}`)
		}
		// Tunnels per client (crawler-a holds two) and in all (the
		// gateway's own crawler token takes the third).
		var open []net.Conn
		defer func() {
			for _, c := range open {
				c.Close()
			}
		}()
		for i := range 2 {
			c, code, _ := openTunnel(t, gwL.proxy, target, "", crawlerToken)
			if c == nil {
				t.Fatalf("crawler-a's tunnel %d: %d", i, code)
			}
			open = append(open, c)
		}
		if _, code, _ := openTunnel(t, gwL.proxy, target, "", crawlerToken); code != http.StatusTooManyRequests {
			t.Fatalf("crawler-a's third tunnel: %d, want 429", code)
		}
		c, code, _ := openTunnel(t, gwL.proxy, target, "", gatewayToken)
		if c == nil {
			t.Fatalf("the other client's first tunnel: %d", code)
		}
		open = append(open, c)
		if _, code, _ := openTunnel(t, gwL.proxy, target, "", gatewayToken); code != http.StatusServiceUnavailable {
			t.Fatalf("a fourth tunnel in all: %d, want 503", code)
		}
		if !strings.HasSuffix(refusals("tunnels_per_client"), " 1") || !strings.HasSuffix(refusals("tunnels_total"), " 1") {
			t.Fatalf("refusal metrics: %q, %q", refusals("tunnels_per_client"), refusals("tunnels_total"))
		}
		// Idle tunnels are closed after 2s (the three above, which send nothing).
		for i, c := range open {
			if !closedWithin(c, 10*time.Second) {
				t.Fatalf("idle tunnel %d still open after 10s", i)
			}
		}
		// Counted once the tunnel's goroutines are done, a moment after the close.
		waittest.For(t, 5*time.Second, "three idle closes counted", func() bool { return strings.HasSuffix(refusals("idle"), " 3") })
		// A busy tunnel is closed at its maximum lifetime (4s).
		busy, code, _ := openTunnel(t, gwL.proxy, target, "", crawlerToken)
		if busy == nil {
			t.Fatalf("the busy tunnel: %d", code)
		}
		defer busy.Close()
		started := time.Now()
		br := bufio.NewReader(busy)
		for {
			_ = busy.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := fmt.Fprintf(busy, "GET /busy HTTP/1.1\r\nHost: %s\r\n\r\n", target); err != nil {
				break
			}
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				break
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if time.Since(started) > 15*time.Second {
				t.Fatal("the busy tunnel outlived its maximum lifetime by 11s")
			}
			time.Sleep(300 * time.Millisecond)
		}
		if lived := time.Since(started); lived < 3*time.Second {
			t.Fatalf("the busy tunnel closed after %v, before its lifetime", lived)
		}
		waittest.For(t, 5*time.Second, "the lifetime close counted", func() bool { return strings.HasSuffix(refusals("tunnel_lifetime"), " 1") })
		// Headers well over 2 KiB (net/http reads up to 4 KiB past the
		// limit before it refuses): 431, and nothing reaches the target.
		req, _ := http.NewRequest("GET", plain.URL+"/big-header", nil)
		req.Header.Set("X-Filler", strings.Repeat("f", 16<<10))
		resp, err := s.through(gwL.proxy, "", crawlerToken).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge || plain.saw("/big-header") {
			t.Fatalf("a 16 KiB header: %d (reached the target: %v)", resp.StatusCode, plain.saw("/big-header"))
		}
		// A client that never finishes its headers is disconnected after 1s.
		slow, err := net.Dial("tcp", gwL.proxy)
		if err != nil {
			t.Fatal(err)
		}
		defer slow.Close()
		fmt.Fprintf(slow, "GET %s/slowloris HTTP/1.1\r\nHost: %s\r\nX-Slow: ", plain.URL, target)
		if !closedWithin(slow, 10*time.Second) {
			t.Fatal("a client stuck in its headers is still connected after 10s")
		}
		waittest.For(t, 5*time.Second, "the read-header timeout counted", func() bool {
			return strings.HasSuffix(refusals("read_header_timeout"), " 1")
		})
	})

	t.Run("a gateway killed mid-tunnel leaves no lease past its TTL", func(t *testing.T) {
		gwK := s.startGateway("--lease-ttl=6s")
		conn, code, leaseID := openTunnel(t, gwK.proxy, strings.TrimPrefix(plain.URL, "http://"), "", crawlerToken)
		if conn == nil || leaseID == "" {
			t.Fatalf("CONNECT: %d, lease %q", code, leaseID)
		}
		defer conn.Close()
		leases := leasev1.NewLeaseServiceClient(s.conn(s.lease.GRPC, opsToken))
		live := func() bool {
			list, err := leases.ListLeases(ctx(t, 10*time.Second), &leasev1.ListLeasesRequest{ClientId: "gateway", PageSize: 1000})
			if err != nil {
				t.Fatal(err)
			}
			for _, l := range list.GetLeases() {
				if l.GetLeaseId() == leaseID {
					return true
				}
			}
			return false
		}
		// The tunnel's lease is renewed while it lives: still live past
		// two TTLs.
		time.Sleep(13 * time.Second)
		if !live() {
			t.Fatal("the open tunnel's lease ended within two TTLs: it is not renewed")
		}
		gwK.proc.Kill(t)
		killed := time.Now()
		waittest.For(t, 30*time.Second, "the killed gateway's lease to end", func() bool { return !live() })
		if after := time.Since(killed); after > 6*time.Second+5*time.Second {
			t.Errorf("the lease outlived the killed gateway by %v; its TTL is 6s", after)
		}
		proxies, err := leases.ListProxies(ctx(t, 10*time.Second), &leasev1.ListProxiesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range proxies.GetProxies() {
			if p.GetMaxLeases() > 0 && p.GetActiveLeases() > p.GetMaxLeases() {
				t.Errorf("proxy %s over capacity: %d leases of %d", p.GetProxyName(), p.GetActiveLeases(), p.GetMaxLeases())
			}
		}
	})

	t.Run("the Scrapy middleware in gateway mode", func(t *testing.T) {
		// clients/python/tests/test_gateway.py: a session per domain over
		// replica A, a ban reported through replica B's admin API. After
		// the admin API's subtest, which counts replica A's sessions, and
		// the ban rule's, which counts every cooldown.
		python := pythonWithScrapy(t)
		dir, err := filepath.Abs("../../clients/python")
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.CommandContext(ctx(t, 5*time.Minute), python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gateway", "tests")
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "EGRESS_GATEWAY_URL=http://"+gwA.proxy, "EGRESS_GATEWAY_ADMIN_URL=http://"+gwB.api.HTTP,
			"EGRESS_TOKEN="+crawlerToken, "PYTHONPATH="+dir, "PYTHONDONTWRITEBYTECODE=1")
		out, err := cmd.CombinedOutput()
		t.Logf("pytest:\n%s", out)
		if err != nil {
			t.Fatalf("pytest: %v", err)
		}
		if m := regexp.MustCompile(`(\d+) passed`).FindStringSubmatch(string(out)); m == nil || strings.Contains(string(out), "skipped") {
			t.Fatal("pytest ran no test or skipped some")
		}
	})

	t.Run("a killed proxy is retried transparently and the session's move shown", func(t *testing.T) {
		// Nothing may notice the death before the gateway does.
		healthProc.Kill(t)
		resp, _ := getVia(t, s.through(gwB.proxy, "session-k1", crawlerToken), plain.URL+"/before-kill")
		victim := resp.Header.Get("X-Egress-Proxy")
		if resp.StatusCode != 200 || victim == "" {
			t.Fatalf("the session's first request: %d", resp.StatusCode)
		}
		all, err := s.proxies().ListProxies(ctx(t, 10*time.Second), &proxyv1.ListProxiesRequest{PageSize: 1000})
		if err != nil {
			t.Fatal(err)
		}
		var addr string
		for _, p := range all.GetProxies() {
			if p.GetName() == victim {
				killInstancesUnder(filepath.Join(s.stateDir, p.GetUid()))
				addr = net.JoinHostPort(p.GetStatus().GetIp(), fmt.Sprint(p.GetStatus().GetPort()))
			}
		}
		waittest.For(t, 10*time.Second, "the killed proxy refusing connections", func() bool {
			c, err := net.DialTimeout("tcp", addr, time.Second)
			if err == nil {
				c.Close()
			}
			return err != nil
		})
		resp, body := getVia(t, s.through(gwA.proxy, "session-k1", crawlerToken), plain.URL+"/after-kill")
		if resp.StatusCode != 200 || body != "plain /after-kill" {
			t.Fatalf("after the kill: %d %q", resp.StatusCode, body)
		}
		if got := resp.Header.Get("X-Egress-Proxy"); got == victim {
			t.Fatalf("went through the killed proxy %s", got)
		}
		if moved := resp.Header.Get("X-Egress-Session-Moved"); moved != victim+"; reason=cooling_down" {
			t.Fatalf("X-Egress-Session-Moved = %q; want the move off %s", moved, victim)
		}
		if l := proctest.MetricLine(t, gwA.api.HTTP, `egress_gateway_retries_total{reason="upstream_unreachable"}`); !strings.HasSuffix(l, " 1") {
			t.Fatalf("retries metric: %q", l)
		}
	})
	t.Run("a session moves when its proxy is deleted", func(t *testing.T) {
		// Every proxy holds one lease at a time: end k1 so that a proxy is
		// free to move to.
		req, _ := http.NewRequest("POST", "http://"+gwA.api.HTTP+"/v1/sessions/k1:end", strings.NewReader("{}"))
		req.Header.Set("Authorization", "Bearer "+crawlerToken)
		if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 200 {
			t.Fatalf("ending session k1: %v %v", resp, err)
		}
		resp, _ := getVia(t, s.through(gwA.proxy, "session-d1", crawlerToken), plain.URL+"/before-delete")
		doomed := resp.Header.Get("X-Egress-Proxy")
		if resp.StatusCode != 200 || doomed == "" {
			t.Fatalf("the session's first request: %d", resp.StatusCode)
		}
		if _, err := s.proxies().DeleteProxy(ctx(t, 10*time.Second), &proxyv1.DeleteProxyRequest{Name: doomed}); err != nil {
			t.Fatal(err)
		}
		// The lease service learns of the deletion from events (first no
		// longer Ready, then deleted); until then the session may still go
		// through the proxy.
		var moved *http.Response
		waittest.For(t, 60*time.Second, "the session off its deleted proxy", func() bool {
			resp, _ := getVia(t, s.through(gwB.proxy, "session-d1", crawlerToken), plain.URL+"/after-delete")
			if resp.StatusCode == 200 && resp.Header.Get("X-Egress-Proxy") != doomed {
				moved = resp
				return true
			}
			return false
		})
		if m := moved.Header.Get("X-Egress-Session-Moved"); !regexp.MustCompile(`^` + regexp.QuoteMeta(doomed) + `; reason=proxy_(deleted|draining|unhealthy)$`).MatchString(m) {
			t.Fatalf("X-Egress-Session-Moved = %q; want the move off the deleted %s", m, doomed)
		}
		again, _ := getVia(t, s.through(gwA.proxy, "session-d1", crawlerToken), plain.URL+"/settled")
		if again.Header.Get("X-Egress-Proxy") != moved.Header.Get("X-Egress-Proxy") || again.Header.Get("X-Egress-Session-Moved") != "" {
			t.Fatalf("after the move the session went through %s (moved %q); want %s, settled",
				again.Header.Get("X-Egress-Proxy"), again.Header.Get("X-Egress-Session-Moved"), moved.Header.Get("X-Egress-Proxy"))
		}
	})
}
