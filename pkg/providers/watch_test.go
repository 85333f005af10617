package providers

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/reload"
)

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// The holder takes a valid new version, keeps the old one on an invalid
// version with one ERROR naming the file and the field but not the
// content, and counts each rejected version.
func TestFileReloadsValidVersionsOnly(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "providers.yaml")
	writeFile(t, path, "providers:\n  - {name: a, type: local}\n")
	var logs logtest.Buffer
	reg := prometheus.NewRegistry()
	f, err := Open(path, slog.New(slog.NewTextHandler(&logs, nil)), reg)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	f.Now = func() time.Time { return now }
	var src Source = f
	failed := func() float64 {
		return testutil.ToFloat64(failures(reg))
	}
	if got := src.Current().Names(); strings.Join(got, ",") != "a" {
		t.Fatalf("names = %v, want [a]", got)
	}
	if failed() != 0 {
		t.Fatalf("failures = %v at start, want 0", failed())
	}

	writeFile(t, path, "providers:\n  - {name: a, type: local}\n  - {name: b, type: gcp}\n")
	now = now.Add(reload.Every)
	if got := src.Current().Names(); strings.Join(got, ",") != "a,b" {
		t.Fatalf("after adding b names = %v, want [a b]", got)
	}

	const secret = "tok-SECRET-123"
	writeFile(t, path, "providers:\n  - {name: a, type: local, local: {token: "+secret+"}}\n  - {name: Bad_Name, type: gcp}\n")
	now = now.Add(reload.Every)
	if got := src.Current().Names(); strings.Join(got, ",") != "a,b" {
		t.Fatalf("after an invalid version names = %v, want [a b] kept", got)
	}
	if failed() != 1 {
		t.Errorf("failures = %v, want 1", failed())
	}
	out := logs.String()
	if !strings.Contains(out, "level=ERROR") || !strings.Contains(out, "providers[1].name") || !strings.Contains(out, path) {
		t.Errorf("want one ERROR naming the file and providers[1].name, got:\n%s", out)
	}
	if strings.Contains(out, secret) {
		t.Errorf("the log quotes the file's content:\n%s", out)
	}

	writeFile(t, path, "providers: [{name: a, type: local}, {name: c, type: kvm, kvm: {}, extra: 1}]\n")
	now = now.Add(reload.Every)
	f.Current()
	if failed() != 2 {
		t.Errorf("failures = %v after a second invalid version, want 2", failed())
	}
	if n := strings.Count(logs.String(), "level=ERROR"); n != 1 {
		t.Errorf("%d ERROR lines in one bad spell, want 1", n)
	}

	writeFile(t, path, "providers:\n  - {name: c, type: kvm}\n")
	now = now.Add(reload.Every)
	if got := src.Current().Names(); strings.Join(got, ",") != "c" {
		t.Fatalf("after a fix names = %v, want [c]", got)
	}
	if !strings.Contains(logs.String(), "can be used again") {
		t.Errorf("no INFO after the fix:\n%s", logs.String())
	}
}

// At start an invalid file is an error, as with LoadFile.
func TestOpenRejectsAnInvalidFile(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "providers.yaml")
	writeFile(t, path, "providers:\n  - {name: a, type: nope}\n")
	if _, err := Open(path, slog.New(slog.DiscardHandler), nil); err == nil || !strings.Contains(err.Error(), "providers[0].type") {
		t.Fatalf("Open = %v, want an error naming providers[0].type", err)
	}
}
