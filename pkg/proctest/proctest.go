// Package proctest builds the suite's binaries and runs them as real
// processes in tests: the way they run in production, over real sockets,
// reading their JSON logs to know when they are up and where they listen.
package proctest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var (
	buildMu sync.Mutex
	built   = map[string]string{}
)

// Build compiles the main package at pkgDir (relative to the test's working
// directory) once per test process and set of build tags, with the race
// detector when the test binary has it, and returns the binary's path.
func Build(t testing.TB, pkgDir string, tags ...string) string {
	t.Helper()
	return build(t, pkgDir, false, tags)
}

// BuildShipped compiles the main package at pkgDir as the images ship it
// (scripts/images.sh: CGO_ENABLED=0, -trimpath, -ldflags "-s -w"), without
// the race detector (which needs cgo), for benchmarks whose figures (RSS,
// CPU) should be the shipped binary's.
func BuildShipped(t testing.TB, pkgDir string, tags ...string) string {
	t.Helper()
	return build(t, pkgDir, true, tags)
}

func build(t testing.TB, pkgDir string, shipped bool, tags []string) string {
	t.Helper()
	abs, err := filepath.Abs(pkgDir)
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"build"}
	env := os.Environ()
	switch {
	case shipped:
		args = append(args, "-trimpath", "-ldflags", "-s -w")
		env = append(env, "CGO_ENABLED=0")
	case raceEnabled:
		args = append(args, "-race")
	}
	if len(tags) > 0 {
		args = append(args, "-tags", strings.Join(tags, ","))
	}
	key := abs + " " + strings.Join(args[1:], " ")
	buildMu.Lock()
	defer buildMu.Unlock()
	if bin, ok := built[key]; ok {
		return bin
	}
	dir, err := os.MkdirTemp("", "proctest-")
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, filepath.Base(abs))
	cmd := exec.Command("go", append(append(args, "-o", bin), ".")...)
	cmd.Dir = abs
	cmd.Env = env
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("proctest: go %s %s: %v\n%s", strings.Join(args, " "), pkgDir, err, out)
	}
	built[key] = bin
	return bin
}

// Process is a running binary whose stderr is collected as JSON log lines.
type Process struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error

	mu     sync.Mutex
	lines  []map[string]any
	raw    bytes.Buffer
	notify chan struct{}
}

// Start runs bin with args (and extra KEY=VALUE env) and kills it, if still
// running, when the test ends.
func Start(t testing.TB, bin string, args []string, env ...string) *Process {
	t.Helper()
	p := &Process{done: make(chan struct{}), notify: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Env = append(os.Environ(), env...)
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stdout = &lockedWriter{p: p}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("proctest: starting %s: %v", bin, err)
	}
	go p.collect(stderr)
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s output:\n%s", filepath.Base(bin), p.Output())
		}
	})
	return p
}

type lockedWriter struct{ p *Process }

func (w *lockedWriter) Write(b []byte) (int, error) {
	w.p.mu.Lock()
	defer w.p.mu.Unlock()
	return w.p.raw.Write(b)
}

func (p *Process) collect(r interface{ Read([]byte) (int, error) }) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
	for sc.Scan() {
		line := sc.Bytes()
		var m map[string]any
		p.mu.Lock()
		p.raw.Write(line)
		p.raw.WriteByte('\n')
		if json.Unmarshal(line, &m) == nil {
			p.lines = append(p.lines, m)
		}
		close(p.notify)
		p.notify = make(chan struct{})
		p.mu.Unlock()
	}
	p.err = p.cmd.Wait()
	close(p.done)
	p.mu.Lock()
	close(p.notify)
	p.notify = make(chan struct{})
	p.mu.Unlock()
}

// Output is everything the process wrote so far.
func (p *Process) Output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.raw.String()
}

// Logs returns the JSON log lines so far.
func (p *Process) Logs() []map[string]any {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]map[string]any(nil), p.lines...)
}

// WaitLog waits until a JSON log line satisfies match and returns it. It
// fails the test when the process exits first or timeout passes.
func (p *Process) WaitLog(t testing.TB, timeout time.Duration, match func(map[string]any) bool) map[string]any {
	t.Helper()
	deadline := time.After(timeout)
	seen := 0
	for {
		p.mu.Lock()
		for ; seen < len(p.lines); seen++ {
			if match(p.lines[seen]) {
				l := p.lines[seen]
				p.mu.Unlock()
				return l
			}
		}
		notify := p.notify
		p.mu.Unlock()
		select {
		case <-notify:
		case <-p.done:
			// Drain what arrived with the exit.
			p.mu.Lock()
			for ; seen < len(p.lines); seen++ {
				if match(p.lines[seen]) {
					l := p.lines[seen]
					p.mu.Unlock()
					return l
				}
			}
			p.mu.Unlock()
			t.Fatalf("proctest: process exited (%v) before the expected log line:\n%s", p.err, p.Output())
		case <-deadline:
			t.Fatalf("proctest: no matching log line within %s:\n%s", timeout, p.Output())
		}
	}
}

// Msg matches a log line by its msg.
func Msg(msg string) func(map[string]any) bool {
	return func(m map[string]any) bool { return m["msg"] == msg }
}

// PID is the process id.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Signal sends sig to the process.
func (p *Process) Signal(t testing.TB, sig syscall.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		t.Fatalf("proctest: signal: %v", err)
	}
}

// Kill stops the process at once (SIGKILL), as a crash would.
func (p *Process) Kill(t testing.TB) {
	t.Helper()
	_ = p.cmd.Process.Kill()
	<-p.done
}

// Wait waits for the process to exit and returns its exit code; it fails
// the test when that takes longer than timeout.
func (p *Process) Wait(t testing.TB, timeout time.Duration) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	select {
	case <-p.done:
	case <-ctx.Done():
		t.Fatalf("proctest: process still running after %s:\n%s", timeout, p.Output())
	}
	var ee *exec.ExitError
	if errors.As(p.err, &ee) {
		return ee.ExitCode()
	}
	if p.err != nil {
		t.Fatalf("proctest: wait: %v", p.err)
	}
	return 0
}

// ReplaceFile writes content to path through a rename, as a mounted
// ConfigMap changes: a reader sees the old file or the new one, never half
// of one.
func ReplaceFile(t testing.TB, path, content string) {
	t.Helper()
	tmp := path + ".new"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// MetricLine is the line of the Prometheus page at http://addr/metrics
// that starts with series (a name with its labels), "" when there is none.
func MetricLine(t testing.TB, addr, series string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(raw), "\n") {
		if strings.HasPrefix(l, series) {
			return l
		}
	}
	return ""
}

// StatusBytes is a size field of /proc/<pid>/status (VmRSS, RssAnon,
// VmHWM ...) in bytes; pid os.Getpid() reads the test process itself.
func StatusBytes(t testing.TB, pid int, field string) int64 {
	t.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatalf("proctest: /proc/%d/status %s: %v", pid, field, err)
			}
			return kb << 10
		}
	}
	t.Fatalf("proctest: no %s in /proc/%d/status", field, pid)
	return 0
}

// CPUTime is the CPU (user and system) the process pid used so far, from
// /proc/<pid>/stat in the kernel's clock ticks (100 a second).
func CPUTime(t testing.TB, pid int) time.Duration {
	t.Helper()
	d, err := ReadCPUTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// ReadCPUTime is CPUTime for a process that may not be visible here (one
// on another machine, or gone): an error instead of failing the test.
func ReadCPUTime(pid int) (time.Duration, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The fields after the command name, which may hold spaces: state is
	// the first, utime the 12th, stime the 13th.
	_, rest, ok := strings.Cut(string(raw), ") ")
	f := strings.Fields(rest)
	if !ok || len(f) < 13 {
		return 0, fmt.Errorf("proctest: /proc/%d/stat: %q", pid, raw)
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("proctest: /proc/%d/stat: %q", pid, raw)
	}
	return time.Duration(utime+stime) * 10 * time.Millisecond, nil
}
