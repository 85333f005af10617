package reload

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/logtest"
)

// parseNumber accepts a decimal number; its error never quotes the
// content, as a parser of secrets must not.
func parseNumber(b []byte) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, errors.New("not a number")
	}
	return n, nil
}

func write(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// A file re-read on change: within the rate limit Current keeps the value,
// after it takes the new one; a version that does not parse, is not
// accepted or is gone keeps the last good value with one WARNING (never
// the content), and an INFO when the file is good again.
func TestFileReloadsAndKeepsTheLastGoodValue(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "value")
	write(t, path, "1\n")
	var logs logtest.Buffer
	f, err := Open(path, "the test file", parseNumber, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	f.Now = func() time.Time { return now }
	if got := f.Current(); got != 1 {
		t.Fatalf("Current = %d, want 1", got)
	}

	write(t, path, "22\n")
	if got := f.Current(); got != 1 {
		t.Errorf("inside the rate limit Current = %d, want 1 still", got)
	}
	now = now.Add(Every)
	if got := f.Current(); got != 22 {
		t.Errorf("after the rate limit Current = %d, want 22", got)
	}

	steps := []struct {
		name, content string
	}{
		{"does not parse", "secret-material-333\n"},
		{"not accepted", "4444\n"},
	}
	f.Accept = func(n int) error {
		if n > 1000 {
			return errors.New("too large")
		}
		return nil
	}
	for _, st := range steps {
		write(t, path, st.content)
		if f.Refresh() {
			t.Errorf("%s: Refresh reports a change", st.name)
		}
		if got := f.Value(); got != 22 {
			t.Errorf("%s: Value = %d, want the last good 22", st.name, got)
		}
	}
	// What Accept refused is tried again, though the file did not change.
	f.Accept = nil
	if !f.Refresh() || f.Value() != 4444 {
		t.Errorf("a version Accept refused, once acceptable: Value = %d, want 4444", f.Value())
	}
	if !strings.Contains(logs.String(), "the test file can be used again") {
		t.Errorf("no INFO when the file became good again:\n%s", logs.String())
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	now = now.Add(Every)
	if got := f.Current(); got != 4444 {
		t.Errorf("file gone: Current = %d, want the last good 4444", got)
	}
	out := logs.String()
	if n := strings.Count(out, "WARNING: the test file cannot be used"); n != 2 {
		t.Errorf("%d WARNINGs for two bad spells, want 2:\n%s", n, out)
	}
	if strings.Contains(out, "secret-material") {
		t.Errorf("the log quotes the file:\n%s", out)
	}

	write(t, path, "55\n")
	if !f.Refresh() || f.Value() != 55 {
		t.Errorf("a good version after the bad ones: Value = %d, want 55", f.Value())
	}
	if f.Refresh() {
		t.Error("Refresh reports a change of an unchanged file")
	}
}

// Open fails on a file that is missing or does not parse; Accept is not
// applied to the first version.
func TestOpenNeedsAGoodFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	log := slog.New(slog.DiscardHandler)
	if _, err := Open(filepath.Join(dir, "absent"), "the test file", parseNumber, log); err == nil || !strings.Contains(err.Error(), "the test file") {
		t.Errorf("missing file: %v", err)
	}
	bad := filepath.Join(dir, "bad")
	write(t, bad, "secret-material\n")
	_, err := Open(bad, "the test file", parseNumber, log)
	if err == nil || !strings.Contains(err.Error(), bad) || strings.Contains(err.Error(), "secret-material") {
		t.Errorf("unparsable file: %v; want an error naming the file, not quoting it", err)
	}
}
