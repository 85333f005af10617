package proxmox

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/services/provisioner-proxmox/internal/pvefake"
)

// logLines returns the JSON log lines with the message msg.
func (e *env) logLines(t *testing.T, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(e.logs.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil && m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

func seedVolume(uid string) string { return "iso/proxy-" + uid + "-seed.iso" }

// twoNodes is an env with pv1-1 and pv1-2, and a proxy created on pv1-1
// whose VM was then destroyed outside the system; its seed is on both
// nodes (a non-shared storage after a migration).
func twoNodes(t *testing.T, uid string) (*env, *provisionerv1.Instance) {
	t.Helper()
	nodes := []string{"pv1-1", "pv1-2"}
	e := newEnv(t, func(c *Config) { c.Nodes = nodes }, func(o *pvefake.Options) { o.Nodes = nodes })
	req := createReq(uid)
	req.Placement.Zone = "pv1-1"
	in, err := e.be.Create(ctxT(t), req)
	if err != nil {
		t.Fatal(err)
	}
	vmid, _, _ := parseProviderID(in.GetProviderId())
	e.fake.RemoveVM(vmid)
	e.fake.PutFile("pv1-2", "proxy-seeds", seedVolume(uid), []byte("seed"))
	return e, in
}

// A VM already gone and a node that does not answer: the seed is deleted
// where it can be, the node is logged at WARN and skipped, and Delete
// succeeds; once the node answers again, List's sweep deletes the seed
// left there, logged at INFO.
func TestDeleteOfAGoneVMSkipsANodeThatDoesNotAnswer(t *testing.T) {
	t.Parallel()
	const uid = "5eed0000-0000-4000-8000-000000000001"
	e, in := twoNodes(t, uid)
	e.fake.SetNodeDown("pv1-2", 595)
	deleted, err := e.be.Delete(ctxT(t), &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uid})
	if err != nil || deleted {
		t.Fatalf("Delete = %v, %v; want false, nil", deleted, err)
	}
	if f := e.fake.Files("pv1-1", "proxy-seeds"); len(f) != 0 {
		t.Errorf("seed left on the node that answers: %v", f)
	}
	var warned bool
	for _, l := range e.logLines(t, "WARNING: proxmox seed delete skipped on a node that does not answer; the sweep deletes the seed once it does") {
		warned = warned || (l["level"] == "WARN" && l["node"] == "pv1-2" && l["name"] == "proxy-"+uid)
	}
	if !warned {
		t.Errorf("no WARN naming pv1-2:\n%s", e.logs.String())
	}

	// The node returns: the seed is old enough, its proxy has no VM.
	e.fake.SetNodeDown("pv1-2", 0)
	e.fake.SetFileTime("pv1-2", "proxy-seeds", seedVolume(uid), time.Now().Add(-time.Hour))
	if _, err := e.be.List(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if f := e.fake.Files("pv1-2", "proxy-seeds"); len(f) != 0 {
		t.Errorf("the sweep left the seed on pv1-2: %v", f)
	}
	var logged bool
	for _, l := range e.logLines(t, "proxmox orphaned seed deleted") {
		logged = logged || (l["level"] == "INFO" && l["node"] == "pv1-2" && l["volid"] == "proxy-seeds:"+seedVolume(uid) && l["proxy_uid"] == uid)
	}
	if !logged {
		t.Errorf("no INFO line for the swept seed:\n%s", e.logs.String())
	}
}

// Delete does not skip what is not a node failing: a 403 on any node
// stays Permanent (TestDeleteWithoutDatastoreAllocateIsPermanent), and a
// seed-delete task that fails on a node that answers fails the call.
func TestDeleteOfAGoneVMFailsOnASeedTaskThatFails(t *testing.T) {
	t.Parallel()
	const uid = "5eed0000-0000-4000-8000-000000000002"
	e, in := twoNodes(t, uid)
	e.fake.FailNextTask("imgdel", "unlink '/var/lib/proxy-seeds/template/iso/proxy-"+uid+"-seed.iso' failed - Permission denied")
	_, err := e.be.Delete(ctxT(t), &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uid})
	if err == nil || !strings.Contains(err.Error(), "Permission denied") {
		t.Fatalf("err = %v, want the task's failure", err)
	}
}

// The sweep deletes only seeds named for a proxy UID, old enough, whose
// proxy has no VM and whose VMIDs hide no VM on a node that does not
// answer; a node that fails the listing is skipped.
func TestSweepKeepsSeedsThatMayStillBeInUse(t *testing.T) {
	t.Parallel()
	const (
		live   = "5eed0000-0000-4000-8000-00000000000a" // its VM runs
		young  = "5eed0000-0000-4000-8000-00000000000b" // just written
		orphan = "5eed0000-0000-4000-8000-00000000000c"
		hidden = "5eed0000-0000-4000-8000-00000000000d" // a VM at its VMID is on a node that does not answer
		away   = "5eed0000-0000-4000-8000-00000000000e" // on a node whose storage does not answer
		clone  = "5eed0000-0000-4000-8000-00000000000f" // a clone (no name yet) at its VMID
	)
	nodes := []string{"pv1-1", "pv1-2", "pv1-3"}
	e := newEnv(t, func(c *Config) { c.Nodes = nodes }, func(o *pvefake.Options) { o.Nodes = nodes })
	req := createReq(live)
	req.Placement.Zone = "pv1-1"
	if _, err := e.be.Create(ctxT(t), req); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-time.Hour)
	put := func(node, vol string, at time.Time) {
		e.fake.PutFile(node, "proxy-seeds", vol, []byte("x"))
		e.fake.SetFileTime(node, "proxy-seeds", vol, at)
	}
	put("pv1-2", seedVolume(live), old) // left on another node by a migration
	e.fake.SetFileTime("pv1-1", "proxy-seeds", seedVolume(live), old)
	put("pv1-1", seedVolume(young), time.Now())
	put("pv1-1", seedVolume(orphan), old)
	put("pv1-1", seedVolume(hidden), old)
	put("pv1-1", "iso/proxy-handmade-seed.iso", old)
	put("pv1-1", "iso/debian-13.iso", old)
	put("pv1-2", seedVolume(away), old)
	put("pv1-1", seedVolume(clone), old)
	e.fake.AddVM(pvefake.VM{VMID: vmidFor(clone, e.be.cfg.VMIDRange, 0), Node: "pv1-1", Status: "stopped", Config: map[string]string{"lock": "clone"}})
	e.fake.AddVM(pvefake.VM{VMID: vmidFor(hidden, e.be.cfg.VMIDRange, 1), Node: "pv1-3", Status: "running", Config: map[string]string{"name": "proxy-" + hidden}})
	e.fake.SetNodeDown("pv1-3", 595)
	e.fake.Inject(pvefake.Fault{Method: "GET", Path: "/nodes/pv1-2/storage/proxy-seeds/content", Status: 500, Message: "storage 'proxy-seeds' is not online", Times: 1})

	if _, err := e.be.List(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{
		"pv1-1": {"iso/debian-13.iso", "iso/proxy-handmade-seed.iso", seedVolume(live), seedVolume(young), seedVolume(hidden), seedVolume(clone)},
		"pv1-2": {seedVolume(live), seedVolume(away)},
	}
	for node, vols := range want {
		got := strings.Join(e.fake.Files(node, "proxy-seeds"), " ")
		for _, v := range vols {
			if !strings.Contains(got, v) {
				t.Errorf("%s: %s was deleted (left: %s)", node, v, got)
			}
		}
	}
	if strings.Contains(strings.Join(e.fake.Files("pv1-1", "proxy-seeds"), " "), seedVolume(orphan)) {
		t.Error("the orphaned seed was kept")
	}
	// The storage answers again: the seed there goes too.
	if _, err := e.be.List(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(strings.Join(e.fake.Files("pv1-2", "proxy-seeds"), " "), seedVolume(away)) {
		t.Error("the seed on the storage that answers again was kept")
	}
}
