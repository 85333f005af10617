//go:build e2e

package e2e

import (
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// The crawler clients against the whole suite: the Go example crawler
// (examples/crawler) and the Python package with its Scrapy middleware
// (clients/python, its pytest suite) crawl local sites through proxies of
// the local backend, leased from the lease service, with bans injected by
// the sites.
func TestCrawlerClients(t *testing.T) {
	python := pythonWithScrapy(t)
	s := newSuite(t)
	s.startAll()
	// Each ban keeps a proxy away from the site (127.0.0.1) for minutes:
	// the Go crawl meets 2, the Scrapy crawl 3.
	s.createProxies("crawl", 8)
	s.waitAll("crawl", 8, "Ready and healthy", 3*time.Minute, ready)
	waittest.For(t, time.Minute, "the lease service offers the 8 proxies", func() bool {
		req, _ := http.NewRequest(http.MethodGet, "http://"+s.lease.HTTP+"/v1/leasable-proxies", nil)
		req.Header.Set("Authorization", "Bearer "+crawlerToken)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var body struct {
			Proxies []json.RawMessage `json:"proxies"`
		}
		return json.NewDecoder(resp.Body).Decode(&body) == nil && len(body.Proxies) == 8
	})

	t.Run("go example crawler", func(t *testing.T) {
		bin := proctest.Build(t, "../../examples/crawler")
		cmd := exec.CommandContext(ctx(t, 3*time.Minute), bin, "--lease", s.lease.GRPC, "--insecure", "--token", crawlerToken,
			"--demo-site", "--demo-pages", "10", "--demo-ban-every", "6")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("crawler: %v\n%s", err, out)
		}
		if !strings.Contains(string(out), "crawled 11 pages, 0 failed, 2 bans moved past") {
			t.Fatalf("crawler output:\n%s", out)
		}
		for _, b := range regexp.MustCompile(`(?m)^ban +(\S+) via (\S+):`).FindAllStringSubmatch(string(out), -1) {
			again := regexp.MustCompile(`(?m)^200 +` + regexp.QuoteMeta(b[1]) + ` via (\S+)$`).FindStringSubmatch(string(out))
			if again == nil || again[1] == b[2] {
				t.Errorf("%s banned via %s, then %v; want it fetched through another proxy:\n%s", b[1], b[2], again, out)
			}
		}
	})

	t.Run("python package and scrapy middleware", func(t *testing.T) {
		dir, err := filepath.Abs("../../clients/python")
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.CommandContext(ctx(t, 10*time.Minute), python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "not gateway", "tests")
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "EGRESS_LEASE_URL=http://"+s.lease.HTTP, "EGRESS_TOKEN="+crawlerToken,
			"PYTHONPATH="+dir, "PYTHONDONTWRITEBYTECODE=1")
		out, err := cmd.CombinedOutput()
		t.Logf("pytest:\n%s", out)
		if err != nil {
			t.Fatalf("pytest: %v", err)
		}
		if m := regexp.MustCompile(`(\d+) passed`).FindStringSubmatch(string(out)); m == nil || strings.Contains(string(out), "skipped") {
			t.Fatal("pytest ran no test or skipped some")
		}
	})
}

// pythonWithScrapy is Debian's Python 3 with python3-scrapy and
// python3-pytest (scripts/ensure-deps.sh installs them).
func pythonWithScrapy(t *testing.T) string {
	t.Helper()
	for _, p := range []string{"/usr/bin/python3", "python3"} {
		if path, err := exec.LookPath(p); err == nil {
			if exec.Command(path, "-c", "import scrapy, pytest").Run() == nil {
				return path
			}
		}
	}
	t.Fatal("no python3 with scrapy and pytest: run scripts/ensure-deps.sh (apt-get install python3-scrapy python3-pytest)")
	return ""
}
