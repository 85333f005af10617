package proxmox

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
	"github.com/egress-proxies/egress-proxies/services/provisioner-proxmox/internal/pvefake"
)

// closedURL is an https URL nobody listens on.
func closedURL(t *testing.T) string {
	t.Helper()
	return "https://" + provisionertest.ClosedAddress(t)
}

// Every row of the error-class table.
func TestErrorClasses(t *testing.T) {
	t.Parallel()
	const uid = "e7707000-0000-4000-8000-000000000001"
	otherCA := func(t *testing.T, e *env) {
		f2, err := pvefake.Start(pvefake.Options{})
		if err != nil {
			t.Fatal(err)
		}
		f2.Close()
		writeFile(t, e.caFile, string(f2.CAPEM))
	}
	cases := []struct {
		name      string
		op        string // create (default), get, delete
		setup     func(t *testing.T, e *env)
		budgets   func(b *Budgets)
		wantClass errclass.Class
		wantMsg   string
	}{
		// Permanent
		{name: "401 Authentication failed!", setup: func(t *testing.T, e *env) { writeFile(t, e.tokenFile, tokenUser+"=wrong-secret") },
			wantClass: errclass.Permanent, wantMsg: "401 Authentication failed!"},
		{name: "401 No ticket", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Status: 401, Message: "No ticket", EmptyBody: true})
		}, wantClass: errclass.Permanent, wantMsg: "401 No ticket"},
		{name: "403 a missing privilege", setup: func(t *testing.T, e *env) {
			privs := []string{}
			for _, p := range pvefake.OperatorPrivileges {
				if p != "VM.Clone" {
					privs = append(privs, p)
				}
			}
			e.fake.AddToken(tokenUser, tokenSecret, map[string][]string{"/": privs})
		}, wantClass: errclass.Permanent, wantMsg: "Permission check failed (/vms/9001, VM.Clone)"},
		{name: "403 the upload's Datastore.AllocateTemplate, no body", setup: func(t *testing.T, e *env) {
			e.fake.AddToken(tokenUser, tokenSecret, map[string][]string{"/": pvefake.OperatorPrivileges, "/storage/proxy-seeds": {"Datastore.Allocate"}})
		}, wantClass: errclass.Permanent, wantMsg: "Permission check failed (/storage/proxy-seeds, Datastore.AllocateTemplate)"},
		{name: "400 parameter verification", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Method: "PUT", Path: "/config", Status: 400, Message: "Parameter verification failed.", Errors: map[string]string{"net0": "invalid format"}})
		}, wantClass: errclass.Permanent, wantMsg: "Parameter verification failed.; net0: invalid format"},
		{name: "TLS verification failure", setup: otherCA, wantClass: errclass.Permanent, wantMsg: "TLS verification failed"},
		{name: "a malformed token file", setup: func(t *testing.T, e *env) { writeFile(t, e.tokenFile, "just-a-secret\n") },
			wantClass: errclass.Permanent, wantMsg: "does not hold one line"},
		{name: "a CA file without a certificate", setup: func(t *testing.T, e *env) { writeFile(t, e.caFile, "not a certificate") },
			wantClass: errclass.Permanent, wantMsg: "holds no PEM certificate"},
		// NotFound
		{name: "Get: the config does not exist", op: "get", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Method: "GET", Path: "/config", Status: 500, Message: "Configuration file 'nodes/pv1-1/qemu-server/100.conf' does not exist"})
		}, wantClass: errclass.NotFound},
		// Transient
		{name: "Create: the config does not exist", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Method: "PUT", Path: "/config", Status: 500, Message: "Configuration file 'nodes/pv1-1/qemu-server/100.conf' does not exist"})
		}, wantClass: errclass.Transient, wantMsg: "does not exist"},
		{name: "a missing token file", setup: func(t *testing.T, e *env) { _ = os.Remove(e.tokenFile) },
			wantClass: errclass.Transient, wantMsg: "is not readable"},
		{name: "a missing CA file", setup: func(t *testing.T, e *env) { _ = os.Remove(e.caFile) },
			wantClass: errclass.Transient, wantMsg: "is not readable"},
		{name: "a network error", setup: func(t *testing.T, e *env) { e.be.c.base = closedURL(t) + "/api2/json" },
			wantClass: errclass.Transient, wantMsg: "connection refused"},
		{name: "a cut connection", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Method: "POST", Path: "/upload", Cut: true})
		}, wantClass: errclass.Transient},
		{name: "500 VM is locked", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Method: "PUT", Path: "/config", Status: 500, Message: "VM is locked (backup)"})
		}, wantClass: errclass.Transient, wantMsg: "500 VM is locked (backup)"},
		{name: "another 5xx", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Method: "POST", Path: "/clone", Status: 500, Message: "unable to create VM 100: config file already exists"})
		}, wantClass: errclass.Transient, wantMsg: "config file already exists"},
		{name: "595", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Method: "PUT", Path: "/config", Status: 595, Message: "Errors during connection establishment, proxy handler: No route to host"})
		}, wantClass: errclass.Transient, wantMsg: "595 Errors during connection establishment"},
		{name: "596", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Method: "POST", Path: "/upload", Status: 596, Message: "Connection timed out"})
		}, wantClass: errclass.Transient, wantMsg: "596 Connection timed out"},
		{name: "a node that does not answer", setup: func(t *testing.T, e *env) { e.fake.SetNodeDown("pv1-1", 595) },
			wantClass: errclass.Transient, wantMsg: "does not answer"},
		{name: "a task that fails", setup: func(t *testing.T, e *env) { e.fake.FailNextTask("qmclone", "clone failed: storage full") },
			wantClass: errclass.Transient, wantMsg: "clone failed: storage full"},
		{name: "a task out of its budget", setup: func(t *testing.T, e *env) { e.fake.HoldClones() },
			budgets: func(b *Budgets) { b.Clone = 100 * time.Millisecond }, wantClass: errclass.Transient, wantMsg: "did not finish within its budget"},
		{name: "a request out of its timeout", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Path: "/cluster/resources", Delay: 5 * time.Second})
		}, budgets: func(b *Budgets) { b.Request = 100 * time.Millisecond }, wantClass: errclass.Transient, wantMsg: "deadline exceeded"},
		{name: "a VM that stops right after its start", setup: func(t *testing.T, e *env) { e.fake.SetStartStops(vmidFor(uid, defRange, 0)) },
			wantClass: errclass.Transient, wantMsg: "stopped right after its start"},
		{name: "the task status not there yet is waited out", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Method: "GET", Path: ":qmclone:", Status: 400, Message: "Parameter verification failed.", Errors: map[string]string{"upid": "no such task"}, Times: 2})
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			if tc.budgets != nil {
				b := testBudgets()
				tc.budgets(&b)
				e.be.b, e.be.c.budgets = b, b
			}
			var pid string
			if tc.op == "get" || tc.op == "delete" {
				in, _ := e.created(t, uid)
				pid = in.GetProviderId()
			}
			tc.setup(t, e)
			var err error
			switch tc.op {
			case "get":
				_, err = e.be.Get(ctxT(t), &provisionerv1.GetInstanceRequest{ProviderId: pid, ProxyUid: uid})
			case "delete":
				_, err = e.be.Delete(ctxT(t), &provisionerv1.DeleteInstanceRequest{ProviderId: pid, ProxyUid: uid})
			default:
				_, err = e.be.Create(ctxT(t), createReq(uid))
			}
			if tc.wantClass == 0 {
				if err != nil {
					t.Fatalf("err = %v, want success", err)
				}
				return
			}
			if errclass.Of(err) != tc.wantClass {
				t.Fatalf("err = %v (%v), want %v", err, errclass.Of(err), tc.wantClass)
			}
			if !strings.Contains(err.Error(), tc.wantMsg) {
				t.Errorf("error %q lacks %q", err, tc.wantMsg)
			}
			if strings.Contains(err.Error(), tokenSecret) || strings.Contains(err.Error(), "cl0ud-1n1t-s3cr3t") {
				t.Errorf("the error carries a secret: %v", err)
			}
		})
	}
}

func TestCancellationIsTransient(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := e.be.Create(ctx, createReq("e7707000-0000-4000-8000-000000000002"))
	if errclass.Of(err) != errclass.Transient {
		t.Errorf("err = %v", err)
	}
}

func TestStartupWarnings(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	var logs syncBuffer
	cfg := Config{URL: "https://pve.example:8006", TokenFile: filepath.Join(dir, "missing"), InsecureSkipTLSVerify: true, Nodes: []string{"pv1-1"},
		ISOStorage: "proxy-seeds", Templates: map[string]Template{"d": {VMID: 9001}}, MachineTypes: map[string]MachineType{"s": {Cores: 1, MemoryMiB: 512}}}
	if _, err := New("pve", cfg, slog.New(slog.NewJSONHandler(&logs, nil)), Options{}); err != nil {
		t.Fatal(err)
	}
	out := logs.String()
	for _, want := range []string{`"level":"WARN","msg":"WARNING: token file is not readable; every call fails until it is"`, `"reason":"no such file or directory"`, `"msg":"WARNING: insecureSkipTLSVerify is set"`} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %s:\n%s", want, out)
		}
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	good := func() Config {
		return Config{URL: "https://pve:8006", TokenFile: "/t", Nodes: []string{"pv1-1"}, ISOStorage: "proxy-seeds",
			Templates: map[string]Template{"d": {VMID: 9001}}, MachineTypes: map[string]MachineType{"s": {Cores: 1, MemoryMiB: 512}}}
	}
	cases := []struct {
		name string
		mut  func(c *Config)
		want string
	}{
		{"valid", func(c *Config) {}, ""},
		{"no url", func(c *Config) { c.URL = "" }, "url is required"},
		{"http url", func(c *Config) { c.URL = "http://pve:8006" }, "want https://"},
		{"url with a path", func(c *Config) { c.URL = "https://pve:8006/api2/json" }, "give no path"},
		{"no token file", func(c *Config) { c.TokenFile = "" }, "tokenFile is required"},
		{"no nodes", func(c *Config) { c.Nodes = nil }, "at least one node"},
		{"bad node", func(c *Config) { c.Nodes = []string{"PV1"} }, "lowercase letters"},
		{"duplicate node", func(c *Config) { c.Nodes = []string{"a", "a"} }, "listed twice"},
		{"no iso storage", func(c *Config) { c.ISOStorage = "" }, "isoStorage is required"},
		{"vlan out of range", func(c *Config) { c.VLANTag = 4095 }, "vlanTag 4095"},
		{"range inverted", func(c *Config) { c.VMIDRange = VMIDRange{Min: 500, Max: 400} }, "vmidRange"},
		{"range too low", func(c *Config) { c.VMIDRange = VMIDRange{Min: 50, Max: 400} }, "vmidRange"},
		{"no templates", func(c *Config) { c.Templates = nil }, "at least one template"},
		{"template vmid low", func(c *Config) { c.Templates = map[string]Template{"d": {VMID: 99}} }, "templates.d.vmid"},
		{"no machine types", func(c *Config) { c.MachineTypes = nil }, "at least one machine type"},
		{"zero cores", func(c *Config) { c.MachineTypes = map[string]MachineType{"s": {MemoryMiB: 1}} }, "machineTypes.s.cores"},
		{"zero memory", func(c *Config) { c.MachineTypes = map[string]MachineType{"s": {Cores: 1}} }, "machineTypes.s.memoryMiB"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := good()
			tc.mut(&c)
			err := c.WithDefaults().Validate()
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				d := c.WithDefaults()
				if d.VMIDRange.Min != 100000 || d.VMIDRange.Max != 199999 || d.RequestTimeoutSeconds != 30 || !*d.InstallGuestAgent {
					t.Errorf("defaults = %+v", d)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestHelpers(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ prop, key, val, want string }{
		{"virtio=BC:24:11:2E:C5:4A,bridge=vmbr0,firewall=1", "bridge", "vmbr1", "virtio=BC:24:11:2E:C5:4A,bridge=vmbr1,firewall=1"},
		{"virtio=BC:24:11:2E:C5:4A,bridge=vmbr0", "tag", "4", "virtio=BC:24:11:2E:C5:4A,bridge=vmbr0,tag=4"},
		{"virtio=BC:24:11:2E:C5:4A,bridge=vmbr0,tag=7,mtu=1400", "tag", "4", "virtio=BC:24:11:2E:C5:4A,bridge=vmbr0,tag=4,mtu=1400"},
	} {
		if got := setOption(tc.prop, tc.key, tc.val); got != tc.want {
			t.Errorf("setOption(%q, %s) = %q, want %q", tc.prop, tc.key, got, tc.want)
		}
	}
	for _, tc := range []struct {
		cfg  map[string]string
		slot string
		size float64
		ok   bool
	}{
		{map[string]string{"boot": "order=scsi0;ide2;net0", "scsi0": "local-lvm:vm-1-disk-0,size=32G"}, "scsi0", 32, true},
		{map[string]string{"boot": "order=ide2;virtio0", "ide2": "local:iso/x.iso,media=cdrom", "virtio0": "local:vm-1-disk-0,size=512M"}, "virtio0", 0.5, true},
		{map[string]string{"boot": "order=net0"}, "", 0, false},
		{map[string]string{"bootdisk": "sata0", "sata0": "local:vm-1-disk-0,size=1T"}, "sata0", 1024, true},
		{map[string]string{"boot": "order=scsi0", "scsi0": "local:vm-1-disk-0"}, "scsi0", 0, false},
	} {
		slot, size, ok := bootDisk(tc.cfg)
		if slot != tc.slot || size != tc.size || ok != tc.ok {
			t.Errorf("bootDisk(%v) = %s %v %v", tc.cfg, slot, size, ok)
		}
	}
	for _, tc := range []struct {
		desc string
		want mark
	}{
		{"admin\nproxy-operator-managed=true\nproxy-operator-uid=u1\nproxy-operator-created-at=2026-09-23T17:42:11Z\nnote", mark{true, "u1", time.Date(2026, 9, 23, 17, 42, 11, 0, time.UTC), ""}},
		{"proxy-operator-managed=false\nproxy-operator-uid=u1", mark{false, "u1", time.Time{}, ""}},
		{"", mark{}},
	} {
		if got := parseMark(tc.desc); got != tc.want {
			t.Errorf("parseMark(%q) = %+v, want %+v", tc.desc, got, tc.want)
		}
	}
	if n, _ := instanceName("0F3A-x_y"); n != "proxy-0f3a-x-y" {
		t.Errorf("instanceName = %q", n)
	}
}
