package integration

import (
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/proctest"
)

// The example crawler (examples/crawler) crawls its demo site through the
// suite's proxies, moves past every ban it meets, and leaves no lease
// behind.
func TestExampleCrawler(t *testing.T) {
	t.Parallel()
	s := newSuite(t, 4)
	bin := proctest.Build(t, "../../../examples/crawler")
	cmd := exec.CommandContext(ctx(t), bin, "--lease", s.lease.GRPC, "--insecure", "--token", token,
		"--demo-site", "--demo-pages", "10", "--demo-ban-every", "6", "--concurrency", "2", "--ttl", "5s")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("crawler: %v\n%s", err, out)
	}
	text := string(out)
	// 11 pages (/ and /p/0../p/9) in 13 requests: the 6th and 12th are
	// answered 403.
	if !strings.Contains(text, "crawled 11 pages, 0 failed, 2 bans moved past") {
		t.Fatalf("crawler output lacks the full crawl:\n%s", text)
	}
	bans := regexp.MustCompile(`(?m)^ban +http://127\.0\.0\.1:\d+/\S* via (proxy-\d): blocked; reported`).FindAllStringSubmatch(text, -1)
	if len(bans) != 2 || bans[0][1] == bans[1][1] {
		t.Fatalf("bans %v, want two, on two proxies:\n%s", bans, text)
	}
	for _, b := range bans {
		var cooling bool
		for _, cd := range s.proxy(b[1]).GetCooldowns() {
			cooling = cooling || cd.GetTargetHost() == "127.0.0.1"
		}
		if !cooling {
			t.Errorf("%s banned by the site but not cooling down for it", b[1])
		}
	}
	// Each banned page was fetched again through another proxy.
	for _, b := range regexp.MustCompile(`(?m)^ban +(\S+) via (proxy-\d):`).FindAllStringSubmatch(text, -1) {
		again := regexp.MustCompile(`(?m)^200 +` + regexp.QuoteMeta(b[1]) + ` via (proxy-\d)$`).FindStringSubmatch(text)
		if again == nil || again[1] == b[2] {
			t.Errorf("%s banned via %s, then fetched via %v; want another proxy:\n%s", b[1], b[2], again, text)
		}
	}
	if n := s.activeLeases(); n != 0 {
		t.Errorf("%d leases still active after the crawler exited", n)
	}
}
