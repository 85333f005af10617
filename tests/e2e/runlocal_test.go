//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// repoRoot is the checkout the tests run in.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// fakeService writes an executable that serves as scripts/run-local.sh
// expects (a "serving" line), records its PID, and then runs body.
func fakeService(t *testing.T, dir, name, body string) {
	t.Helper()
	script := "#!/usr/bin/env bash\necho $$ > " + filepath.Join(dir, name+".pid") + "\n" +
		"echo 'time=2026-01-01T00:00:00Z level=INFO msg=serving grpc=127.0.0.1:1 http=127.0.0.1:2'\n" + body
	if err := os.WriteFile(filepath.Join(dir, "bin", name), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
}

func pidIn(t *testing.T, file string) int {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	return err == nil && !strings.Contains(string(stat), ") Z ")
}

// TestRunLocalSupervises: when one of its services exits, run-local.sh
// ends the run with that service's status and the end of its log, stops
// the other services and the local proxies (processes in sessions of
// their own under the state directory), and keeps each run's logs.
func TestRunLocalSupervises(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	for _, d := range []string{filepath.Join(dir, "bin"), state} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// steady starts a "local proxy" in a session of its own, named under
	// the state directory as provisioner-local's are, then serves on.
	fakeService(t, dir, "steady", "setsid bash -c 'echo $$ > "+filepath.Join(dir, "proxy.pid")+"; exec -a "+state+"/p1/squid sleep 300' &\n"+
		"trap 'exit 0' TERM\nwhile :; do sleep 1; done\n")
	fakeService(t, dir, "dies", "echo 'level=ERROR msg=\"the database went away\"'\nsleep 1\nexit 3\n")

	run := func() (string, int, time.Duration) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, "scripts/run-local.sh", "steady", "dies")
		cmd.Dir = repoRoot(t)
		cmd.Env = append(os.Environ(),
			"EGRESS_DATABASE_URL=postgres://unused", "EGRESS_NATS_URL=nats://unused",
			"EGRESS_RUN_BIN_DIR="+filepath.Join(dir, "bin"), "EGRESS_RUN_LOG_DIR="+filepath.Join(dir, "run"),
			"EGRESS_RUN_STATE_DIR="+state)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		start := time.Now()
		err := cmd.Run()
		if ctx.Err() != nil {
			t.Fatalf("run-local.sh still running after 60s with a service gone:\n%s", out.String())
		}
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		}
		return out.String(), code, time.Since(start)
	}

	out, code, took := run()
	t.Logf("run-local.sh ended after %v:\n%s", took, out)
	if code != 1 {
		t.Errorf("exit status %d, want 1", code)
	}
	for _, want := range []string{"dies exited with status 3", "the database went away", "stopped; logs in"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	for _, f := range []string{"steady.pid", "proxy.pid"} {
		pid := pidIn(t, filepath.Join(dir, f))
		deadline := time.Now().Add(10 * time.Second)
		for alive(pid) && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if alive(pid) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			t.Errorf("%s (pid %d) survived the run", strings.TrimSuffix(f, ".pid"), pid)
		}
	}

	// A second run keeps the first run's logs.
	run()
	runs, err := filepath.Glob(filepath.Join(dir, "run", "logs", "*", "dies.log"))
	if err != nil || len(runs) != 2 {
		t.Errorf("logs of %d runs kept (%v), want 2", len(runs), err)
	}
	if _, err := os.Stat(filepath.Join(dir, "run", "latest", "steady.log")); err != nil {
		t.Errorf("no latest/steady.log: %v", err)
	}
}
