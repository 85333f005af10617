package cli

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
)

// run executes egressctl in-process and returns exit code, stdout, stderr.
func run(args ...string) (int, string, string) {
	var out, errOut bytes.Buffer
	code := Main(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// orchestrator starts the real orchestrator binary with a token file and
// returns its gRPC address and its NATS server.
func orchestrator(t *testing.T) (string, *natstest.Server) {
	t.Helper()
	dir := t.TempDir()
	tokens := filepath.Join(dir, "tokens")
	providers := filepath.Join(dir, "providers.yaml")
	if err := os.WriteFile(tokens, []byte("ops tok-ops admin\nboard tok-viewer viewer\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(providers, []byte("providers:\n  - {name: local, type: local}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ns := natstest.New(t)
	// An empty database: the orchestrator migrates it at start.
	dsn := pgtest.NewDatabase(t, pgtest.Template{Name: "empty", Fingerprint: "none",
		Migrate: func(context.Context, string) error { return nil }})
	_, addrs := servicetest.Start(t, "../../../../services/orchestrator", []string{
		"--auth-token-file=" + tokens, "--providers-config=" + providers, "--database-url=" + dsn, "--nats-url=" + ns.URL(),
		"--cloud-init-key-file=" + keyring(t),
	})
	return addrs.GRPC, ns
}

func TestProxiesCommands(t *testing.T) {
	t.Parallel()
	addr, _ := orchestrator(t)
	base := []string{"--orchestrator", addr, "--token", "tok-ops"}
	cmd := func(args ...string) (int, string, string) { return run(append(base, args...)...) }

	code, out, errOut := cmd("proxies", "create", "p1", "--provider", "local", "--zone", "z1", "-l", "pool=eu")
	if code != 0 || !strings.Contains(out, "p1") || !strings.Contains(out, "Managed") || !strings.Contains(out, "local") {
		t.Fatalf("create = %d\n%s%s", code, out, errOut)
	}
	if !strings.HasPrefix(out, "NAME") {
		t.Errorf("table without a header:\n%s", out)
	}
	cmd("proxies", "create", "p2", "--provider", "local")

	code, out, _ = cmd("proxies", "get", "p1", "-o", "json")
	var got map[string]any
	if err := json.Unmarshal([]byte(out), &got); code != 0 || err != nil {
		t.Fatalf("get -o json = %d %v\n%s", code, err, out)
	}
	spec, _ := got["spec"].(map[string]any)
	if got["name"] != "p1" || spec["provider"] != "local" || spec["placement"].(map[string]any)["zone"] != "z1" {
		t.Errorf("json = %v", got)
	}
	code, out, _ = cmd("proxies", "list", "-o", "yaml")
	var list []map[string]any
	if err := yaml.Unmarshal([]byte(out), &list); code != 0 || err != nil || len(list) != 2 {
		t.Fatalf("list -o yaml = %d %v (%d items)\n%s", code, err, len(list), out)
	}
	code, out, _ = cmd("proxies", "list", "--label", "pool=eu")
	if code != 0 || !strings.Contains(out, "p1") || strings.Contains(out, "p2") {
		t.Errorf("list --label = %d\n%s", code, out)
	}

	errorCases := []struct {
		args []string
		want string
	}{
		{[]string{"proxies", "create", "p3", "--provider", "local", "-l", "bad"}, `egressctl: --label "bad": want key=value`},
		{[]string{"proxies", "create", "Bad_Name", "--provider", "local"}, "egressctl: invalidArgument: invalid request: name:"},
		{[]string{"proxies", "create", "p4", "--provider", "nope"}, `spec.provider: "nope" is not configured`},
		{[]string{"proxies", "create", "p5", "--mode", "external", "--endpoint", "no-port"}, `--endpoint "no-port": want host:port`},
		{[]string{"proxies", "create", "p1", "--provider", "local", "--port", "9999"}, "egressctl: alreadyExists:"},
		{[]string{"proxies", "get", "ghost"}, `egressctl: notFound: proxy "ghost" not found`},
		{[]string{"proxies", "list", "--phase", "sleeping"}, `--phase "sleeping"`},
	}
	for _, tc := range errorCases {
		code, _, errOut := cmd(tc.args...)
		if code != 1 || !strings.Contains(errOut, tc.want) || strings.Count(strings.TrimSpace(errOut), "\n") != 0 {
			t.Errorf("%v = %d %q; want one line with %q", tc.args, code, errOut, tc.want)
		}
	}

	// Roles: a viewer reads but cannot write, and never sees cloud-init.
	viewer := func(args ...string) (int, string, string) {
		return run(append([]string{"--orchestrator", addr, "--token", "tok-viewer"}, args...)...)
	}
	if code, _, errOut := viewer("proxies", "create", "p9", "--provider", "local"); code != 1 ||
		!strings.Contains(errOut, "permissionDenied") || !strings.Contains(errOut, "needs the role admin") {
		t.Errorf("create as a viewer = %d %q, want the role named", code, errOut)
	}
	if code, out, _ := viewer("proxies", "list"); code != 0 || !strings.Contains(out, "p1") {
		t.Errorf("list as a viewer = %d\n%s", code, out)
	}
	dir := t.TempDir()
	cloudInit := filepath.Join(dir, "user-data")
	if err := os.WriteFile(cloudInit, []byte("#cloud-config\n# egressctl-s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, out, errOut := cmd("proxies", "create", "p6", "--provider", "local", "--cloud-init-file", cloudInit, "-o", "json"); code != 0 || strings.Contains(out, "s3cret") {
		t.Errorf("create with cloud-init = %d, the response shows it: %s %s", code, out, errOut)
	}
	if code, out, _ := cmd("proxies", "get", "p6", "--full", "-o", "json"); code != 0 || !strings.Contains(out, "egressctl-s3cret") {
		t.Errorf("get --full as admin = %d, want the cloud-init:\n%s", code, out)
	}
	if code, out, _ := cmd("proxies", "get", "p6", "-o", "json"); code != 0 || strings.Contains(out, "s3cret") {
		t.Errorf("get as admin without --full shows the cloud-init = %d\n%s", code, out)
	}
	if code, _, errOut := viewer("proxies", "get", "p6", "--full"); code != 1 || !strings.Contains(errOut, "needs the role admin") {
		t.Errorf("get --full as a viewer = %d %q", code, errOut)
	}
	// The token from a file.
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte("tok-ops\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, out, errOut := run("--orchestrator", addr, "--token-file", tokenFile, "proxies", "get", "p6"); code != 0 || !strings.Contains(out, "p6") {
		t.Errorf("--token-file = %d %s %s", code, out, errOut)
	}
	if _, _, errOut := cmd("proxies", "delete", "p6"); errOut != "" {
		t.Errorf("delete p6: %s", errOut)
	}

	// No token; unreachable service.
	if code, _, errOut := run("--orchestrator", addr, "proxies", "list"); code != 1 || !strings.Contains(errOut, "missing bearer token") || !strings.Contains(errOut, "EGRESS_TOKEN") {
		t.Errorf("without a token: %d %q", code, errOut)
	}
	if code, _, errOut := run("--orchestrator", "127.0.0.1:1", "--token", "x", "proxies", "list"); code != 1 || !strings.Contains(errOut, "cannot reach the orchestrator at 127.0.0.1:1") {
		t.Errorf("unreachable: %d %q", code, errOut)
	}

	if code, out, errOut := cmd("proxies", "delete", "p2"); code != 0 || !strings.Contains(out, "p2") {
		t.Errorf("delete = %d %s %s", code, out, errOut)
	}
}

// create --wait shows progress and returns once the proxy is Ready.
func TestCreateWait(t *testing.T) {
	t.Parallel()
	addr, ns := orchestrator(t)
	js := ns.JetStream(t)
	done := make(chan struct{})
	var code int
	var out, errOut string
	go func() {
		defer close(done)
		code, out, errOut = run("--orchestrator", addr, "--token", "tok-ops", "--timeout", "60s",
			"proxies", "create", "ext", "--mode", "external", "--endpoint", "127.0.0.1:3128", "--wait")
	}()
	// Find the proxy, then tell the orchestrator health found it healthy.
	var uid string
	deadline := time.Now().Add(30 * time.Second)
	for uid == "" {
		c, o, _ := run("--orchestrator", addr, "--token", "tok-ops", "-o", "json", "proxies", "get", "ext")
		if c == 0 {
			var p map[string]any
			_ = json.Unmarshal([]byte(o), &p)
			uid, _ = p["uid"].(string)
		}
		if time.Now().After(deadline) {
			t.Fatal("the proxy never appeared")
		}
	}
	ev := &busv1.HealthTransitionEvent{Transition: &healthv1.HealthTransition{
		Sequence: 1, ProxyUid: uid, Healthy: true, Reason: "ProbeSucceeded", TransitionTime: timestamppb.Now(),
	}}
	if _, err := bus.Publish(context.Background(), js, bus.Names{}.HealthEventSubject(uid), ev); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("--wait did not return after the proxy became Ready")
	}
	if code != 0 || !strings.Contains(out, "Ready") {
		t.Fatalf("create --wait = %d\n%s\n%s", code, out, errOut)
	}
	// Progress ends on Ready; a Running line comes first unless the
	// verdict landed before the command looked.
	lines := strings.Split(strings.TrimSpace(errOut), "\n")
	if lines[len(lines)-1] != "ext\tReady\tHealthy" || (len(lines) == 2 && !strings.HasPrefix(lines[0], "ext\tRunning")) || len(lines) > 2 {
		t.Errorf("progress lines:\n%s", errOut)
	}
}

// proxies watch: without flags only new changes; --list shows the proxies
// as they are first, then the changes after the listing; --since N every
// change after revision N. (0 means "from now on": `--since 0` used to be
// the documented way to see everything, and showed nothing.)
func TestProxiesWatch(t *testing.T) {
	t.Parallel()
	addr, _ := orchestrator(t)
	base := []string{"--orchestrator", addr, "--token", "tok-ops"}
	if code, out, errOut := run(append(base, "proxies", "create", "w1", "--provider", "local")...); code != 0 {
		t.Fatalf("create = %d %s %s", code, out, errOut)
	}
	bin := proctest.Build(t, "../..")
	watch := func(args ...string) *proctest.Process {
		return proctest.Start(t, bin, append(append([]string{}, base...), append([]string{"proxies", "watch"}, args...)...))
	}
	waitOutput := func(p *proctest.Process, want string) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !strings.Contains(p.Output(), want) {
			if time.Now().After(deadline) {
				t.Fatalf("no %q within 30s in:\n%s", want, p.Output())
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	listed := watch("--list")
	fromNow := watch()
	waitOutput(listed, "CURRENT  w1")
	// The change stream is open once the header is out; w2 comes after.
	waitOutput(fromNow, "REVISION")
	if code, out, errOut := run(append(base, "proxies", "create", "w2", "--provider", "local")...); code != 0 {
		t.Fatalf("create = %d %s %s", code, out, errOut)
	}
	waitOutput(listed, "CREATED  w2")
	waitOutput(fromNow, "CREATED  w2")
	if strings.Contains(fromNow.Output(), "CREATED  w1") {
		t.Errorf("watch without flags showed w1's creation, from before it started:\n%s", fromNow.Output())
	}
	// --since 1: every change after w1's creation, w2's included.
	since := watch("--since", "1")
	waitOutput(since, "CREATED  w2")
	for _, p := range []*proctest.Process{listed, fromNow, since} {
		p.Signal(t, syscall.SIGTERM)
		if code := p.Wait(t, 30*time.Second); code != 0 {
			t.Errorf("watch exited %d after SIGTERM:\n%s", code, p.Output())
		}
	}
	if code, _, errOut := run(append(base, "proxies", "watch", "--list", "--since", "3")...); code != 1 || !strings.Contains(errOut, "exclude each other") {
		t.Errorf("--list with --since = %d %q", code, errOut)
	}
}

// keyring writes an orchestrator cloud-init keyring with one fresh key.
func keyring(t *testing.T) string {
	t.Helper()
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "keys.yaml")
	if err := os.WriteFile(path, []byte("active: k\nkeys:\n  k: "+base64.StdEncoding.EncodeToString(key)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestLeasesProxies runs `leases proxies` against the real lease binary,
// which resyncs its pool from the real orchestrator.
func TestLeasesProxies(t *testing.T) {
	t.Parallel()
	orch, ns := orchestrator(t)
	dir := t.TempDir()
	tokens := filepath.Join(dir, "tokens")
	orchToken := filepath.Join(dir, "orchestrator-token")
	if err := os.WriteFile(tokens, []byte("crawler tok-crawler crawler\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(orchToken, []byte("tok-ops\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	dsn := pgtest.NewDatabase(t, pgtest.Template{Name: "empty", Fingerprint: "none",
		Migrate: func(context.Context, string) error { return nil }})
	_, addrs := servicetest.Start(t, "../../../../services/lease", []string{
		"--auth-token-file=" + tokens, "--database-url=" + dsn, "--nats-url=" + ns.URL(),
		"--orchestrator-addr=" + orch, "--orchestrator-token-file=" + orchToken,
	})

	code, out, errOut := run("--lease", addrs.GRPC, "--token", "tok-crawler", "leases", "proxies", "--provider", "local")
	if code != 0 || !strings.HasPrefix(out, "PROXY") || strings.Count(out, "\n") != 1 {
		t.Fatalf("leases proxies = %d %q %q, want the header of an empty table", code, out, errOut)
	}
	code, out, errOut = run("--lease", addrs.GRPC, "--token", "tok-crawler", "-o", "json", "leases", "proxies")
	if code != 0 || strings.TrimSpace(out) != "[]" {
		t.Fatalf("leases proxies -o json = %d %q %q, want [] (no proxy)", code, out, errOut)
	}
	code, _, errOut = run("--lease", addrs.GRPC, "--token", "wrong", "leases", "proxies")
	if code != 1 || !strings.Contains(errOut, "invalid bearer token") {
		t.Fatalf("leases proxies with a bad token = %d %q, want exit 1 invalid bearer token", code, errOut)
	}
	code, _, errOut = run("--lease", addrs.GRPC, "--token", "tok-crawler", "leases", "proxies", "-l", "nolabel")
	if code == 0 || !strings.Contains(errOut, "--label") {
		t.Fatalf("leases proxies -l nolabel = %d %q, want a --label error", code, errOut)
	}
}

func TestPoolsCommands(t *testing.T) {
	t.Parallel()
	addr, _ := orchestrator(t)
	base := []string{"--orchestrator", addr, "--token", "tok-ops"}
	cmd := func(args ...string) (int, string, string) { return run(append(base, args...)...) }

	code, out, errOut := cmd("pools", "create", "web", "--provider", "local", "--replicas", "2", "--template-label", "team=crawl",
		"--max-surge", "1", "--max-age", "24h")
	if code != 0 || !strings.HasPrefix(out, "NAME") || !strings.Contains(out, "web") {
		t.Fatalf("create = %d\n%s%s", code, out, errOut)
	}
	// The controller creates the pool's proxies, named web-<suffix> and
	// labelled pool=web.
	deadline := time.Now().Add(20 * time.Second)
	for {
		code, out, _ = cmd("proxies", "list", "-l", "pool=web", "-o", "json")
		if code == 0 && strings.Count(out, `"name": "web-`) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool proxies not created: %d\n%s", code, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
	code, out, errOut = cmd("pools", "get", "web")
	if code != 0 || !strings.Contains(out, "PROVIDER") || !strings.Contains(out, "Last scaling: 0 -> 2 (Scaled)") {
		t.Fatalf("get = %d\n%s%s", code, out, errOut)
	}
	code, out, errOut = cmd("pools", "scale", "web", "5")
	if code != 0 || !strings.Contains(out, "2->5 Scaled") {
		t.Fatalf("scale = %d\n%s%s", code, out, errOut)
	}
	if code, _, errOut = cmd("pools", "scale", "web", "--", "-1"); code == 0 || !strings.Contains(errOut, "REPLICAS") {
		t.Fatalf("scale -1 = %d %s", code, errOut)
	}
	code, out, _ = cmd("pools", "list", "-o", "yaml")
	var listed []map[string]any
	if err := yaml.Unmarshal([]byte(out), &listed); code != 0 || err != nil || len(listed) != 1 || listed[0]["name"] != "web" {
		t.Fatalf("list -o yaml = %d %v\n%s", code, err, out)
	}
	if code, _, errOut = run("--orchestrator", addr, "--token", "tok-viewer", "pools", "scale", "web", "1"); code == 0 || !strings.Contains(errOut, "ermission") {
		t.Fatalf("a viewer scaled: %d %s", code, errOut)
	}
	if code, out, _ = run("--orchestrator", addr, "--token", "tok-viewer", "pools", "get", "web"); code != 0 {
		t.Fatalf("a viewer cannot read: %d %s", code, out)
	}
	if code, _, errOut = cmd("pools", "create", "bad", "--provider", "nope"); code == 0 || !strings.Contains(errOut, "spec.template.spec.provider") {
		t.Fatalf("create with an unknown provider = %d %s", code, errOut)
	}

	cmd("proxies", "create", "solo", "--provider", "local")
	code, out, errOut = cmd("proxies", "drain", "solo", "--timeout", "1m", "-o", "json")
	if code != 0 || !strings.Contains(out, `"draining": true`) {
		t.Fatalf("drain = %d\n%s%s", code, out, errOut)
	}
	code, out, errOut = cmd("pools", "delete", "web")
	if code != 0 || !strings.Contains(out, "web") {
		t.Fatalf("delete = %d\n%s%s", code, out, errOut)
	}
}
