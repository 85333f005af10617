package squid

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestServiceName(t *testing.T) {
	t.Parallel()
	a, b := ServiceName("43b1b4e6-40e9-4788-a936-acc79461769a"), ServiceName("43b1b4e6-40e9-4788-a936-acc79461769b")
	if a == b || a != ServiceName("43b1b4e6-40e9-4788-a936-acc79461769a") {
		t.Errorf("names %q and %q: want one per id, the same each time", a, b)
	}
	for _, n := range []string{a, ServiceName("squid-test-123/x.y")} {
		if len(n) > 32 || strings.Trim(n, "abcdefghijklmnopqrstuvwxyz0123456789") != "" {
			t.Errorf("name %q: squid takes at most 32 letters and digits", n)
		}
	}
}

func TestRemoveStaleSegments(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat("/dev/shm"); err != nil {
		t.Skip("no /dev/shm here")
	}
	name := ServiceName(t.Name() + filepath.Base(t.TempDir()))
	mine := filepath.Join("/dev/shm", name+"-cf__queues.shm")
	other := filepath.Join("/dev/shm", name+"x-cf__queues.shm")
	for _, f := range []string{mine, other} {
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = os.Remove(f) })
	}
	RemoveStaleSegments(name)
	if _, err := os.Stat(mine); !os.IsNotExist(err) {
		t.Errorf("%s is still there: %v", mine, err)
	}
	if _, err := os.Stat(other); err != nil {
		t.Errorf("another name's segment went: %v", err)
	}
}
