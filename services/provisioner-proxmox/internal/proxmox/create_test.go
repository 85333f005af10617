package proxmox

import (
	"strings"
	"testing"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/nocloud"
	"github.com/egress-proxies/egress-proxies/services/provisioner-proxmox/internal/pvefake"
)

func TestCreateFresh(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	uid := "0f3a6c1e-2b4d-4c8e-9a7f-1d2e3f4a5b6c"
	in, err := e.be.Create(ctx, createReq(uid))
	if err != nil {
		t.Fatal(err)
	}
	vm := e.onlyVM(t)
	name := "proxy-" + uid
	if in.GetProviderId() != providerID(vm.VMID, name) || in.GetName() != name || in.GetProxyUid() != uid {
		t.Errorf("instance = %v, VM %d", in, vm.VMID)
	}
	if vm.VMID != vmidFor(uid, VMIDRange{DefaultVMIDMin, DefaultVMIDMax}, 0) {
		t.Errorf("VMID %d is not the UID's first candidate", vm.VMID)
	}
	if in.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING || vm.Status != "running" {
		t.Errorf("state %v, VM status %s", in.GetState(), vm.Status)
	}
	m := parseMark(vm.Config["description"])
	if !m.managed || m.uid != uid || m.createdAt.IsZero() {
		t.Errorf("mark = %+v from %q", m, vm.Config["description"])
	}
	// The config write, field by field.
	form := e.fake.LastForm("PUT /nodes/{node}/qemu/{vmid}/config")
	want := map[string]string{
		"cores": "1", "memory": "1024", "agent": "1", "tags": "proxy_operator",
		"ide2": "proxy-seeds:iso/" + name + "-seed.iso,media=cdrom",
	}
	for k, v := range want {
		if form.Get(k) != v {
			t.Errorf("config write %s = %q, want %q", k, form.Get(k), v)
		}
	}
	net0 := form.Get("net0")
	if !strings.HasPrefix(net0, "virtio=BC:24:11:") || !strings.Contains(net0, ",bridge=vmbr1,") || !strings.Contains(net0, "firewall=1") || !strings.HasSuffix(net0, ",tag=4") {
		t.Errorf("net0 = %q: want the cloned model and MAC, bridge replaced, firewall kept, tag appended", net0)
	}
	if len(form) != 6 {
		t.Errorf("config write carries %d keys, want 6: %v", len(form), form)
	}
	if vm.Config["agent"] != "1" || vm.Config["boot"] != "order=scsi0;ide2" {
		t.Errorf("agent %q boot %q", vm.Config["agent"], vm.Config["boot"])
	}
	// The seed, read back from the uploaded ISO.
	iso := e.fake.File("pv1-1", "proxy-seeds", "iso/"+name+"-seed.iso")
	label, files, err := nocloud.ReadSeedISO(iso)
	if err != nil {
		t.Fatal(err)
	}
	if label != "cidata" || string(files["user-data"]) != cloudInit ||
		string(files["meta-data"]) != "instance-id: "+name+"\nlocal-hostname: "+name+"\n" ||
		string(files["vendor-data"]) != nocloud.GuestAgentScript {
		t.Errorf("seed: label %q files %q", label, files)
	}
	// The number of API calls of a fresh Create (tasks end at once on the
	// fake, so each is one start and one status poll).
	calls := e.fake.Calls()
	wantCalls := map[string]int{
		"GET /cluster/resources":                       2, // name lookup, template check
		"GET /nodes/{node}/qemu/{vmid}/config":         2, // template, clone
		"POST /nodes/{node}/qemu/{vmid}/clone":         1,
		"GET /nodes/{node}/tasks/{upid}/status":        3, // clone, upload, start
		"GET /nodes/{node}/qemu/{vmid}/status/current": 2,
		"POST /nodes/{node}/storage/{storage}/upload":  1,
		"PUT /nodes/{node}/qemu/{vmid}/config":         1,
		"POST /nodes/{node}/qemu/{vmid}/status/start":  1,
	}
	for k, v := range wantCalls {
		if calls[k] != v {
			t.Errorf("%s: %d calls, want %d", k, calls[k], v)
		}
	}
	if n := e.fake.TotalCalls(); n != 13 {
		t.Errorf("a fresh Create made %d calls, want 13: %v", n, calls)
	}
}

// Real tasks take a while: each status poll that answers "no such task" or
// "running" is one more call, and Create still finishes.
func TestCreateWithSlowTasks(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.fake.SetTaskTiming(1, 2)
	if _, err := e.be.Create(ctxT(t), createReq("5105e000-0000-4000-8000-000000000001")); err != nil {
		t.Fatal(err)
	}
	if vm := e.onlyVM(t); vm.Status != "running" {
		t.Fatalf("VM = %v", vm)
	}
	// 13 calls, plus three more polls for each of the three tasks.
	if n := e.fake.TotalCalls(); n != 13+3*3 {
		t.Errorf("%d calls, want 22: %v", n, e.fake.Calls())
	}
}

// Our VM sits at the UID's second VMID on a node that stops answering
// (its name unseen), the first VMID free again: Create must not clone a
// second VM while the node is away, unless the configuration says so; once
// the node answers, Create adopts the one VM.
func TestCreateWhileANodeDoesNotAnswer(t *testing.T) {
	t.Parallel()
	const uid = "0da0da00-0000-4000-8000-000000000001"
	nodes := []string{"pv1-1", "pv1-2"}
	for _, tc := range []struct {
		name        string
		cloneAnyway bool
	}{{"refuses to clone", false}, {"cloneWhileNodesUnreachable clones", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, func(c *Config) { c.Nodes, c.CloneWhileNodesUnreachable = nodes, tc.cloneAnyway },
				func(o *pvefake.Options) { o.Nodes = nodes })
			first := vmidFor(uid, VMIDRange{DefaultVMIDMin, DefaultVMIDMax}, 0)
			e.fake.AddVM(pvefake.VM{VMID: first, Node: "pv1-1", Config: map[string]string{"name": "someone-else"}})
			req := createReq(uid)
			req.Placement.Zone = "pv1-2"
			in, err := e.be.Create(ctxT(t), req)
			if err != nil {
				t.Fatal(err)
			}
			ours, _, _ := parseProviderID(in.GetProviderId())
			if ours == first {
				t.Fatal("the VM took the UID's first VMID although it was taken")
			}
			e.fake.RemoveVM(first)
			e.fake.SetNodeDown("pv1-2", 595)
			req.Placement.Zone = "pv1-1"
			_, err = e.be.Create(ctxT(t), req)
			if tc.cloneAnyway {
				if err != nil {
					t.Fatalf("create with cloneWhileNodesUnreachable: %v", err)
				}
				if n := len(e.fake.VMs()); n != 2 {
					t.Errorf("%d VMs, want the second clone the option allows", n)
				}
				return
			}
			if errclass.Of(err) != errclass.Transient || !strings.Contains(err.Error(), "nodes that do not answer (pv1-2)") {
				t.Fatalf("create while pv1-2 does not answer = %v, want Transient naming pv1-2", err)
			}
			if vms := e.fake.VMs(); len(vms) != 1 {
				t.Fatalf("%d VMs after the refused create, want 1: %v", len(vms), vms)
			}
			e.fake.SetNodeDown("pv1-2", 0)
			again, err := e.be.Create(ctxT(t), req)
			if err != nil || again.GetProviderId() != in.GetProviderId() {
				t.Fatalf("create once pv1-2 answers = %v, %v; want the VM adopted at %s", again, err, in.GetProviderId())
			}
			if vms := e.fake.VMs(); len(vms) != 1 {
				t.Errorf("%d VMs, want 1", len(vms))
			}
		})
	}
}

// A proxy's credentials reach the VM as NoCloud meta-data keys on the
// uploaded seed ISO, which the proxy's cloud-init reads; the trace log of
// the whole Create (every API call) never shows the password.
func TestCreateDeliversCredentials(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	uid := "0f3a6c1e-2b4d-4c8e-9a7f-1d2e3f4a5b6d"
	req := createReq(uid)
	req.Credentials = &proxyv1.ProxyCredentials{Username: "egress-0a1b2c3d4e5f", Password: "Zq9-xY_0aBcDeFgHiJkLmNoPqRsTuVwX"}
	if _, err := e.be.Create(ctxT(t), req); err != nil {
		t.Fatal(err)
	}
	name := "proxy-" + uid
	_, files, err := nocloud.ReadSeedISO(e.fake.File("pv1-1", "proxy-seeds", "iso/"+name+"-seed.iso"))
	if err != nil {
		t.Fatal(err)
	}
	want := "instance-id: " + name + "\nlocal-hostname: " + name + "\n" +
		"egress_proxy_user: \"egress-0a1b2c3d4e5f\"\negress_proxy_password: \"Zq9-xY_0aBcDeFgHiJkLmNoPqRsTuVwX\"\n"
	if got := string(files["meta-data"]); got != want {
		t.Errorf("seed meta-data = %q, want %q", got, want)
	}
	if string(files["user-data"]) != cloudInit {
		t.Errorf("user-data changed: %q", files["user-data"])
	}
	if logs := e.logs.String(); strings.Contains(logs, req.Credentials.Password) || !strings.Contains(logs, "Upload") {
		t.Errorf("the trace log shows the password, or shows no upload (the check would prove nothing):\n%s", logs)
	}
}
