package proxmox

import (
	"strings"
	"testing"
	"time"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/services/provisioner-proxmox/internal/pvefake"
)

func TestDeleteFresh(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	in, _ := e.created(t, "de1e7e00-0000-4000-8000-000000000001")
	e.fake.ResetCalls()
	req := &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: in.GetProxyUid()}
	deleted, err := e.be.Delete(ctxT(t), req)
	if err != nil || !deleted {
		t.Fatalf("Delete = %v, %v", deleted, err)
	}
	if vms := e.fake.VMs(); len(vms) != 0 {
		t.Errorf("VMs left: %v", vms)
	}
	if f := e.fake.Files("pv1-1", "proxy-seeds"); len(f) != 0 {
		t.Errorf("seeds left: %v", f)
	}
	form := e.fake.LastForm("DELETE /nodes/{node}/qemu/{vmid}")
	if form.Get("purge") != "1" || form.Get("destroy-unreferenced-disks") != "1" {
		t.Errorf("destroy parameters = %v", form)
	}
	// resources, config, status, stop+poll, destroy+poll, seed delete+poll
	if n := e.fake.TotalCalls(); n != 9 {
		t.Errorf("a Delete of a running VM made %d calls, want 9: %v", n, e.fake.Calls())
	}
	// Again: nothing left, the seed is looked for on every node.
	deleted, err = e.be.Delete(ctxT(t), req)
	if err != nil || deleted {
		t.Errorf("second Delete = %v, %v; want false, nil", deleted, err)
	}
}

func TestDeleteCases(t *testing.T) {
	t.Parallel()
	const uid = "de1e7e00-0000-4000-8000-000000000002"
	cases := []struct {
		name        string
		nodes       []string
		setup       func(e *env, vmid int)
		uid         string
		wantDeleted bool
		wantClass   errclass.Class
		wantMsg     string
		check       func(t *testing.T, e *env, vmid int)
	}{
		{name: "a paused VM is stopped too", wantDeleted: true, setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.QMP = "paused" })
		}, check: func(t *testing.T, e *env, vmid int) {
			if e.fake.Calls()["POST /nodes/{node}/qemu/{vmid}/status/stop"] != 1 {
				t.Error("no stop")
			}
		}},
		{name: "a stopped VM is not stopped again", wantDeleted: true, setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Status, v.QMP = "stopped", "stopped" })
		}, check: func(t *testing.T, e *env, vmid int) {
			if e.fake.Calls()["POST /nodes/{node}/qemu/{vmid}/status/stop"] != 0 {
				t.Error("stopped a stopped VM")
			}
		}},
		{name: "hibernated is Permanent", setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Status, v.Config["lock"] = "stopped", "suspended" })
		}, wantClass: errclass.Permanent, wantMsg: "resume or destroy it in Proxmox"},
		{name: "locked is Transient", setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Config["lock"] = "backup" })
		}, wantClass: errclass.Transient, wantMsg: "is locked (backup)"},
		{name: "another UID's VM is left alone", uid: "someone-else", check: func(t *testing.T, e *env, vmid int) {
			if _, ok := e.fake.VMs()[vmid]; !ok {
				t.Error("the VM was destroyed")
			}
		}},
		{name: "an unmarked VM is left alone", setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Config["description"] = "" })
		}, check: func(t *testing.T, e *env, vmid int) {
			if _, ok := e.fake.VMs()[vmid]; !ok {
				t.Error("the VM was destroyed")
			}
		}},
		{name: "a renamed VM is left alone and the seed looked for on every node", nodes: []string{"pv1-1", "pv1-2"}, setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Config["name"] = "reused" })
			e.fake.PutFile("pv1-2", "proxy-seeds", "iso/proxy-"+uid+"-seed.iso", []byte("x"))
		}, check: func(t *testing.T, e *env, vmid int) {
			if _, ok := e.fake.VMs()[vmid]; !ok {
				t.Error("the VM was destroyed")
			}
			for _, n := range []string{"pv1-1", "pv1-2"} {
				if f := e.fake.Files(n, "proxy-seeds"); len(f) != 0 {
					t.Errorf("seed left on %s: %v", n, f)
				}
			}
		}},
		{name: "a node that does not answer the seed delete of a gone VM is skipped", nodes: []string{"pv1-1", "pv1-2"}, setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Config["name"] = "reused" })
			e.fake.PutFile("pv1-2", "proxy-seeds", "iso/proxy-"+uid+"-seed.iso", []byte("x"))
			e.fake.Inject(pvefake.Fault{Method: "DELETE", Path: "/nodes/pv1-1/storage/", Status: 595, Message: "Errors during connection establishment, proxy handler: No route to host", Times: 1})
		}, check: func(t *testing.T, e *env, vmid int) {
			if f := e.fake.Files("pv1-2", "proxy-seeds"); len(f) != 0 {
				t.Errorf("seed left on the node that answers: %v", f)
			}
			if f := e.fake.Files("pv1-1", "proxy-seeds"); len(f) != 1 {
				t.Errorf("seeds on the node that did not answer: %v, want the one left for the sweep", f)
			}
		}},
		{name: "a node whose seed delete times out is skipped", nodes: []string{"pv1-1", "pv1-2"}, setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Config["name"] = "reused" })
			e.fake.Inject(pvefake.Fault{Method: "DELETE", Path: "/nodes/pv1-1/storage/", Delay: time.Minute, Times: 1})
		}},
		{name: "a seed delete answered 500 on a gone VM's node is skipped", nodes: []string{"pv1-1", "pv1-2"}, setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Config["name"] = "reused" })
			e.fake.Inject(pvefake.Fault{Method: "DELETE", Path: "/nodes/pv1-2/storage/", Status: 500, Message: "storage 'proxy-seeds' is not online", Times: 1})
		}},
		{name: "a destroy task that fails is Transient", setup: func(e *env, vmid int) {
			e.fake.FailNextTask("qmdestroy", "VM is locked (backup)")
		}, wantClass: errclass.Transient, wantMsg: "VM is locked (backup)"},
		{name: "a node that does not answer is Transient", setup: func(e *env, vmid int) { e.fake.SetNodeDown("pv1-1", 596) }, wantClass: errclass.Transient},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, func(c *Config) {
				if tc.nodes != nil {
					c.Nodes = tc.nodes
				}
			}, func(o *pvefake.Options) { o.Nodes = tc.nodes })
			req := createReq(uid)
			req.Placement.Zone = "pv1-1"
			in, err := e.be.Create(ctxT(t), req)
			if err != nil {
				t.Fatal(err)
			}
			vmid, _, _ := parseProviderID(in.GetProviderId())
			if tc.setup != nil {
				tc.setup(e, vmid)
			}
			e.fake.ResetCalls()
			reqUID := uid
			if tc.uid != "" {
				reqUID = tc.uid
			}
			deleted, err := e.be.Delete(ctxT(t), &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: reqUID})
			if tc.wantClass != 0 {
				if errclass.Of(err) != tc.wantClass || !strings.Contains(err.Error(), tc.wantMsg) {
					t.Fatalf("err = %v, want %v with %q", err, tc.wantClass, tc.wantMsg)
				}
				return
			}
			if err != nil || deleted != tc.wantDeleted {
				t.Fatalf("Delete = %v, %v; want %v", deleted, err, tc.wantDeleted)
			}
			if tc.check != nil {
				tc.check(t, e, vmid)
			}
		})
	}
}

// Without Datastore.Allocate on the seed storage the seed delete is a 403,
// and Delete is Permanent with Proxmox's message; a repeated Delete (the VM
// gone by now) stays Permanent while the seed is there, and succeeds once
// the privilege is granted and the seed is gone.
func TestDeleteWithoutDatastoreAllocateIsPermanent(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	in, _ := e.created(t, "de1e7e00-0000-4000-8000-000000000003")
	e.fake.AddToken(tokenUser, tokenSecret, map[string][]string{"/": pvefake.OperatorPrivileges})
	req := &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: in.GetProxyUid()}
	for attempt := 1; attempt <= 2; attempt++ {
		_, err := e.be.Delete(ctxT(t), req)
		if errclass.Of(err) != errclass.Permanent || !strings.Contains(err.Error(), "Permission check failed (/storage/proxy-seeds, Datastore.Allocate)") {
			t.Fatalf("attempt %d: err = %v", attempt, err)
		}
		if len(e.fake.VMs()) != 0 {
			t.Error("the VM should be destroyed before the seed delete fails")
		}
		if f := e.fake.Files("pv1-1", "proxy-seeds"); len(f) != 1 {
			t.Fatalf("attempt %d: seeds %v, want the one the 403 left", attempt, f)
		}
	}
	e.fake.AddToken(tokenUser, tokenSecret, e.fake.OperatorACL())
	deleted, err := e.be.Delete(ctxT(t), req)
	if err != nil || deleted {
		t.Fatalf("Delete with the privilege granted = %v, %v; want false (the VM was gone), nil", deleted, err)
	}
	if f := e.fake.Files("pv1-1", "proxy-seeds"); len(f) != 0 {
		t.Errorf("seed left: %v", f)
	}
}
