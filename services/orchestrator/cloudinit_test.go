package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

// The rotation procedure of docs/orchestrator.md on the real binary: a
// proxy's cloud-init stored under k1; restarted with k2 active it is
// re-encrypted; k1 removed it still reads; started with only the retired
// key, or no key file, the binary refuses to start naming the key. The
// cloud-init appears in no log line and no metric, and not in PostgreSQL.
func TestCloudInitKeyRotation(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ring := func(name, active string, keys ...string) string {
		var b strings.Builder
		b.WriteString("active: " + active + "\nkeys:\n")
		for _, k := range keys {
			b.WriteString("  " + k + ": " + base64.StdEncoding.EncodeToString(bytes.Repeat([]byte(k[1:2]), 32)) + "\n")
		}
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(b.String()), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	dsn := orchtest.Database(t)
	args := func(extra ...string) []string {
		return append([]string{"--auth-disabled", "--providers-config=" + providersFile(t), "--database-url=" + dsn,
			"--nats-url=" + natstest.New(t).URL()}, extra...)
	}
	const secret = "#cloud-config\nchpasswd: {list: 'root:marker-51d2e0'}\n"
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	stop := func(p *proctest.Process) {
		t.Helper()
		p.Signal(t, syscall.SIGTERM)
		if code := p.Wait(t, 30*time.Second); code != 0 {
			t.Fatalf("exit code %d", code)
		}
		if strings.Contains(p.Output(), "marker-51d2e0") {
			t.Error("the cloud-init reached the log")
		}
	}
	getCloudInit := func(addr string) string {
		t.Helper()
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		got, err := proxyv1.NewProxyServiceClient(conn).GetProxy(ctx, &proxyv1.GetProxyRequest{Name: "p1", View: proxyv1.ProxyView_PROXY_VIEW_FULL})
		if err != nil {
			t.Fatal(err)
		}
		return got.GetProxy().GetSpec().GetCloudInit()
	}

	// Without a key file, cloud-init is refused.
	p, addrs := servicetest.Start(t, ".", args())
	conn, err := grpc.NewClient(addrs.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	create := &proxyv1.CreateProxyRequest{Name: "p1", Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "local", CloudInit: secret}}
	_, err = proxyv1.NewProxyServiceClient(conn).CreateProxy(ctx, create)
	conn.Close()
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "--cloud-init-key-file") {
		t.Fatalf("create with cloud-init and no key file: %v", err)
	}
	stop(p)

	// k1.
	p, addrs = servicetest.Start(t, ".", args("--cloud-init-key-file="+ring("k1.yaml", "k1", "k1")))
	conn, err = grpc.NewClient(addrs.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := proxyv1.NewProxyServiceClient(conn).CreateProxy(ctx, create); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	resp, err := http.Get("http://" + addrs.HTTP + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if bytes.Contains(metrics, []byte("marker-51d2e0")) {
		t.Error("the cloud-init reached /metrics")
	}
	stop(p)

	pool, err := postgres.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	keyOf := func() string {
		t.Helper()
		var key, dump string
		if err := pool.QueryRow(ctx, "SELECT cloud_init_key, p::text FROM orchestrator.proxies p WHERE name = 'p1'").Scan(&key, &dump); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(dump, "marker-51d2e0") || strings.Contains(dump, "6d61726b65722d353164326530") {
			t.Error("PostgreSQL holds the cloud-init in plaintext")
		}
		return key
	}
	if k := keyOf(); k != "k1" {
		t.Fatalf("sealed with %q, want k1", k)
	}

	// k2 added and active: re-encrypted at start.
	p, addrs = servicetest.Start(t, ".", args("--cloud-init-key-file="+ring("k12.yaml", "k2", "k1", "k2")))
	p.WaitLog(t, 30*time.Second, func(l map[string]any) bool {
		return l["msg"] == "re-encrypted stored cloud-init with the active key" && l["proxies"] == float64(1)
	})
	if got := getCloudInit(addrs.GRPC); got != secret {
		t.Errorf("cloud-init after re-encryption = %q", got)
	}
	stop(p)
	if k := keyOf(); k != "k2" {
		t.Fatalf("sealed with %q after re-encryption, want k2", k)
	}

	// k1 removed.
	p, addrs = servicetest.Start(t, ".", args("--cloud-init-key-file="+ring("k2.yaml", "k2", "k2")))
	if got := getCloudInit(addrs.GRPC); got != secret {
		t.Errorf("cloud-init with k2 only = %q", got)
	}
	stop(p)

	// The retired key only, or no key file: refused, naming k2.
	for name, extra := range map[string][]string{
		"retired key only": {"--cloud-init-key-file=" + ring("k1-again.yaml", "k1", "k1")},
		"no key file":      nil,
	} {
		bin := proctest.Build(t, ".")
		p := proctest.Start(t, bin, append([]string{"--grpc-listen=127.0.0.1:0", "--http-listen=127.0.0.1:0"}, args(extra...)...))
		if code := p.Wait(t, 60*time.Second); code == 0 {
			t.Errorf("%s: started", name)
		}
		if out := p.Output(); !strings.Contains(out, "[k2]") || strings.Contains(out, "marker-51d2e0") {
			t.Errorf("%s: output does not name k2 (or carries the cloud-init):\n%s", name, out)
		}
	}
}

// Keys rotate without a restart: the running binary re-reads its keyring
// file when it changes. A key added and made active seals the next write at
// once, what was sealed before still decrypts and is re-encrypted with it;
// a rewrite that does not parse, or that lacks a key stored cloud-init
// still needs, keeps the keyring in use with a WARNING (naming key ids,
// never key material); removing the retired key once nothing uses it is
// taken. The log never holds cloud-init or key material.
func TestCloudInitKeyRotationWithoutRestart(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "keys.yaml")
	material := func(k string) string { return base64.StdEncoding.EncodeToString(bytes.Repeat([]byte(k[1:2]), 32)) }
	writeRing := func(active string, keys ...string) {
		t.Helper()
		var b strings.Builder
		b.WriteString("active: " + active + "\nkeys:\n")
		for _, k := range keys {
			b.WriteString("  " + k + ": " + material(k) + "\n")
		}
		if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	writeRing("k1", "k1")
	dsn := orchtest.Database(t)
	p, addrs := servicetest.Start(t, ".", []string{"--auth-disabled", "--providers-config=" + providersFile(t), "--database-url=" + dsn,
		"--nats-url=" + natstest.New(t).URL(), "--cloud-init-key-file=" + path})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	conn, err := grpc.NewClient(addrs.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := proxyv1.NewProxyServiceClient(conn)
	pool, err := postgres.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	const secret = "#cloud-config\nchpasswd: {list: 'root:marker-0c11e9'}\n"
	create := func(name string) {
		t.Helper()
		_, err := client.CreateProxy(ctx, &proxyv1.CreateProxyRequest{Name: name, Spec: &proxyv1.ProxySpec{
			Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "local", CloudInit: secret}})
		if err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
	}
	keyOf := func(name string) (key string) {
		t.Helper()
		if err := pool.QueryRow(ctx, "SELECT cloud_init_key FROM orchestrator.proxies WHERE name = $1", name).Scan(&key); err != nil {
			t.Fatal(err)
		}
		return key
	}
	readable := func(name string) {
		t.Helper()
		got, err := client.GetProxy(ctx, &proxyv1.GetProxyRequest{Name: name, View: proxyv1.ProxyView_PROXY_VIEW_FULL})
		if err != nil || got.GetProxy().GetSpec().GetCloudInit() != secret {
			t.Errorf("the cloud-init of %s does not read back: %v", name, err)
		}
	}
	// since waits for a log line after the first `from` ones with message
	// msg that also satisfies more.
	since := func(from int, msg string, more func(map[string]any) bool) map[string]any {
		t.Helper()
		i := 0
		return p.WaitLog(t, 30*time.Second, func(l map[string]any) bool {
			i++
			return i > from && l["msg"] == msg && (more == nil || more(l))
		})
	}
	mark := func() int { return len(p.Logs()) }
	const changed = "the cloud-init keyring changed; its new version is in use"
	const cannot = "WARNING: the cloud-init keyring cannot be used; the version read before stays in effect until it is fixed"

	create("p1")
	if k := keyOf("p1"); k != "k1" {
		t.Fatalf("p1 sealed with %q, want k1", k)
	}

	// k2 added and made active, while running.
	m := mark()
	writeRing("k2", "k1", "k2")
	since(m, changed, func(l map[string]any) bool { return l["activeKey"] == "k2" })
	create("p2")
	if k := keyOf("p2"); k != "k2" {
		t.Errorf("a write after the change sealed with %q, want k2", k)
	}
	readable("p1")
	since(m, "re-encrypted stored cloud-init with the active key", func(l map[string]any) bool { return l["activeKey"] == "k2" })
	if k := keyOf("p1"); k != "k2" {
		t.Errorf("p1 sealed with %q after the re-encryption, want k2", k)
	}
	readable("p1")

	// A rewrite that does not parse (key material on its broken line).
	m = mark()
	if err := os.WriteFile(path, []byte("active: k3\nkeys: {k3: "+material("k3")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	since(m, cannot, nil)
	create("p3")
	if k := keyOf("p3"); k != "k2" {
		t.Errorf("a write after a broken rewrite sealed with %q, want k2 still", k)
	}
	m = mark()
	writeRing("k2", "k1", "k2")
	since(m, "the cloud-init keyring can be used again; its new version is in effect", nil)

	// A rewrite without k2, which sealed every stored cloud-init.
	m = mark()
	writeRing("k3", "k3")
	w := since(m, cannot, nil)
	if e, _ := w["error"].(string); !strings.Contains(e, "[k2]") {
		t.Errorf("the WARNING does not name the key still in use: %q", e)
	}
	create("p4")
	if k := keyOf("p4"); k != "k2" {
		t.Errorf("a write after a rewrite lacking k2 sealed with %q, want k2 still", k)
	}

	// The retired k1 removed: nothing uses it any more.
	m = mark()
	writeRing("k2", "k2")
	since(m, changed, func(l map[string]any) bool { ks, _ := l["keys"].([]any); return len(ks) == 1 && ks[0] == "k2" })
	for _, name := range []string{"p1", "p2", "p3", "p4"} {
		readable(name)
	}

	p.Signal(t, syscall.SIGTERM)
	if code := p.Wait(t, 30*time.Second); code != 0 {
		t.Errorf("exit code %d", code)
	}
	out := p.Output()
	for _, k := range []string{"k1", "k2", "k3"} {
		if strings.Contains(out, material(k)) {
			t.Errorf("the log holds the material of key %s", k)
		}
	}
	if strings.Contains(out, "marker-0c11e9") {
		t.Error("the cloud-init reached the log")
	}
}
