//go:build e2e

package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
)

// TestConsole runs the web console's browser test (tests/e2e/console, Node
// and playwright-core driving Debian's headless Chromium) against the
// real suite: every service a process, the console among them. Then, in
// the same run, it gives the orchestrator 10,000 more proxies and
// measures the Proxies page in the browser (figures logged, for
// docs/benchmarks/console.md; no time is asserted). With
// EGRESS_CONSOLE_SCREENSHOTS set to a folder, the pages' screenshots are
// written there (make console-screenshots).
func TestConsole(t *testing.T) {
	for _, bin := range []string{"node", "npm", chromium()} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s is missing: scripts/ensure-deps.sh installs nodejs, npm and chromium", bin)
		}
	}
	npmCI(t)
	s := newSuite(t)
	// A second provider that no provisioner serves: the benchmark's
	// proxies wait there for a provisioner (Provisioning), unprobed.
	s.providers = s.write("providers.yaml", fmt.Sprintf(
		"providers:\n  - name: local\n    type: local\n    local: {stateDir: %q, network: %q}\n  - name: parked\n    type: local\n    local: {stateDir: %q}\n",
		s.stateDir, localNetwork(), filepath.Join(s.dir, "parked")))
	s.startProvisioner("prov-1")
	_, s.orchestrator = servicetest.Start(t, "../../services/orchestrator", append(s.common(),
		"--providers-config="+s.providers, "--cloud-init-key-file="+s.cloudInitKeys, "--rate-limit-proxy-writes=0",
		"--provisioning-poll=200ms", "--deletion-poll=200ms", "--pool-resync=1s"))
	s.startLease()
	_, healthAddrs := s.startHealth("health-1")
	_, consoleAddrs := servicetest.Start(t, "../../services/console", []string{
		"--orchestrator-addr=" + s.orchestrator.GRPC, "--lease-addr=" + s.lease.GRPC, "--health-addr=" + healthAddrs.GRPC,
		"--log-level=debug"})
	egressctl := proctest.Build(t, "../../cmd/egressctl")

	env := append(os.Environ(),
		"CONSOLE_URL=http://"+consoleAddrs.HTTP, "CHROMIUM="+chromium(),
		"ADMIN_TOKEN="+opsToken, "VIEWER_TOKEN="+viewerToken, "CRAWLER_TOKEN="+crawlerToken,
		"EGRESSCTL="+egressctl, "LEASE_ADDR="+s.lease.GRPC)
	if dir := os.Getenv("EGRESS_CONSOLE_SCREENSHOTS"); dir != "" {
		abs, err := filepath.Abs(dir)
		if err != nil {
			t.Fatal(err)
		}
		env = append(env, "SCREENSHOTS="+abs)
	}
	node(t, env, "--test", "--test-concurrency=1", "console.test.js")

	// The benchmark: 10,000 proxies more.
	const n = 10000
	createParked(t, s, n)
	out := node(t, append(env, fmt.Sprintf("PROXIES=%d", n)), "console.bench.js")
	var res map[string]any
	if err := json.Unmarshal([]byte(lastLine(out)), &res); err != nil {
		t.Fatalf("the benchmark's answer %q: %v", lastLine(out), err)
	}
	t.Logf("Proxies page with %v proxies (medians of %v runs): rendered %.0f ms after navigation (event stream opened at %.0f ms, its first page arrived at %.0f ms; the Providers page loads in %.0f ms); a search filters and draws in %.1f ms, clearing it in %.1f ms",
		res["proxies"], res["runs"], res["loadMs"], res["streamOpenedMs"], res["snapshotArrivedMs"], res["providersPageLoadMs"], res["filterMs"], res["clearFilterMs"])
}

func chromium() string {
	if c := os.Getenv("EGRESS_CHROMIUM"); c != "" {
		return c
	}
	return "/usr/bin/chromium"
}

// localNetwork is a loopback /24 of this test's own for the local proxies.
func localNetwork() string {
	return fmt.Sprintf("127.%d.%d.0/24", 150+time.Now().Nanosecond()%50, time.Now().Nanosecond()/50%250)
}

// npmCI installs the test's one dependency from its lockfile, once.
func npmCI(t *testing.T) {
	if _, err := os.Stat("console/node_modules/playwright-core"); err == nil {
		return
	}
	cmd := exec.Command("npm", "ci", "--no-audit", "--no-fund")
	cmd.Dir = "console"
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("npm ci in tests/e2e/console: %v\n%s", err, out)
	}
}

// node runs a script of tests/e2e/console, logging its output as it comes,
// and fails the test when it fails.
func node(t *testing.T, env []string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", args...)
	cmd.Dir, cmd.Env = "console", env
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var all strings.Builder
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		t.Log(sc.Text())
		all.WriteString(sc.Text() + "\n")
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("node %s: %v", strings.Join(args, " "), err)
	}
	return all.String()
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// createParked creates n proxies on the provider no provisioner serves,
// 32 at a time, and waits until the orchestrator lists them all.
func createParked(t *testing.T, s *suite, n int) {
	t.Helper()
	api := s.proxies()
	c := ctx(t, 5*time.Minute)
	g, gctx := errgroup.WithContext(c)
	g.SetLimit(32)
	for i := range n {
		g.Go(func() error {
			_, err := api.CreateProxy(gctx, &proxyv1.CreateProxyRequest{
				Name:   fmt.Sprintf("bench-%05d", i),
				Labels: map[string]string{"shard": fmt.Sprint(i % 10)},
				Spec:   &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "parked"},
			})
			return err
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatalf("creating the benchmark's proxies: %v", err)
	}
}
