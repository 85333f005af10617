package proxmox

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/nocloud"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/crashpoint"
)

// resolved is a placement resolved against the catalogue.
type resolved struct {
	node        string
	machineType string
	mt          MachineType
	image       string
	template    int
}

// placement checks the three catalogue fields before any request.
func (be *Backend) placement(p *proxyv1.Placement) (resolved, error) {
	var r resolved
	node, err := be.node(p.GetZone())
	if err != nil {
		return r, err
	}
	mt, ok := be.cfg.MachineTypes[p.GetMachineType()]
	if !ok {
		return r, errclass.New(errclass.Permanent, "placement.machineType %q is not in proxmox.machineTypes", p.GetMachineType())
	}
	t, ok := be.cfg.Templates[p.GetImage()]
	if !ok {
		return r, errclass.New(errclass.Permanent, "placement.image %q is not in proxmox.templates", p.GetImage())
	}
	return resolved{node: node, machineType: p.GetMachineType(), mt: mt, image: p.GetImage(), template: t.VMID}, nil
}

func (be *Backend) node(zone string) (string, error) {
	if zone == "" {
		if len(be.cfg.Nodes) == 1 {
			return be.cfg.Nodes[0], nil
		}
		return "", errclass.New(errclass.Permanent, "placement.zone is required when proxmox.nodes lists more than one node")
	}
	for _, n := range be.cfg.Nodes {
		if n == zone {
			return n, nil
		}
	}
	return "", errclass.New(errclass.Permanent, "placement.zone %q is not in proxmox.nodes", zone)
}

// verdict is the ownership check's answer about a VM.
type verdict int

const (
	vmOther verdict = iota // someone else's: probe on
	vmOurs                 // ours: adopt
	vmGone                 // vanished while we looked (a failed clone)
)

// inspect is the ownership check of the VM at vmid: wait out a lock, then
// tell ours (adopt) from another's (probe on), refusing a VM that has our
// name but not our mark.
func (be *Backend) inspect(ctx context.Context, vmid int, node, name, uid, installation string) (verdict, map[string]string, error) {
	deadline := time.Now().Add(be.b.Clone)
	for {
		cfg, err := be.config(ctx, node, vmid)
		if err != nil {
			if errclass.Is(classify(err), errclass.NotFound) {
				return vmGone, nil, nil
			}
			return 0, nil, notFoundAsTransient(err)
		}
		lock := cfg["lock"]
		if lock == "suspended" {
			if cfg["name"] != name {
				return vmOther, cfg, nil
			}
			if err := be.checkMark(vmid, name, uid, installation, cfg); err != nil {
				return 0, nil, err
			}
			return 0, nil, errclass.New(errclass.Permanent, "VM %d (%s) is hibernated (lock: suspended); resume or destroy it in Proxmox", vmid, name).WithMetadata("vmid", strconv.Itoa(vmid), "node", node)
		}
		if lock == "" {
			if cfg["name"] != name {
				return vmOther, cfg, nil
			}
			if err := be.checkMark(vmid, name, uid, installation, cfg); err != nil {
				return 0, nil, err
			}
			return vmOurs, cfg, nil
		}
		if time.Now().After(deadline) {
			return 0, nil, errclass.New(errclass.Transient, "VM %d is still locked (%s) after %s; clear it with qm unlock %d or destroy it", vmid, lock, be.b.Clone, vmid).WithMetadata("vmid", strconv.Itoa(vmid), "lock", lock)
		}
		be.log.DebugContext(ctx, "proxmox vm is locked, waiting", "vmid", vmid, "node", node, "lock", lock)
		t := time.NewTimer(be.b.Poll)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return 0, nil, errclass.Wrap(errclass.Transient, ctx.Err())
		}
	}
}

// checkMark refuses a VM with our name that carries no mark, another UID
// or another installation.
func (be *Backend) checkMark(vmid int, name, uid, installation string, cfg map[string]string) error {
	m := parseMark(cfg["description"])
	if !m.managed {
		return errclass.New(errclass.Permanent, "VM %d is named %s but carries no proxy-operator mark (proxy UID %s, VM UID none); it was not created by egress-proxies, remove or rename it", vmid, name, uid).
			WithMetadata("vmid", strconv.Itoa(vmid), "proxyUID", uid)
	}
	if m.uid != "" && m.uid != uid {
		return errclass.New(errclass.Permanent, "VM %d is named %s but is marked for proxy UID %s, not %s; remove or rename it", vmid, name, m.uid, uid).
			WithMetadata("vmid", strconv.Itoa(vmid), "proxyUID", uid, "vmUID", m.uid)
	}
	if m.foreignInstallation(installation) {
		return errclass.New(errclass.Permanent, "VM %d is named %s but is marked for installation %s, not %s; two installations hold proxy UID %s (a copied database?): remove or rename it", vmid, name, m.installation, installation, uid).
			WithMetadata("vmid", strconv.Itoa(vmid), "proxyUID", uid, "installation", installation, "vmInstallation", m.installation)
	}
	return nil
}

// Create clones the template (or adopts what an earlier attempt left),
// uploads the seed, writes the config, grows the disk and starts the VM.
// It returns once the VM runs.
func (be *Backend) Create(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.Instance, error) {
	uid := req.GetProxyUid()
	p, err := be.placement(req.GetPlacement())
	if err != nil {
		return nil, err
	}
	name, err := instanceName(uid)
	if err != nil {
		return nil, err
	}
	log := be.log.With("name", name)
	log.Log(ctx, LevelTrace, "proxmox create resolved", "node", p.node, "machineType", p.machineType, "cores", p.mt.Cores, "memoryMiB", p.mt.MemoryMiB,
		"diskGiB", p.mt.DiskGiB, "template", p.template, "storage", be.cfg.Storage, "isoStorage", be.cfg.ISOStorage,
		"bridge", be.cfg.Bridge, "vlanTag", be.cfg.VLANTag, "cloudInitBytes", len(req.GetCloudInit()))

	res, err := be.resources(ctx)
	if err != nil {
		return nil, notFoundAsTransient(err)
	}
	byID := map[int]resource{}
	var named []resource
	for _, r := range res {
		byID[r.VMID] = r
		if r.Name == name && !r.Template {
			named = append(named, r)
		}
	}
	if len(named) > 1 {
		ids := make([]string, len(named))
		for i, r := range named {
			ids[i] = strconv.Itoa(r.VMID)
		}
		sort.Strings(ids)
		return nil, errclass.New(errclass.Permanent, "%d VMs are named %s: VMIDs %s; remove all but one", len(named), name, strings.Join(ids, ", ")).
			WithMetadata("vmids", strings.Join(ids, ","))
	}

	vmid, node := 0, ""
	var cfg map[string]string
	var created time.Time // the mark's time, of a VM this call cloned
	if len(named) == 1 {
		r := named[0]
		if r.Status == "unknown" {
			return nil, errclass.New(errclass.Transient, "VM %d is on node %s, which does not answer (status unknown)", r.VMID, r.Node)
		}
		v, c, err := be.inspect(ctx, r.VMID, r.Node, name, uid, req.GetInstallation())
		if err != nil {
			return nil, err
		}
		if v == vmOurs {
			vmid, node, cfg = r.VMID, r.Node, c
		}
	}
	if vmid == 0 {
		// A node that does not answer lists its VMs as status unknown,
		// without their names: one of them may be this proxy's VM, and a
		// clone now would make a second one.
		var unseen []resource
		for _, r := range res {
			if r.Status == "unknown" && r.VMID >= be.cfg.VMIDRange.Min && r.VMID <= be.cfg.VMIDRange.Max {
				unseen = append(unseen, r)
			}
		}
		mayClone := func() error {
			if len(unseen) == 0 || be.cfg.CloneWhileNodesUnreachable {
				return nil
			}
			nodes := map[string]bool{}
			for _, r := range unseen {
				nodes[r.Node] = true
			}
			names := make([]string, 0, len(nodes))
			for n := range nodes {
				names = append(names, n)
			}
			sort.Strings(names)
			return errclass.New(errclass.Transient, "no VM of %s found, but %d VMs in vmidRange are on nodes that do not answer (%s) and may hide it; not cloning until they answer (proxmox.cloneWhileNodesUnreachable: true clones anyway)",
				name, len(unseen), strings.Join(names, ", ")).WithMetadata("nodes", strings.Join(names, ","))
		}
		for probe := 0; probe < maxProbes && vmid == 0; probe++ {
			cand := vmidFor(uid, be.cfg.VMIDRange, probe)
			r, taken := byID[cand]
			if !taken {
				if err := mayClone(); err != nil {
					return nil, err
				}
				if created, err = be.cloneInto(ctx, p, cand, name, uid, req.GetInstallation()); err != nil {
					return nil, err
				}
				vmid, node = cand, p.node
				break
			}
			if r.Status == "unknown" {
				return nil, errclass.New(errclass.Transient, "VMID %d is on node %s, which does not answer (status unknown)", cand, r.Node)
			}
			v, c, err := be.inspect(ctx, cand, r.Node, name, uid, req.GetInstallation())
			if err != nil {
				return nil, err
			}
			switch v {
			case vmOurs:
				vmid, node, cfg = cand, r.Node, c
			case vmGone:
				if err := mayClone(); err != nil {
					return nil, err
				}
				if created, err = be.cloneInto(ctx, p, cand, name, uid, req.GetInstallation()); err != nil {
					return nil, err
				}
				vmid, node = cand, p.node
			default:
				log.DebugContext(ctx, "proxmox vmid taken by another vm, probing on", "vmid", cand, "vmName", c["name"])
			}
		}
		if vmid == 0 {
			return nil, errclass.New(errclass.Transient, "no free VMID for %s in %d-%d after %d probes", name, be.cfg.VMIDRange.Min, be.cfg.VMIDRange.Max, maxProbes)
		}
	}
	log = log.With("vmid", vmid, "node", node)

	st, err := be.status(ctx, node, vmid)
	if err != nil {
		return nil, notFoundAsTransient(err)
	}
	if cfg != nil {
		log.DebugContext(ctx, "proxmox vm adopted", "status", st.Status, "qmpstatus", st.QMP)
		if err := be.claim(ctx, node, vmid, cfg, uid, req.GetInstallation()); err != nil {
			return nil, err
		}
	}
	if cfg != nil {
		created = parseMark(cfg["description"]).createdAt
	}
	inst := be.instance(vmid, name, node, uid, created)
	if st.Status == "running" {
		log.DebugContext(ctx, "proxmox vm ensured running")
		return inst, nil
	}

	// The seed, rebuilt and uploaded on every attempt: an upload overwrites.
	seedName := name + "-seed.iso"
	iso, err := nocloud.BuildSeedISO(nocloud.Seed{
		InstanceID: name, Hostname: name, UserData: []byte(req.GetCloudInit()),
		InstallGuestAgent: *be.cfg.InstallGuestAgent, VendorData: []byte(be.cfg.VendorData),
		ProxyUser: req.GetCredentials().GetUsername(), ProxyPassword: req.GetCredentials().GetPassword(),
	})
	if err != nil {
		return nil, errclass.Wrap(errclass.Transient, err)
	}
	upid, err := be.c.upload(ctx, node, be.cfg.ISOStorage, seedName, iso)
	if err != nil {
		return nil, notFoundAsTransient(err)
	}
	if err := be.waitTask(ctx, node, upid, be.b.Upload); err != nil {
		return nil, notFoundAsTransient(err)
	}
	crashpoint.After(ctx, "proxmox.seed-uploaded")

	if cfg == nil {
		if cfg, err = be.config(ctx, node, vmid); err != nil {
			return nil, notFoundAsTransient(err)
		}
	}
	form := be.configWrite(cfg, seedName, p.mt)
	err = be.c.do(ctx, call{name: "SetConfig", method: http.MethodPut, path: vmPath(node, vmid) + "/config", form: form,
		attrs: []any{"node", node, "vmid", vmid}, trace: []any{"params", form.Encode()}}, nil)
	if err != nil {
		return nil, notFoundAsTransient(err)
	}
	crashpoint.After(ctx, "proxmox.configured")

	if p.mt.DiskGiB > 0 {
		slot, size, ok := bootDisk(cfg)
		if !ok {
			return nil, errclass.New(errclass.Permanent, "VM %d has no boot disk with a readable size=, needed for diskGiB", vmid)
		}
		if float64(p.mt.DiskGiB) > size {
			sz := fmt.Sprintf("%dG", p.mt.DiskGiB)
			err := be.task(ctx, call{name: "Resize", method: http.MethodPut, path: vmPath(node, vmid) + "/resize",
				form: url.Values{"disk": {slot}, "size": {sz}}, attrs: []any{"node", node, "vmid", vmid}, trace: []any{"disk", slot, "size", sz}}, node, be.b.Resize)
			if err != nil {
				return nil, notFoundAsTransient(err)
			}
		}
	}

	if err := be.task(ctx, call{name: "Start", method: http.MethodPost, path: vmPath(node, vmid) + "/status/start", attrs: []any{"node", node, "vmid", vmid}}, node, be.b.Start); err != nil {
		return nil, notFoundAsTransient(err)
	}
	crashpoint.After(ctx, "proxmox.started")
	if err := be.waitRunning(ctx, node, vmid); err != nil {
		return nil, err
	}
	log.DebugContext(ctx, "proxmox vm ensured running")
	return inst, nil
}

// cloneInto checks the template and full-clones it to vmid with the mark
// in the description, waiting for the clone task.
func (be *Backend) cloneInto(ctx context.Context, p resolved, vmid int, name, uid, installation string) (time.Time, error) {
	tnode, err := be.checkTemplate(ctx, p)
	if err != nil {
		return time.Time{}, err
	}
	// The mark holds whole seconds; Create answers the time as written, so
	// that it equals what Get and List read back.
	created := be.now().UTC().Truncate(time.Second)
	form := url.Values{
		"newid": {strconv.Itoa(vmid)}, "name": {name}, "full": {"1"},
		"description": {markLines(uid, installation, created)},
	}
	if be.cfg.Storage != "" {
		form.Set("storage", be.cfg.Storage)
	}
	if p.node != tnode {
		form.Set("target", p.node)
	}
	err = be.task(ctx, call{name: "Clone", method: http.MethodPost, path: vmPath(tnode, p.template) + "/clone", form: form,
		attrs: []any{"node", tnode, "vmid", p.template, "newid", vmid, "name", name},
		trace: []any{"description", form.Get("description"), "storage", be.cfg.Storage, "target", form.Get("target")}}, tnode, be.b.Clone)
	if err != nil {
		return time.Time{}, notFoundAsTransient(err)
	}
	crashpoint.After(ctx, "proxmox.cloned")
	return created, nil
}

// checkTemplate refuses a template that is missing, not a template, has a
// cloud-init drive, lacks net0 while bridge/vlanTag is set, or lacks a
// sized boot disk while diskGiB is set. It returns the template's node.
func (be *Backend) checkTemplate(ctx context.Context, p resolved) (string, error) {
	res, err := be.resources(ctx)
	if err != nil {
		return "", notFoundAsTransient(err)
	}
	var tr *resource
	for i := range res {
		if res[i].VMID == p.template {
			tr = &res[i]
		}
	}
	if tr == nil {
		return "", errclass.New(errclass.Permanent, "placement.image %q: template VM %d does not exist", p.image, p.template)
	}
	if tr.Status == "unknown" {
		return "", errclass.New(errclass.Transient, "placement.image %q: template VM %d is on node %s, which does not answer", p.image, p.template, tr.Node)
	}
	cfg, err := be.config(ctx, tr.Node, p.template)
	if err != nil {
		err = classify(err)
		if errclass.Is(err, errclass.NotFound) {
			return "", errclass.New(errclass.Permanent, "placement.image %q: template VM %d does not exist", p.image, p.template)
		}
		return "", err
	}
	if cfg["template"] != "1" {
		return "", errclass.New(errclass.Permanent, "placement.image %q: template VM %d is not a template", p.image, p.template)
	}
	keys := make([]string, 0, len(cfg))
	for k := range cfg {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if isDiskKey(k) && strings.Contains(cfg[k], "cloudinit") {
			return "", errclass.New(errclass.Permanent, "placement.image %q: template VM %d has a Proxmox cloud-init drive on %s (%s); remove it, the provisioner brings its own seed on ide2", p.image, p.template, k, cfg[k])
		}
	}
	if (be.cfg.Bridge != "" || be.cfg.VLANTag != 0) && cfg["net0"] == "" {
		return "", errclass.New(errclass.Permanent, "placement.image %q: template VM %d has no net0, which bridge/vlanTag need", p.image, p.template)
	}
	if p.mt.DiskGiB > 0 {
		if _, _, ok := bootDisk(cfg); !ok {
			return "", errclass.New(errclass.Permanent, "placement.image %q: template VM %d has no boot disk with a readable size=, which machineTypes.%s.diskGiB needs", p.image, p.template, p.machineType)
		}
	}
	return tr.Node, nil
}

// configWrite is the one config write after the clone and the upload.
func (be *Backend) configWrite(cfg map[string]string, seedName string, mt MachineType) url.Values {
	form := url.Values{
		"cores":  {strconv.Itoa(mt.Cores)},
		"memory": {strconv.Itoa(mt.MemoryMiB)},
		"agent":  {"1"},
		"tags":   {tag},
		"ide2":   {be.cfg.ISOStorage + ":iso/" + seedName + ",media=cdrom"},
	}
	if be.cfg.Bridge != "" || be.cfg.VLANTag != 0 {
		net0 := cfg["net0"]
		if be.cfg.Bridge != "" {
			net0 = setOption(net0, "bridge", be.cfg.Bridge)
		}
		if be.cfg.VLANTag != 0 {
			net0 = setOption(net0, "tag", strconv.Itoa(be.cfg.VLANTag))
		}
		form.Set("net0", net0)
	}
	return form
}

// setOption replaces key=... in a property string, or appends it; every
// other option keeps its place.
func setOption(prop, key, value string) string {
	parts := strings.Split(prop, ",")
	for i, p := range parts {
		if k, _, ok := strings.Cut(p, "="); ok && k == key {
			parts[i] = key + "=" + value
			return strings.Join(parts, ",")
		}
	}
	if prop == "" {
		return key + "=" + value
	}
	return prop + "," + key + "=" + value
}

func isDiskKey(k string) bool {
	for _, p := range []string{"scsi", "virtio", "sata", "ide", "efidisk", "tpmstate", "unused"} {
		if rest, ok := strings.CutPrefix(k, p); ok && rest != "" {
			if _, err := strconv.Atoi(rest); err == nil {
				return true
			}
		}
	}
	return false
}

// bootDisk is the first disk in boot: order= that is not a CD-ROM, and its
// size in GiB.
func bootDisk(cfg map[string]string) (string, float64, bool) {
	var order []string
	if o, ok := strings.CutPrefix(cfg["boot"], "order="); ok {
		order = strings.Split(o, ";")
	} else if bd := cfg["bootdisk"]; bd != "" {
		order = []string{bd}
	}
	for _, slot := range order {
		v := cfg[slot]
		if !isDiskKey(slot) || v == "" || strings.Contains(v, "media=cdrom") {
			continue
		}
		size, ok := parseSize(optValue(v, "size"))
		return slot, size, ok
	}
	return "", 0, false
}

// parseSize reads 32G, 512M, 4M, 1T into GiB.
func parseSize(s string) (float64, bool) {
	if s == "" {
		return 0, false
	}
	mult := map[byte]float64{'K': 1.0 / (1 << 20), 'M': 1.0 / 1024, 'G': 1, 'T': 1024}
	unit := s[len(s)-1]
	m, ok := mult[unit]
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseFloat(s[:len(s)-1], 64)
	if err != nil {
		return 0, false
	}
	return n * m, true
}

func optValue(prop, key string) string {
	for _, part := range strings.Split(prop, ",") {
		if k, v, ok := strings.Cut(part, "="); ok && k == key {
			return v
		}
	}
	return ""
}

// waitRunning waits for status running after the start.
func (be *Backend) waitRunning(ctx context.Context, node string, vmid int) error {
	deadline := time.Now().Add(be.b.Running)
	for {
		st, err := be.status(ctx, node, vmid)
		if err != nil {
			return notFoundAsTransient(err)
		}
		switch st.Status {
		case "running":
			return nil
		case "stopped":
			return errclass.New(errclass.Transient, "VM %d stopped right after its start", vmid).WithMetadata("vmid", strconv.Itoa(vmid), "node", node)
		}
		if time.Now().After(deadline) {
			return errclass.New(errclass.Transient, "VM %d is not running %s after its start (status %s)", vmid, be.b.Running, st.Status)
		}
		t := time.NewTimer(be.b.Poll)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return errclass.Wrap(errclass.Transient, ctx.Err())
		}
	}
}

func (be *Backend) instance(vmid int, name, node, uid string, created time.Time) *provisionerv1.Instance {
	in := &provisionerv1.Instance{
		ProviderId: providerID(vmid, name), ProxyUid: uid, Name: name,
		State:   provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING,
		Details: map[string]string{"node": node, "vmid": strconv.Itoa(vmid)},
	}
	// From the mark only, as the contract says: a mark without a time
	// leaves it unset (orphan GC spares such an instance).
	if !created.IsZero() {
		in.CreateTime = timestamppb.New(created)
	}
	return in
}
