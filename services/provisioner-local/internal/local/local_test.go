package local

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/services/provisioner-local/internal/forward"
)

// TestMain lets the test binary be the built-in proxy too: the backend
// starts os.Executable() with `forward-proxy`, which here is this binary.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "forward-proxy" {
		listen := ""
		for i, a := range os.Args {
			if a == "--listen" && i+1 < len(os.Args) {
				listen = os.Args[i+1]
			}
		}
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
		defer stop()
		if err := forward.Serve(ctx, listen, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func newBackend(t *testing.T, kind, dir string) *Backend {
	t.Helper()
	return newBackendLog(t, kind, dir, slog.New(slog.NewTextHandler(io.Discard, nil)))
}

// newBackendLog is newBackend logging to log.
func newBackendLog(t *testing.T, kind, dir string, log *slog.Logger) *Backend {
	t.Helper()
	if kind == "squid" {
		if _, err := exec.LookPath("squid"); err != nil {
			if _, err := os.Stat("/usr/sbin/squid"); err != nil {
				t.Fatal("squid is not installed: run scripts/ensure-deps.sh")
			}
		}
	}
	// squid drops to its own user, which must reach the state directory.
	for d := dir; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		_ = os.Chmod(d, 0o755)
	}
	// Each test its own /24, so parallel tests never share addresses.
	h := uuid.New()
	network := fmt.Sprintf("127.%d.%d.0/24", 100+int(h[0])%100, h[1])
	cfg, err := providers.Parse([]byte(fmt.Sprintf(
		"providers:\n  - name: local\n    type: local\n    local: {stateDir: %q, proxy: %s, network: %q, startTimeout: 30s}\n", dir, kind, network)))
	if err != nil {
		t.Fatal(err)
	}
	b, err := FromProvider(cfg.Providers[0], log)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

type testLog struct{ t *testing.T }

func (l *testLog) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// cleanup kills every proxy the test started, whatever the test did.
func cleanup(t *testing.T, b *Backend) {
	t.Cleanup(func() {
		all, _ := b.all()
		for _, s := range all {
			if b.alive(s) {
				_ = syscall.Kill(-s.PID, syscall.SIGKILL)
			}
		}
	})
}

// fetchThrough fetches the TLS server's page through the proxy at addr.
func fetchThrough(t *testing.T, proxyAddr string, target *httptest.Server) error {
	t.Helper()
	pool := target.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		Proxy:           http.ProxyURL(&url.URL{Scheme: "http", Host: proxyAddr}),
		TLSClientConfig: &tls.Config{RootCAs: pool},
	}}
	resp, err := client.Get(target.URL)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if string(body) != "hello through the proxy" {
		return fmt.Errorf("body %q", body)
	}
	return nil
}

func TestLifecycle(t *testing.T) {
	t.Parallel()
	target := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("hello through the proxy"))
	}))
	t.Cleanup(target.Close) // the parallel subtests run after this function returns
	for _, kind := range []string{"builtin", "squid"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			dir := t.TempDir()
			b := newBackend(t, kind, dir)
			cleanup(t, b)
			uid := uuid.NewString()
			req := &provisionerv1.CreateInstanceRequest{Provider: "local", ProxyUid: uid, ProxyName: "p1", Port: 3128}
			inst, err := b.Create(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			if inst.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_RUNNING || inst.GetProviderId() != "instances/"+uid ||
				!strings.HasPrefix(inst.GetIp(), "127.") || inst.GetCreateTime() == nil || inst.GetProxyUid() != uid {
				t.Fatalf("instance %v", inst)
			}
			addr := net.JoinHostPort(inst.GetIp(), "3128")
			if err := fetchThrough(t, addr, target); err != nil {
				t.Fatalf("HTTPS through the %s proxy: %v", kind, err)
			}

			// Create again: the same instance, the same process.
			again, err := b.Create(ctx, req)
			if err != nil || again.GetIp() != inst.GetIp() || again.GetDetails()["pid"] != inst.GetDetails()["pid"] {
				t.Errorf("second create: %v %v (first %v)", again, err, inst)
			}

			// A new provisioner process on the same state directory finds it.
			b2 := newBackend(t, kind, dir)
			got, err := b2.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: inst.GetProviderId(), ProxyUid: uid})
			if err != nil || got.GetDetails()["pid"] != inst.GetDetails()["pid"] {
				t.Fatalf("get after a restart: %v %v", got, err)
			}
			list, err := b2.List(ctx)
			if err != nil || len(list) != 1 || list[0].GetProxyUid() != uid {
				t.Errorf("list: %v %v", list, err)
			}

			// Get for another proxy's UID is NotFound.
			if _, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: inst.GetProviderId(), ProxyUid: uuid.NewString()}); !errclass.Is(err, errclass.NotFound) {
				t.Errorf("get as another proxy: %v", err)
			}

			// The proxy process dies: the next Get starts it again.
			s, _ := b.read(uid)
			_ = syscall.Kill(-s.PID, syscall.SIGKILL)
			waitDead(t, b, s)
			revived, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: inst.GetProviderId(), ProxyUid: uid})
			if err != nil || revived.GetDetails()["pid"] == inst.GetDetails()["pid"] {
				t.Fatalf("get after the proxy died: %v %v", revived, err)
			}
			if err := fetchThrough(t, addr, target); err != nil {
				log, _ := os.ReadFile(filepath.Join(b.instDir(uid), "proxy.log"))
				t.Fatalf("HTTPS through the restarted proxy: %v\nits log:\n%s", err, log)
			}

			deleted, err := b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: inst.GetProviderId(), ProxyUid: uid})
			if err != nil || !deleted {
				t.Fatalf("delete: %v %v", deleted, err)
			}
			s, _ = b2.read(uid)
			if s != nil {
				t.Error("the record survived the delete")
			}
			if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
				c.Close()
				t.Error("the proxy still listens after the delete")
			}
			if _, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: inst.GetProviderId(), ProxyUid: uid}); !errclass.Is(err, errclass.NotFound) {
				t.Errorf("get after delete: %v", err)
			}
			if deleted, err := b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: inst.GetProviderId(), ProxyUid: uid}); err != nil || deleted {
				t.Errorf("second delete: %v %v", deleted, err)
			}
		})
	}
}

func waitDead(t *testing.T, b *Backend, s *state) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	// Not alive as the backend sees it; it may still be exiting, which the
	// backend must cope with.
	for b.alive(s) {
		if time.Now().After(deadline) {
			t.Fatal("the proxy did not die")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Many proxies on the same port get addresses of their own.
func TestDistinctAddresses(t *testing.T) {
	t.Parallel()
	b := newBackend(t, "builtin", t.TempDir())
	cleanup(t, b)
	seen := map[string]bool{}
	for range 5 {
		inst, err := b.Create(context.Background(), &provisionerv1.CreateInstanceRequest{ProxyUid: uuid.NewString(), Port: 3128})
		if err != nil {
			t.Fatal(err)
		}
		if seen[inst.GetIp()] {
			t.Errorf("address %s given twice", inst.GetIp())
		}
		seen[inst.GetIp()] = true
	}
	checks := b.Check(context.Background())
	if len(checks) != 1 || !checks[0].GetReady() || checks[0].GetDetails()["instances"] != "5" {
		t.Errorf("check: %v", checks)
	}
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	b := newBackend(t, "builtin", t.TempDir())
	ctx := context.Background()
	if _, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "../etc", Port: 3128}); !errclass.Is(err, errclass.Permanent) {
		t.Errorf("path-like UID: %v", err)
	}
	if _, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: uuid.NewString(), Port: 70000}); !errclass.Is(err, errclass.Permanent) {
		t.Errorf("bad port: %v", err)
	}
	if _, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: "vms/101/x"}); !errclass.Is(err, errclass.Permanent) {
		t.Errorf("foreign providerID: %v", err)
	}
	for _, block := range []string{"{proxy: podman}", "{network: 10.0.0.0/8}", "{network: 127.0.0.0/30}", "{stateDri: /x}"} {
		cfg, err := providers.Parse([]byte("providers:\n  - name: l\n    type: local\n    local: " + block + "\n"))
		if err == nil {
			_, err = FromProvider(cfg.Providers[0], slog.New(slog.NewTextHandler(io.Discard, nil)))
		}
		if err == nil {
			t.Errorf("config %s accepted", block)
		}
	}

}

// TestLogs: a delete logs its proxy's exit at INFO, a proxy that dies on
// its own is a WARNING saying how it ended, and provider appears once per
// line (the runtime's logger carries it, as in the binary).
func TestLogs(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"builtin", "squid"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			out := &logtest.Buffer{}
			b := newBackendLog(t, kind, t.TempDir(), slog.New(slog.NewTextHandler(out, nil)).With("provider", "local"))
			cleanup(t, b)
			uid := uuid.NewString()
			inst, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{Provider: "local", ProxyUid: uid, ProxyName: "p1", Port: 3128})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: inst.GetProviderId(), ProxyUid: uid}); err != nil {
				t.Fatal(err)
			}
			waitLog(t, out, "local proxy stopped")

			other := uuid.NewString()
			if _, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{Provider: "local", ProxyUid: other, ProxyName: "p2", Port: 3128}); err != nil {
				t.Fatal(err)
			}
			s, _ := b.read(other)
			_ = syscall.Kill(-s.PID, syscall.SIGKILL)
			waitLog(t, out, "WARNING: local proxy exited on its own")

			for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
				if n := strings.Count(line, " provider="); n != 1 {
					t.Errorf("provider= %d times in %s", n, line)
				}
				if strings.Contains(line, "level=WARN") != strings.Contains(line, "exited on its own") {
					t.Errorf("level and message disagree: %s", line)
				}
				if strings.Contains(line, "<nil>") {
					t.Errorf("a nil error logged: %s", line)
				}
				if strings.Contains(line, "exited on its own") && !strings.Contains(line, `exit="signal: killed"`) {
					t.Errorf("the crash does not say how the proxy ended: %s", line)
				}
			}
		})
	}
}

// A squid that cannot start says why: its FATAL line from cache.log, not
// an empty reason.
func TestSquidStartFailureSaysWhy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := newBackend(t, "squid", t.TempDir())
	cleanup(t, b)
	uid := uuid.NewString()
	inst, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{Provider: "local", ProxyUid: uid, ProxyName: "p1", Port: 3128})
	if err != nil {
		t.Fatal(err)
	}
	s, _ := b.read(uid)
	_ = syscall.Kill(-s.PID, syscall.SIGKILL)
	waitDead(t, b, s)
	// squid cannot open its access log once a directory stands there.
	accessLog := filepath.Join(b.instDir(uid), "access.log")
	if err := os.RemoveAll(accessLog); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(accessLog, 0o755); err != nil {
		t.Fatal(err)
	}
	_, err = b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: inst.GetProviderId(), ProxyUid: uid})
	if !errclass.Is(err, errclass.Transient) || !strings.Contains(err.Error(), "because it is a directory") || !strings.Contains(err.Error(), "exit status 1") {
		t.Fatalf("get with a squid that cannot start = %v, want Transient with squid's FATAL line and exit status", err)
	}
}

func waitLog(t *testing.T, out *logtest.Buffer, msg string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(out.String(), msg) {
		if time.Now().After(deadline) {
			t.Fatalf("no %q logged within 10s:\n%s", msg, out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
