package proxmox

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/provisioner-proxmox/internal/pvefake"
)

var defRange = VMIDRange{DefaultVMIDMin, DefaultVMIDMax}

func TestVMIDForIsStableAndInRange(t *testing.T) {
	t.Parallel()
	r := VMIDRange{Min: 1000, Max: 1009}
	first := vmidFor("uid-1", r, 0)
	if first != vmidFor("uid-1", r, 0) {
		t.Fatal("not deterministic")
	}
	for p := range 40 {
		v := vmidFor("uid-1", r, p)
		if v < r.Min || v > r.Max {
			t.Fatalf("probe %d: %d out of range", p, v)
		}
		if p > 0 && v != r.Min+(vmidFor("uid-1", r, p-1)-r.Min+1)%10 {
			t.Fatalf("probe %d does not move forward by one: %d", p, v)
		}
	}
}

// Ownership: what Create does with a VM already at the VMID or the name.
func TestCreateOwnership(t *testing.T) {
	t.Parallel()
	const uid = "0dd0dd00-0000-4000-8000-000000000001"
	name := "proxy-" + uid
	first := vmidFor(uid, defRange, 0)
	cases := []struct {
		name      string
		vms       []pvefake.VM
		wantVMID  int
		wantClass errclass.Class
		wantMsg   []string
	}{
		{name: "another name at the VMID: probe on",
			vms:      []pvefake.VM{{VMID: first, Node: "pv1-1", Config: map[string]string{"name": "db-1"}}},
			wantVMID: vmidFor(uid, defRange, 1)},
		{name: "our name and mark: adopted",
			vms:      []pvefake.VM{{VMID: 150123, Node: "pv1-1", Config: map[string]string{"name": name, "description": "admin note\n" + markLines(uid, "", time.Now()) + "more notes", "scsi0": "local-lvm:vm-150123-disk-0,size=3G", "boot": "order=scsi0", "net0": "virtio=BC:24:11:00:00:01,bridge=vmbr0"}}},
			wantVMID: 150123},
		{name: "our name and a mark with an empty UID: adopted",
			vms:      []pvefake.VM{{VMID: first, Node: "pv1-1", Config: map[string]string{"name": name, "description": "proxy-operator-managed=true\n", "net0": "virtio=BC:24:11:00:00:01,bridge=vmbr0"}}},
			wantVMID: first},
		{name: "our name without the mark: refused",
			vms:       []pvefake.VM{{VMID: first, Node: "pv1-1", Config: map[string]string{"name": name, "description": "made by hand"}}},
			wantClass: errclass.Permanent, wantMsg: []string{fmt.Sprint(first), uid, "no proxy-operator mark"}},
		{name: "our name with another UID: refused naming both UIDs",
			vms:       []pvefake.VM{{VMID: 150124, Node: "pv1-1", Config: map[string]string{"name": name, "description": markLines("other-uid", "", time.Now())}}},
			wantClass: errclass.Permanent, wantMsg: []string{"150124", uid, "other-uid"}},
		{name: "two VMs with our name: refused naming every VMID",
			vms: []pvefake.VM{
				{VMID: 150125, Node: "pv1-1", Config: map[string]string{"name": name, "description": markLines(uid, "", time.Now())}},
				{VMID: 150126, Node: "pv1-1", Config: map[string]string{"name": name, "description": markLines(uid, "", time.Now())}},
			},
			wantClass: errclass.Permanent, wantMsg: []string{"150125", "150126", "remove all but one"}},
		{name: "ours hibernated: latched",
			vms:       []pvefake.VM{{VMID: 150127, Node: "pv1-1", Config: map[string]string{"name": name, "lock": "suspended", "description": markLines(uid, "", time.Now())}}},
			wantClass: errclass.Permanent, wantMsg: []string{"150127", "resume or destroy it in Proxmox"}},
		{name: "on a node that does not answer: Transient",
			vms:       []pvefake.VM{{VMID: first, Node: "pv1-2", Config: map[string]string{"name": name}}},
			wantClass: errclass.Transient, wantMsg: []string{"does not answer"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, func(c *Config) { c.Nodes = []string{"pv1-1", "pv1-2"} }, func(o *pvefake.Options) { o.Nodes = []string{"pv1-1", "pv1-2"} })
			for _, v := range tc.vms {
				e.fake.AddVM(v)
			}
			e.fake.SetNodeDown("pv1-2", 595)
			req := createReq(uid)
			req.Placement.Zone = "pv1-1"
			in, err := e.be.Create(ctxT(t), req)
			if tc.wantClass != 0 {
				if errclass.Of(err) != tc.wantClass {
					t.Fatalf("err = %v, want %v", err, tc.wantClass)
				}
				for _, m := range tc.wantMsg {
					if !strings.Contains(err.Error(), m) {
						t.Errorf("error %q lacks %q", err, m)
					}
				}
				if n := e.fake.Calls()["POST /nodes/{node}/qemu/{vmid}/clone"]; n != 0 {
					t.Errorf("%d clones", n)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if in.GetProviderId() != providerID(tc.wantVMID, name) {
				t.Errorf("providerID %s, want VMID %d", in.GetProviderId(), tc.wantVMID)
			}
			if e.fake.VMs()[tc.wantVMID].Status != "running" {
				t.Error("not running")
			}
			if desc := e.fake.VMs()[tc.wantVMID].Config["description"]; strings.Contains(desc, "admin note") != strings.Contains(tc.vms[0].Config["description"], "admin note") {
				t.Errorf("admin lines not kept: %q", desc)
			}
		})
	}
}

// Create resumed after a crash at each step: same VMID, adoption, never a
// second VM. The crash is a cut connection at the step's request (a GET
// on a cut connection is retried by net/http itself, so task waits are cut
// with pveproxy's 596 instead).
func TestCreateResumesAfterACrashAtEachStep(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		fault pvefake.Fault
	}{
		{"during the clone request", pvefake.Fault{Method: "POST", Path: "/clone", Cut: true, Times: 1}},
		{"waiting for the clone task", pvefake.Fault{Method: "GET", Path: ":qmclone:", Status: 596, Message: "Connection timed out", Times: 1}},
		{"after the clone, at the upload", pvefake.Fault{Method: "POST", Path: "/upload", Cut: true, Times: 1}},
		{"waiting for the upload task", pvefake.Fault{Method: "GET", Path: ":imgcopy:", Status: 596, Message: "Connection timed out", Times: 1}},
		{"at the config write", pvefake.Fault{Method: "PUT", Path: "/config", Cut: true, Times: 1}},
		{"at the resize", pvefake.Fault{Method: "PUT", Path: "/resize", Cut: true, Times: 1}},
		{"at the start", pvefake.Fault{Method: "POST", Path: "/status/start", Cut: true, Times: 1}},
		{"waiting for the start task", pvefake.Fault{Method: "GET", Path: ":qmstart:", Status: 596, Message: "Connection timed out", Times: 1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			const uid = "c4a5h000-0000-4000-8000-000000000001"
			req := createReq(uid)
			req.Placement.MachineType = "big" // with a resize
			e.fake.Inject(tc.fault)
			if _, err := e.be.Create(ctxT(t), req); errclass.Of(err) != errclass.Transient {
				t.Fatalf("first attempt: %v, want a Transient failure", err)
			}
			in, err := e.be.Create(ctxT(t), req)
			if err != nil {
				t.Fatalf("second attempt: %v", err)
			}
			vm := e.onlyVM(t)
			if vm.VMID != vmidFor(uid, defRange, 0) || in.GetProviderId() != providerID(vm.VMID, "proxy-"+uid) {
				t.Errorf("VM %d, instance %s", vm.VMID, in.GetProviderId())
			}
			if vm.Status != "running" || vm.Config["scsi0"] == "" || !strings.Contains(vm.Config["scsi0"], "size=10G") || vm.Config["tags"] != "proxy_operator" {
				t.Errorf("VM not finished: %v", vm)
			}
			if n := e.fake.Calls()["POST /nodes/{node}/qemu/{vmid}/clone"]; n > 2 {
				t.Errorf("%d clone requests", n)
			}
			// The upload overwrites: the seed is never deleted first.
			if n := e.fake.Calls()["DELETE /nodes/{node}/storage/{storage}/content/{volume...}"]; n != 0 {
				t.Errorf("%d seed deletes during Create", n)
			}
		})
	}
}

// A crash mid-clone: the retry lands on the same VMID, waits for the
// clone's lock, and adopts the VM.
func TestCreateWaitsForACloneLockAndAdopts(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	const uid = "c4a5h000-0000-4000-8000-000000000002"
	e.fake.HoldClones()
	started := e.fake.CloneStarted()
	ctx1, cancel1 := context.WithCancel(context.Background())
	done1 := make(chan error, 1)
	go func() { _, err := e.be.Create(ctx1, createReq(uid)); done1 <- err }()
	vmid := <-started
	cancel1() // the crash
	if err := <-done1; err == nil {
		t.Fatal("the interrupted Create succeeded")
	}
	done2 := make(chan error, 1)
	var in *provisionerv1.Instance
	go func() {
		var err error
		in, err = e.be.Create(ctxT(t), createReq(uid))
		done2 <- err
	}()
	reads := func() int { return e.fake.Calls()["GET /nodes/{node}/qemu/{vmid}/config"] }
	before := reads()
	waittest.For(t, 10*time.Second, "poll of the locked VM's config", func() bool { return reads() >= before+2 })
	e.fake.ReleaseClones()
	if err := <-done2; err != nil {
		t.Fatal(err)
	}
	if in.GetProviderId() != providerID(vmid, "proxy-"+uid) {
		t.Errorf("adopted %s, want VMID %d", in.GetProviderId(), vmid)
	}
	if vm := e.onlyVM(t); vm.Status != "running" {
		t.Errorf("VM = %v", vm)
	}
	if n := e.fake.Calls()["POST /nodes/{node}/qemu/{vmid}/clone"]; n != 1 {
		t.Errorf("%d clones, want 1", n)
	}
	if !strings.Contains(e.logs.String(), `"msg":"proxmox vm adopted"`) {
		t.Error("no adoption logged")
	}
}

func TestCreateRunningVMIsReturnedAtOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	const uid = "c4a5h000-0000-4000-8000-000000000003"
	e.created(t, uid)
	e.fake.ResetCalls()
	if _, err := e.be.Create(ctxT(t), createReq(uid)); err != nil {
		t.Fatal(err)
	}
	// resources, config (ownership), status
	if n := e.fake.TotalCalls(); n != 3 {
		t.Errorf("a repeated Create of a running VM made %d calls, want 3: %v", n, e.fake.Calls())
	}
}

func TestResizeRule(t *testing.T) {
	t.Parallel()
	cases := []struct {
		machineType string
		wantSize    string
		wantResize  int
	}{
		{"small", "size=3G", 0},     // no diskGiB
		{"tiny-disk", "size=3G", 0}, // never shrunk
		{"big", "size=10G", 1},      // grown
	}
	for _, tc := range cases {
		t.Run(tc.machineType, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			req := createReq("5a5a5a5a-0000-4000-8000-000000000001")
			req.Placement.MachineType = tc.machineType
			if _, err := e.be.Create(ctxT(t), req); err != nil {
				t.Fatal(err)
			}
			vm := e.onlyVM(t)
			if !strings.HasSuffix(vm.Config["scsi0"], tc.wantSize) {
				t.Errorf("scsi0 = %q, want %s", vm.Config["scsi0"], tc.wantSize)
			}
			if n := e.fake.Calls()["PUT /nodes/{node}/qemu/{vmid}/resize"]; n != tc.wantResize {
				t.Errorf("%d resizes, want %d", n, tc.wantResize)
			}
		})
	}
}

func TestPlacementMessages(t *testing.T) {
	t.Parallel()
	cases := []struct {
		nodes     []string
		placement *proxyv1.Placement
		want      string
	}{
		{[]string{"pv1-1"}, &proxyv1.Placement{Zone: "x", MachineType: "small", Image: "debian-13"}, `placement.zone "x" is not in proxmox.nodes`},
		{[]string{"pv1-1", "pv1-2"}, &proxyv1.Placement{MachineType: "small", Image: "debian-13"}, `placement.zone is required when proxmox.nodes lists more than one node`},
		{[]string{"pv1-1"}, &proxyv1.Placement{MachineType: "x", Image: "debian-13"}, `placement.machineType "x" is not in proxmox.machineTypes`},
		{[]string{"pv1-1"}, &proxyv1.Placement{MachineType: "small", Image: "x"}, `placement.image "x" is not in proxmox.templates`},
	}
	for _, tc := range cases {
		t.Run(tc.want, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, func(c *Config) { c.Nodes = tc.nodes })
			req := createReq("9a9a9a9a-0000-4000-8000-000000000001")
			req.Placement = tc.placement
			_, err := e.be.Create(ctxT(t), req)
			if errclass.Of(err) != errclass.Permanent || err.Error() != tc.want {
				t.Errorf("err = %v, want Permanent %q", err, tc.want)
			}
			if n := e.fake.TotalCalls(); n != 0 {
				t.Errorf("%d requests before the placement was checked", n)
			}
		})
	}
}

func TestTemplateChecks(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name        string
		edit        func(cfg map[string]string)
		notTemplate bool
		missing     bool
		machineType string
		want        string
	}{
		{name: "missing", missing: true, want: `placement.image "debian-13": template VM 9001 does not exist`},
		{name: "not a template", notTemplate: true, want: `placement.image "debian-13": template VM 9001 is not a template`},
		{name: "a cloud-init drive", edit: func(c map[string]string) { c["ide2"] = "local-lvm:vm-9001-cloudinit,media=cdrom" }, want: "cloud-init drive on ide2"},
		{name: "no net0 while vlanTag is set", edit: func(c map[string]string) { delete(c, "net0") }, want: "has no net0"},
		{name: "diskGiB without a sized boot disk", edit: func(c map[string]string) { c["scsi0"] = "local-lvm:base-9001-disk-1" }, machineType: "big", want: "no boot disk with a readable size="},
		{name: "diskGiB without a boot disk", edit: func(c map[string]string) { delete(c, "boot") }, machineType: "big", want: "no boot disk with a readable size="},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			cfg := pvefake.DebianTemplate()
			if tc.edit != nil {
				tc.edit(cfg)
			}
			if tc.missing {
				e.be.cfg.Templates = map[string]Template{"debian-13": {VMID: 9002}}
				tc.want = strings.Replace(tc.want, "9001", "9002", 1)
			} else {
				e.fake.AddTemplate(templateID, "pv1-1", cfg, tc.notTemplate)
			}
			req := createReq("7e7e7e7e-0000-4000-8000-000000000001")
			if tc.machineType != "" {
				req.Placement.MachineType = tc.machineType
			}
			_, err := e.be.Create(ctxT(t), req)
			if errclass.Of(err) != errclass.Permanent || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want Permanent with %q", err, tc.want)
			}
			if n := e.fake.Calls()["POST /nodes/{node}/qemu/{vmid}/clone"]; n != 0 {
				t.Errorf("%d clones of a bad template", n)
			}
		})
	}
}

func TestNoFreeVMIDAfter32Probes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.VMIDRange = VMIDRange{Min: 1000, Max: 1031} })
	for id := 1000; id <= 1031; id++ {
		e.fake.AddVM(pvefake.VM{VMID: id, Node: "pv1-1", Config: map[string]string{"name": fmt.Sprintf("other-%d", id)}})
	}
	_, err := e.be.Create(ctxT(t), createReq("fu11fu11-0000-4000-8000-000000000001"))
	if errclass.Of(err) != errclass.Transient || !strings.Contains(err.Error(), "after 32 probes") {
		t.Fatalf("err = %v", err)
	}
}
