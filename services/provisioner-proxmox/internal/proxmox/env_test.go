package proxmox

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/goleak"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/services/provisioner-proxmox/internal/pvefake"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"))
}

const (
	tokenUser   = "proxy-operator@pve!operator"
	tokenSecret = "5e1f0c3a-9b7d-4e2a-8f61-c0ffee5ec7e7"
	templateID  = 9001
	cloudInit   = "#cloud-config\nwrite_files:\n- path: /etc/secret\n  content: cl0ud-1n1t-s3cr3t\n"
)

// syncBuffer collects output written from several goroutines.
type syncBuffer = logtest.Buffer

type env struct {
	fake      *pvefake.Server
	be        *Backend
	cfg       Config
	dir       string
	tokenFile string
	caFile    string
	logs      *syncBuffer
}

func testBudgets() Budgets {
	return Budgets{
		Connect: 5 * time.Second, TLSHandshake: 5 * time.Second, Request: 5 * time.Second,
		Clone: 10 * time.Second, Upload: 5 * time.Second, Resize: 5 * time.Second, Start: 5 * time.Second,
		Stop: 5 * time.Second, Destroy: 5 * time.Second, SeedDelete: 5 * time.Second,
		Running: 5 * time.Second, Poll: 5 * time.Millisecond, Check: 5 * time.Second,
	}
}

// newEnv starts a fake with the documented template, token and ACL, and a
// backend configured for it; mut adjusts the config first.
func newEnv(t testing.TB, mut func(*Config), opts ...func(*pvefake.Options)) *env {
	t.Helper()
	o := pvefake.Options{}
	for _, f := range opts {
		f(&o)
	}
	fake, err := pvefake.Start(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fake.Close)
	fake.AddToken(tokenUser, tokenSecret, fake.OperatorACL())
	fake.AddTemplate(templateID, "pv1-1", pvefake.DebianTemplate(), false)
	dir := t.TempDir()
	e := &env{fake: fake, dir: dir, tokenFile: filepath.Join(dir, "token"), caFile: filepath.Join(dir, "ca.pem"), logs: &syncBuffer{}}
	writeFile(t, e.tokenFile, tokenUser+"="+tokenSecret+"\n")
	writeFile(t, e.caFile, string(fake.CAPEM))
	e.cfg = Config{
		URL: fake.URL, TokenFile: e.tokenFile, CAFile: e.caFile, Nodes: []string{"pv1-1"}, ISOStorage: "proxy-seeds",
		VLANTag: 4, Bridge: "vmbr1",
		Templates:    map[string]Template{"debian-13": {VMID: templateID}},
		MachineTypes: map[string]MachineType{"small": {Cores: 1, MemoryMiB: 1024}, "big": {Cores: 4, MemoryMiB: 4096, DiskGiB: 10}, "tiny-disk": {Cores: 1, MemoryMiB: 512, DiskGiB: 2}},
	}
	if mut != nil {
		mut(&e.cfg)
	}
	b := testBudgets()
	e.be, err = New("pve", e.cfg, slog.New(slog.NewJSONHandler(e.logs, &slog.HandlerOptions{Level: LevelTrace})), Options{Budgets: &b})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.be.c.closeIdle() })
	return e
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func createReq(uid string) *provisionerv1.CreateInstanceRequest {
	return &provisionerv1.CreateInstanceRequest{
		Provider: "pve", ProxyUid: uid, ProxyName: "p-" + uid, CloudInit: cloudInit, Port: 3128,
		Placement: &proxyv1.Placement{MachineType: "small", Image: "debian-13"},
	}
}

// onlyVM returns the one non-template VM, failing otherwise.
func (e *env) onlyVM(t *testing.T) pvefake.VM {
	t.Helper()
	vms := e.fake.VMs()
	if len(vms) != 1 {
		t.Fatalf("%d VMs on the fake, want 1: %v", len(vms), vms)
	}
	for _, v := range vms {
		return v
	}
	panic("unreachable")
}
