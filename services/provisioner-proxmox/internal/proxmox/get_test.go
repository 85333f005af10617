package proxmox

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/services/provisioner-proxmox/internal/pvefake"
)

// created runs a fresh Create and returns the instance and its VMID.
func (e *env) created(t *testing.T, uid string) (*provisionerv1.Instance, int) {
	t.Helper()
	in, err := e.be.Create(ctxT(t), createReq(uid))
	if err != nil {
		t.Fatal(err)
	}
	vmid, _, err := parseProviderID(in.GetProviderId())
	if err != nil {
		t.Fatal(err)
	}
	return in, vmid
}

func TestGetStates(t *testing.T) {
	t.Parallel()
	const uid = "6b0e2c4a-1111-4222-8333-444455556666"
	cases := []struct {
		name      string
		setup     func(e *env, vmid int)
		uid       string // of the request; uid when empty
		wantState provisionerv1.InstanceState
		wantIP    bool
		wantClass errclass.Class
	}{
		{name: "running with an address", wantState: provisionerv1.InstanceState_INSTANCE_STATE_RUNNING, wantIP: true},
		{name: "agent not running yet is Provisioning", setup: func(e *env, vmid int) { e.fake.SetAgent(vmid, pvefake.AgentNotRunning) },
			wantState: provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING},
		{name: "agent without an IPv4 yet is Provisioning", setup: func(e *env, vmid int) { e.fake.SetAgent(vmid, pvefake.AgentNoAddress) },
			wantState: provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING},
		{name: "no agent configured is Stopped", setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { delete(v.Config, "agent") })
		}, wantState: provisionerv1.InstanceState_INSTANCE_STATE_STOPPED},
		{name: "stopped", setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Status, v.QMP = "stopped", "stopped" })
		}, wantState: provisionerv1.InstanceState_INSTANCE_STATE_STOPPED},
		{name: "paused is Stopped", setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.QMP = "paused" })
		}, wantState: provisionerv1.InstanceState_INSTANCE_STATE_STOPPED},
		{name: "hibernated is Stopped", setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Status, v.QMP, v.Config["lock"] = "stopped", "stopped", "suspended" })
		}, wantState: provisionerv1.InstanceState_INSTANCE_STATE_STOPPED},
		{name: "another lock is Transient", setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Config["lock"] = "backup" })
		}, wantClass: errclass.Transient},
		{name: "renamed (VMID reused) is NotFound", setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Config["name"] = "someone-else" })
		}, wantClass: errclass.NotFound},
		{name: "unmarked is NotFound", setup: func(e *env, vmid int) {
			e.fake.SetVM(vmid, func(v *pvefake.VM) { v.Config["description"] = "hand-made" })
		}, wantClass: errclass.NotFound},
		{name: "marked for another UID is NotFound", uid: "another-uid", wantClass: errclass.NotFound},
		{name: "destroyed is NotFound", setup: func(e *env, vmid int) {
			if _, err := e.be.Delete(context.Background(), &provisionerv1.DeleteInstanceRequest{ProviderId: providerID(vmid, "proxy-"+uid), ProxyUid: uid}); err != nil {
				panic(err)
			}
		}, wantClass: errclass.NotFound},
		{name: "node not answering is Transient", setup: func(e *env, vmid int) { e.fake.SetNodeDown("pv1-1", 595) }, wantClass: errclass.Transient},
		{name: "VM not running per the agent is Transient", setup: func(e *env, vmid int) {
			e.fake.Inject(pvefake.Fault{Path: "/agent/", Status: 500, Message: fmt.Sprintf("VM %d is not running", vmid)})
		}, wantClass: errclass.Transient},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			in, vmid := e.created(t, uid)
			if tc.setup != nil {
				tc.setup(e, vmid)
			}
			reqUID := uid
			if tc.uid != "" {
				reqUID = tc.uid
			}
			got, err := e.be.Get(ctxT(t), &provisionerv1.GetInstanceRequest{Provider: "pve", ProviderId: in.GetProviderId(), ProxyUid: reqUID})
			if tc.wantClass != 0 {
				if errclass.Of(err) != tc.wantClass {
					t.Fatalf("err = %v (%v), want %v", err, errclass.Of(err), tc.wantClass)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.GetState() != tc.wantState || (got.GetIp() != "") != tc.wantIP {
				t.Errorf("state %v ip %q, want %v (ip %v)", got.GetState(), got.GetIp(), tc.wantState, tc.wantIP)
			}
			if got.GetProxyUid() != uid || got.GetCreateTime() == nil || got.GetDetails()["node"] != "pv1-1" {
				t.Errorf("instance = %v", got)
			}
		})
	}
}

func TestGetMakesFourCalls(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	in, _ := e.created(t, "c0ffee00-0000-4000-8000-000000000001")
	e.fake.ResetCalls()
	got, err := e.be.Get(ctxT(t), &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: in.GetProxyUid()})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(got.GetIp(), "192.168.4.") {
		t.Errorf("ip = %q", got.GetIp())
	}
	if n := e.fake.TotalCalls(); n != 4 {
		t.Errorf("a running Get made %d calls, want 4: %v", n, e.fake.Calls())
	}
}

func TestMalformedProviderIDIsPermanent(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	for _, pid := range []string{"", "vms/x/proxy-a", "vm/100/proxy-a", "vms/100/", "vms/99/proxy-a", "vms/100/proxy-a/extra"} {
		_, err := e.be.Get(ctxT(t), &provisionerv1.GetInstanceRequest{ProviderId: pid})
		if errclass.Of(err) != errclass.Permanent {
			t.Errorf("Get(%q) = %v, want Permanent", pid, err)
		}
		_, err = e.be.Delete(ctxT(t), &provisionerv1.DeleteInstanceRequest{ProviderId: pid})
		if errclass.Of(err) != errclass.Permanent {
			t.Errorf("Delete(%q) = %v, want Permanent", pid, err)
		}
	}
	if e.fake.TotalCalls() != 0 {
		t.Errorf("%d calls for malformed providerIDs", e.fake.TotalCalls())
	}
}

func TestList(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	in1, vmid1 := e.created(t, "aaaaaaaa-0000-4000-8000-000000000001")
	_, vmid2 := e.created(t, "aaaaaaaa-0000-4000-8000-000000000002")
	e.fake.SetVM(vmid2, func(v *pvefake.VM) { v.Status = "stopped" })
	// Not ours: a hand-made VM named like a proxy, and someone else's VM.
	e.fake.AddVM(pvefake.VM{VMID: 150000, Node: "pv1-1", Config: map[string]string{"name": "proxy-handmade", "description": "by hand"}})
	e.fake.AddVM(pvefake.VM{VMID: 200, Node: "pv1-1", Config: map[string]string{"name": "db-1", "tags": "prod"}})
	// A marked VM whose config write never happened (no tag) is still ours.
	e.fake.AddVM(pvefake.VM{VMID: 150001, Node: "pv1-1", Config: map[string]string{"name": "proxy-half", "description": markLines("half-uid", "", time.Unix(1700000000, 0))}})
	got, err := e.be.List(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	byID := map[string]*provisionerv1.Instance{}
	for _, in := range got {
		byID[in.GetProviderId()] = in
	}
	if len(got) != 3 {
		t.Fatalf("listed %d, want 3: %v", len(got), got)
	}
	// RUNNING carries the address, and the create time is the one Create
	// answered (both from the mark).
	one := byID[in1.GetProviderId()]
	if one == nil || one.GetProxyUid() != "aaaaaaaa-0000-4000-8000-000000000001" || one.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_RUNNING ||
		one.GetIp() == "" || !one.GetCreateTime().AsTime().Equal(in1.GetCreateTime().AsTime()) {
		t.Errorf("first = %v, created by %v", one, in1)
	}
	two := byID[providerID(vmid2, "proxy-aaaaaaaa-0000-4000-8000-000000000002")]
	if two == nil || two.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_STOPPED {
		t.Errorf("second = %v", two)
	}
	half := byID["vms/150001/proxy-half"]
	if half == nil || half.GetProxyUid() != "half-uid" || half.GetCreateTime().AsTime().Unix() != 1700000000 {
		t.Errorf("half-made = %v", half)
	}
	// A running VM whose agent gives no address yet is still provisioning.
	e.fake.SetAgent(vmid1, pvefake.AgentNotRunning)
	got, err = e.be.List(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range got {
		if in.GetProviderId() == in1.GetProviderId() && (in.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING || in.GetIp() != "") {
			t.Errorf("without an agent answer = %v, want PROVISIONING without an address", in)
		}
	}
	_ = vmid1
}
