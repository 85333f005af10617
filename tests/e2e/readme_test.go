//go:build e2e

package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
)

// step is one `$ command` of the README's quickstart and the output the
// README shows for it.
type step struct {
	cmd  string
	want []string
}

// quickstartSteps reads the console blocks of the README's Quickstart.
func quickstartSteps(t *testing.T, readme string) []step {
	t.Helper()
	b, err := os.ReadFile(readme)
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	start := strings.Index(text, "\n## Quickstart\n")
	if start < 0 {
		t.Fatal("README.md has no Quickstart section")
	}
	text = text[start+1:]
	if end := strings.Index(text[3:], "\n## "); end >= 0 {
		text = text[:end+3]
	}
	var steps []step
	in := false
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "```console":
			in = true
		case line == "```":
			in = false
		case in && strings.HasPrefix(line, "$ "):
			steps = append(steps, step{cmd: strings.TrimPrefix(line, "$ ")})
		case in && len(steps) > 0:
			steps[len(steps)-1].want = append(steps[len(steps)-1].want, line)
		}
	}
	if len(steps) < 10 {
		t.Fatalf("only %d commands in the Quickstart", len(steps))
	}
	return steps
}

var (
	uuidRE = regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`)
	// A proxy's credentials: in a proxy URL, and as the lease answer's
	// fields.
	userinfoRE = regexp.MustCompile(`egress-[0-9a-f]{12}:[A-Za-z0-9_-]{32}@`)
	userRE     = regexp.MustCompile(`"username":"egress-[0-9a-f]{12}"`)
	passwordRE = regexp.MustCompile(`"password":"[A-Za-z0-9_-]{32}"`)
	addrRE     = regexp.MustCompile(`127\.\d+\.\d+\.\d+:\d+`)
	timeRE     = regexp.MustCompile(`\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z`)
	durRE      = regexp.MustCompile(`\b\d+(\.\d+)?(ns|µs|us|ms|s|m|h)\b`)
	proberRE   = regexp.MustCompile(`\S+-\d+(\s+200 OK)`)
	spacesRE   = regexp.MustCompile(`[ \t]+`)
	// Reads, and the gateway's rotation (its leases end with each
	// request), asked again until the lease service knows new proxies.
	readOnlys = []string{"proxies list", "proxies get", "health proxies", "%header{x-egress-proxy}"}
)

// normalize masks what differs between runs (times, durations, the
// prober's name) and column widths.
func normalize(lines []string) string {
	var out []string
	for _, l := range lines {
		// protojson varies its spacing on purpose: compare JSON as data.
		var v any
		if strings.HasPrefix(l, "{") && json.Unmarshal([]byte(l), &v) == nil {
			b, _ := json.Marshal(v)
			l = string(b)
		}
		l = timeRE.ReplaceAllString(l, "TIME")
		l = durRE.ReplaceAllString(l, "DUR")
		l = proberRE.ReplaceAllString(l, "PROBER$1")
		l = strings.TrimSpace(spacesRE.ReplaceAllString(l, " "))
		if l != "" {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestREADMEQuickstart runs the README's Quickstart as written, against
// the suite started by scripts/run-local.sh (what `make run` runs after
// building), and checks every command's output against the README's:
// the same proxies, leases, errors and messages, with lease IDs, UIDs and
// addresses mapped from the README's to this run's as they first appear,
// and times, durations and the prober's name masked. A command that
// changes something must answer as shown the first time; one that only
// reads is retried until the suite has caught up.
func TestREADMEQuickstart(t *testing.T) {
	t.Parallel()
	root := repoRoot(t)
	steps := quickstartSteps(t, filepath.Join(root, "README.md"))

	dir := t.TempDir()
	for d := dir; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		_ = os.Chmod(d, 0o755) // squid must reach the instances
	}
	bin := filepath.Join(dir, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, pkg := range []string{"services/orchestrator", "services/lease", "services/health", "services/provisioner-local", "services/gateway", "cmd/egressctl"} {
		built := proctest.Build(t, filepath.Join(root, pkg))
		if err := os.Symlink(built, filepath.Join(bin, filepath.Base(pkg))); err != nil {
			t.Fatal(err)
		}
	}
	state := filepath.Join(dir, "local")
	network := fmt.Sprintf("127.%d.%d.0/24", 100+time.Now().Nanosecond()%50, time.Now().Nanosecond()/50%250)
	providers := filepath.Join(dir, "providers.yaml")
	if err := os.WriteFile(providers, []byte(fmt.Sprintf("providers:\n  - name: local\n    type: local\n    local: {stateDir: %q, network: %q}\n", state, network)), 0o644); err != nil {
		t.Fatal(err)
	}
	offset := 1000 + int(time.Now().UnixNano()%40)*10
	port := func(p int) string { return strconv.Itoa(p + offset) }
	dsn := pgtest.NewDatabase(t, pgtest.Template{Name: "e2e_empty", Fingerprint: "none",
		Migrate: func(context.Context, string) error { return nil }})
	nats := natstest.New(t)

	suite := exec.Command("scripts/run-local.sh", "orchestrator", "lease", "health", "gateway", "provisioner-local")
	suite.Dir = root
	suite.Env = append(os.Environ(), "EGRESS_DATABASE_URL="+dsn, "EGRESS_NATS_URL="+nats.URL(),
		"EGRESS_PROVIDERS_CONFIG="+providers, "EGRESS_RUN_BIN_DIR="+bin, "EGRESS_RUN_LOG_DIR="+filepath.Join(dir, "run"),
		"EGRESS_RUN_STATE_DIR="+state, "EGRESS_RUN_PORT_OFFSET="+strconv.Itoa(offset))
	// run-local.sh writes while the test reads: a locked buffer.
	var suiteOut lockedBuffer
	suite.Stdout, suite.Stderr = &suiteOut, &suiteOut
	if err := suite.Start(); err != nil {
		t.Fatal(err)
	}
	suiteDone := make(chan error, 1)
	go func() { suiteDone <- suite.Wait() }()
	t.Cleanup(func() {
		_ = suite.Process.Signal(syscall.SIGTERM)
		select {
		case <-suiteDone:
		case <-time.After(60 * time.Second):
			_ = suite.Process.Kill()
			t.Error("run-local.sh did not stop within 60s of SIGTERM")
		}
		if t.Failed() {
			logs, _ := filepath.Glob(filepath.Join(dir, "run", "latest", "*.log"))
			for _, l := range logs {
				b, _ := os.ReadFile(l)
				t.Logf("%s:\n%s", filepath.Base(l), tailLines(string(b), 40))
			}
		}
	})
	deadline := time.Now().Add(120 * time.Second)
	for !strings.Contains(suiteOut.String(), "Ctrl-C stops everything") {
		select {
		case err := <-suiteDone:
			t.Fatalf("run-local.sh ended (%v):\n%s", err, suiteOut.String())
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("the suite did not start within 120s:\n%s", suiteOut.String())
		}
	}

	env := append(os.Environ(), "EGRESS_ORCHESTRATOR_ADDR=localhost:"+port(8100), "EGRESS_LEASE_ADDR=localhost:"+port(8110),
		"EGRESS_HEALTH_ADDR=localhost:"+port(8120), "EGRESS_AUTH_DISABLED=", "EGRESS_TOKEN=")
	mapped := map[string]string{ // the README's values → this run's
		"localhost:8101": "localhost:" + port(8101),
		"localhost:8111": "localhost:" + port(8111),
		"localhost:8080": "localhost:" + port(8080),
		"localhost:8181": "localhost:" + port(8181),
	}
	substitute := func(s string) string {
		for from, to := range mapped {
			s = strings.ReplaceAll(s, from, to)
		}
		return s
	}
	learn := func(want []string, got string) {
		for _, re := range []*regexp.Regexp{uuidRE, addrRE, userinfoRE, userRE, passwordRE} {
			w := re.FindAllString(strings.Join(want, "\n"), -1)
			g := re.FindAllString(got, -1)
			for i := 0; i < len(w) && i < len(g); i++ {
				if _, ok := mapped[w[i]]; !ok {
					mapped[w[i]] = g[i]
					if re == addrRE { // hosts alone appear in YAML and JSON
						mapped[strings.Split(w[i], ":")[0]+"\n"] = strings.Split(g[i], ":")[0] + "\n"
						mapped[`"`+strings.Split(w[i], ":")[0]+`"`] = `"` + strings.Split(g[i], ":")[0] + `"`
					}
				}
			}
		}
	}
	for i, st := range steps {
		cmd := strings.Replace(substitute(st.cmd), "bin/egressctl", filepath.Join(bin, "egressctl"), 1)
		// Progress lines (name, phase, reason separated by tabs) go to
		// stderr; the README shows them in between.
		var want []string
		for _, l := range st.want {
			if !strings.Contains(l, "\t") {
				want = append(want, l)
			}
		}
		wantErr := len(want) > 0 && strings.HasPrefix(want[0], "egressctl:")
		readOnly := false
		for _, r := range readOnlys {
			readOnly = readOnly || strings.Contains(st.cmd, r)
		}
		var got string
		var exp string
		until := time.Now().Add(60 * time.Second)
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			c := exec.CommandContext(ctx, "bash", "-c", cmd)
			c.Env = env
			var stdout, stderr bytes.Buffer
			c.Stdout, c.Stderr = &stdout, &stderr
			err := c.Run()
			cancel()
			got = stdout.String()
			if wantErr {
				got = stderr.String()
			}
			if (err != nil) != wantErr {
				t.Fatalf("step %d `%s`: %v (want failure: %v)\nstdout:\n%s\nstderr:\n%s", i+1, st.cmd, err, wantErr, stdout.String(), stderr.String())
			}
			learn(want, got)
			exp = normalize(strings.Split(substitute(strings.Join(want, "\n")+"\n"), "\n"))
			if normalize(strings.Split(got, "\n")) == exp || !readOnly || time.Now().After(until) {
				break
			}
			time.Sleep(500 * time.Millisecond) // a read-only command, asked again
		}
		if g := normalize(strings.Split(got, "\n")); g != exp {
			t.Fatalf("step %d `%s` answered\n%s\nwhere the README shows\n%s", i+1, st.cmd, g, exp)
		}
		t.Logf("step %d ok: %s", i+1, st.cmd)
	}
}

// lockedBuffer is a bytes.Buffer safe for one writer and readers.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
