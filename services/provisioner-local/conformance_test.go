package main

import (
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
)

var binary = provisionertest.Binary{Package: ".", Service: "provisioner-local"}

// localBlock is the local block of a provider with its instances in
// stateDir and their addresses in network, running the built-in proxy.
func localBlock(stateDir, network string) string {
	return fmt.Sprintf("local: {stateDir: %s, network: %s, proxy: builtin}\n", stateDir, network)
}

// freeNetwork is a /24 of loopback of the test's own (127.200-249.x.0,
// away from the backend's default and its unit tests' ranges).
func freeNetwork() (string, string) {
	b := make([]byte, 2)
	_, _ = rand.Read(b)
	prefix := fmt.Sprintf("127.%d.%d.", 200+int(b[0])%50, b[1])
	return prefix + "0/24", prefix
}

// proxyProcesses are the PIDs of the processes serving the instance in
// dir: every process whose arguments name it, found in /proc.
func proxyProcesses(t *testing.T, dir string) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(raw), "\x00"), "\x00")
		if i := slices.Index(args, "--instance-dir"); i >= 0 && i+1 < len(args) && args[i+1] == dir {
			out = append(out, pid)
		}
	}
	return out
}

// The contract, for real: instances are directories and proxy processes
// on this machine.
func TestConformance(t *testing.T) {
	t.Parallel()
	state := t.TempDir()
	network, prefix := freeNetwork()
	block := localBlock(state, network)
	dir := func(uid string) string { return filepath.Join(state, uid) }
	provisionertest.TestAll(t, provisionertest.Tester{
		Binary:  binary,
		Type:    "local",
		Backend: func(*testing.T) string { return block },
		Observe: func(t *testing.T, uid string) provisionertest.Observed {
			var o provisionertest.Observed
			if _, err := os.Stat(dir(uid)); err == nil {
				o.Instances = append(o.Instances, "directory "+uid)
			}
			for range proxyProcesses(t, dir(uid)) {
				o.Parts = append(o.Parts, "proxy process")
			}
			return o
		},
		// Proxies outlive their provisioner: none may outlive the test.
		Remove: func(t *testing.T, uid string) {
			for _, pid := range proxyProcesses(t, dir(uid)) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		},
		// A record written before the crash, its proxy never started.
		HalfMade: func(t *testing.T, uid string) string {
			record := fmt.Sprintf(`{"uid": %q, "name": "proxy-%s", "proxyName": "conformance", "address": "%s9", "port": 3128, "kind": "builtin", "createdAt": %q, "pid": 0}`,
				uid, uid, prefix, time.Now().UTC().Truncate(time.Second).Format(time.RFC3339))
			if err := os.MkdirAll(dir(uid), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir(uid), "instance.json"), []byte(record), 0o644); err != nil {
				t.Fatal(err)
			}
			return "instances/" + uid
		},
		// A directory with the proxy's name that no provisioner made.
		Foreign: func(t *testing.T, uid string) provisionertest.Foreign {
			notes := filepath.Join(dir(uid), "notes.txt")
			if err := os.MkdirAll(dir(uid), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(notes, []byte("someone's notes\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			return provisionertest.Foreign{ProviderID: "instances/" + uid, Unchanged: func() error {
				entries, err := os.ReadDir(dir(uid))
				if err != nil || len(entries) != 1 || entries[0].Name() != "notes.txt" {
					return fmt.Errorf("the directory holds %v (%v), want notes.txt alone", entries, err)
				}
				return nil
			}}
		},
		// The record as written before installations: without one.
		Unclaim: func(t *testing.T, uid string) {
			path := filepath.Join(dir(uid), "instance.json")
			raw, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			var rec map[string]any
			if err := json.Unmarshal(raw, &rec); err != nil {
				t.Fatal(err)
			}
			delete(rec, "installation")
			if raw, err = json.Marshal(rec); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, raw, 0o644); err != nil {
				t.Fatal(err)
			}
		},
		CrashSteps: []provisionertest.CrashStep{{Name: "local.recorded"}, {Name: "local.started"}},
		// The state directory removed under a running provisioner.
		Unreachable: func(t *testing.T) provisionertest.Outage {
			gone := t.TempDir() + "/state"
			other, _ := freeNetwork()
			return provisionertest.Outage{Backend: localBlock(gone, other), Cut: func() {
				if err := os.RemoveAll(gone); err != nil {
					t.Fatal(err)
				}
			}}
		},
		// Every address of the provider's network taken on the proxy's port.
		Quota: func(t *testing.T) provisionertest.Quota {
			full, prefix := freeNetwork()
			for host := 1; host <= 254; host++ {
				l, err := net.Listen("tcp", prefix+strconv.Itoa(host)+":3128")
				if err != nil {
					continue // taken already: as good
				}
				t.Cleanup(func() { _ = l.Close() })
			}
			return provisionertest.Quota{Backend: localBlock(t.TempDir()+"/state", full)}
		},
	})
}
