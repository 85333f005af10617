package proxmox

import (
	"context"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"

	"google.golang.org/protobuf/types/known/timestamppb"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// located is a VM found at a providerID, verified to be ours.
type located struct {
	vmid     int
	name     string
	node     string
	resource resource
	cfg      map[string]string
	mark     mark
}

// errNotOurs explains why a providerID no longer names the proxy's VM.
type notOurs struct {
	reason string
	// otherInstallation: the VM is another installation's, and so is its
	// seed.
	otherInstallation bool
}

// locate finds the VM of a providerID: in the cluster's resources, then
// its config, checking the name and the mark. A nil located with a reason
// means it is gone or not the proxy's.
func (be *Backend) locate(ctx context.Context, pid, uid, installation string) (*located, *notOurs, error) {
	vmid, name, err := parseProviderID(pid)
	if err != nil {
		return nil, nil, err
	}
	res, err := be.resources(ctx)
	if err != nil {
		return nil, nil, err
	}
	var r *resource
	for i := range res {
		if res[i].VMID == vmid {
			r = &res[i]
		}
	}
	if r == nil {
		return nil, &notOurs{reason: "VMID absent from the cluster's resources"}, nil
	}
	if r.Status == "unknown" {
		return nil, nil, errclass.New(errclass.Transient, "VM %d is on node %s, which does not answer (status unknown)", vmid, r.Node).WithMetadata("vmid", strconv.Itoa(vmid), "node", r.Node)
	}
	cfg, err := be.config(ctx, r.Node, vmid)
	if err != nil {
		if errclass.Is(classify(err), errclass.NotFound) {
			return nil, &notOurs{reason: "configuration file does not exist"}, nil
		}
		return nil, nil, err
	}
	if cfg["name"] != name {
		be.log.DebugContext(ctx, "proxmox vm at this vmid is not ours, left alone", "vmid", vmid, "node", r.Node, "name", name, "vmName", cfg["name"])
		return nil, &notOurs{reason: "the VM at this VMID is named " + cfg["name"]}, nil
	}
	m := parseMark(cfg["description"])
	if !m.managed {
		be.log.DebugContext(ctx, "proxmox vm carries no proxy-operator mark, left alone", "vmid", vmid, "node", r.Node, "name", name)
		return nil, &notOurs{reason: "the VM carries no proxy-operator mark"}, nil
	}
	if uid != "" && m.uid != "" && m.uid != uid {
		return nil, &notOurs{reason: "the VM is marked for proxy UID " + m.uid}, nil
	}
	if m.foreignInstallation(installation) {
		return nil, &notOurs{reason: "the VM is marked for installation " + m.installation, otherInstallation: true}, nil
	}
	return &located{vmid: vmid, name: name, node: r.Node, resource: *r, cfg: cfg, mark: m}, nil, nil
}

// Get reads the VM's state and address: four calls for a running VM
// (resources, config, status, agent).
func (be *Backend) Get(ctx context.Context, req *provisionerv1.GetInstanceRequest) (*provisionerv1.Instance, error) {
	loc, gone, err := be.locate(ctx, req.GetProviderId(), req.GetProxyUid(), req.GetInstallation())
	if err != nil {
		return nil, classify(err)
	}
	if gone != nil {
		be.log.DebugContext(ctx, "proxmox vm not found", "provider_id", req.GetProviderId(), "reason", gone.reason)
		return nil, errclass.New(errclass.NotFound, "%s: %s", req.GetProviderId(), gone.reason)
	}
	if err := be.claim(ctx, loc.node, loc.vmid, loc.cfg, req.GetProxyUid(), req.GetInstallation()); err != nil {
		return nil, err
	}
	log := be.log.With("vmid", loc.vmid, "name", loc.name, "node", loc.node)
	in := &provisionerv1.Instance{
		ProviderId: providerID(loc.vmid, loc.name), ProxyUid: loc.mark.uid, Name: loc.name,
		Details: map[string]string{"node": loc.node, "vmid": strconv.Itoa(loc.vmid)},
	}
	if !loc.mark.createdAt.IsZero() {
		in.CreateTime = timestamppb.New(loc.mark.createdAt)
	}
	if lock := loc.cfg["lock"]; lock != "" {
		if lock == "suspended" {
			in.State = provisionerv1.InstanceState_INSTANCE_STATE_STOPPED
			in.Details["lock"] = lock
			log.DebugContext(ctx, "proxmox vm fetched", "state", in.State.String(), "proxy_uid", loc.mark.uid, "lock", lock)
			return in, nil
		}
		return nil, errclass.New(errclass.Transient, "VM %d is locked (%s)", loc.vmid, lock).WithMetadata("vmid", strconv.Itoa(loc.vmid), "lock", lock)
	}
	st, err := be.status(ctx, loc.node, loc.vmid)
	if err != nil {
		err = classify(err)
		if errclass.Is(err, errclass.NotFound) {
			return nil, errclass.New(errclass.NotFound, "%s: %v", req.GetProviderId(), err)
		}
		return nil, err
	}
	in.Details["status"], in.Details["qmpstatus"] = st.Status, st.QMP
	switch {
	case st.Status != "running":
		in.State = provisionerv1.InstanceState_INSTANCE_STATE_STOPPED
	case st.QMP == "paused" || st.QMP == "suspended":
		in.State = provisionerv1.InstanceState_INSTANCE_STATE_STOPPED
	case st.QMP == "prelaunch" || st.QMP == "inmigrate":
		in.State = provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING
	default:
		ip, state, err := be.agentIP(ctx, loc.node, loc.vmid)
		if err != nil {
			return nil, err
		}
		in.Ip, in.State = ip, state
	}
	log.DebugContext(ctx, "proxmox vm fetched", "state", in.GetState().String(), "ip", in.GetIp(), "proxy_uid", loc.mark.uid, "status", st.Status, "qmpstatus", st.QMP)
	return in, nil
}

// claim writes installation into the mark of the proxy uid's VM when the
// mark names none (written before marks named installations), so that it
// is this installation's from now on. Any other mark is left as it is.
func (be *Backend) claim(ctx context.Context, node string, vmid int, cfg map[string]string, uid, installation string) error {
	m := parseMark(cfg["description"])
	if !m.managed || m.installation != "" || installation == "" || m.uid != uid {
		return nil
	}
	desc := strings.TrimRight(cfg["description"], "\n") + "\n" + markInstallation + "=" + installation + "\n"
	form := url.Values{"description": {desc}}
	err := be.c.do(ctx, call{name: "SetConfig", method: http.MethodPut, path: vmPath(node, vmid) + "/config", form: form,
		attrs: []any{"node", node, "vmid", vmid}, trace: []any{"description", desc}}, nil)
	if err != nil {
		return notFoundAsTransient(err)
	}
	cfg["description"] = desc
	be.log.InfoContext(ctx, "proxmox vm marked before installations claimed for this installation", "vmid", vmid, "node", node, "proxy_uid", uid, "installation", installation)
	return nil
}

// agentIP asks the guest agent for the VM's address. The agent's two
// answers that mean booting or unconfigured become states, not errors.
func (be *Backend) agentIP(ctx context.Context, node string, vmid int) (string, provisionerv1.InstanceState, error) {
	var out struct {
		Result []struct {
			Name        string `json:"name"`
			IPAddresses []struct {
				IP   string `json:"ip-address"`
				Type string `json:"ip-address-type"`
			} `json:"ip-addresses"`
		} `json:"result"`
	}
	err := be.c.do(ctx, call{name: "AgentInterfaces", method: http.MethodGet, path: vmPath(node, vmid) + "/agent/network-get-interfaces", attrs: []any{"node", node, "vmid", vmid}}, &out)
	if err != nil {
		msg := apiMessage(err)
		switch {
		case strings.Contains(msg, "QEMU guest agent is not running"):
			return "", provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING, nil
		case strings.Contains(msg, "No QEMU guest agent configured"):
			return "", provisionerv1.InstanceState_INSTANCE_STATE_STOPPED, nil
		}
		err = classify(err)
		if errclass.Is(err, errclass.NotFound) || apiStatus(err) == 500 {
			// `VM <n> is not running` and the like: Get cannot place it.
			return "", 0, errclass.Wrap(errclass.Transient, err)
		}
		return "", 0, err
	}
	var addrs []string
	for _, iface := range out.Result {
		if iface.Name == "lo" {
			continue
		}
		for _, a := range iface.IPAddresses {
			ip := net.ParseIP(a.IP)
			if a.Type != "ipv4" || ip == nil || ip.IsLoopback() || ip.IsLinkLocalUnicast() {
				continue
			}
			addrs = append(addrs, a.IP)
		}
	}
	be.log.Log(ctx, LevelTrace, "proxmox guest agent answered", "vmid", vmid, "node", node, "addresses", addrs)
	if len(addrs) == 0 {
		return "", provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING, nil
	}
	return addrs[0], provisionerv1.InstanceState_INSTANCE_STATE_RUNNING, nil
}

// List returns every VM carrying the mark, for orphan GC. Candidates are
// VMs tagged proxy_operator or named proxy-*; the mark decides. A running
// VM's address comes from its guest agent, one more call each. It then
// sweeps the seeds of proxies without a VM (sweepSeeds), which the
// contract's instances do not cover.
func (be *Backend) List(ctx context.Context) ([]*provisionerv1.Instance, error) {
	res, err := be.resources(ctx)
	if err != nil {
		return nil, classify(err)
	}
	var cands []resource
	for _, r := range res {
		if r.Template {
			continue
		}
		if strings.HasPrefix(r.Name, namePrefix) || hasTag(r.Tags, tag) {
			cands = append(cands, r)
		}
	}
	var (
		mu      sync.Mutex
		out     []*provisionerv1.Instance
		skipped int
		wg      sync.WaitGroup
		sem     = make(chan struct{}, 4)
	)
	for _, r := range cands {
		if r.Status == "unknown" {
			be.log.DebugContext(ctx, "skipping unreadable proxmox vm", "vmid", r.VMID, "node", r.Node, "reason", "node does not answer")
			skipped++
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			cfg, err := be.config(ctx, r.Node, r.VMID)
			var ip string
			state := stateOf(r.Status)
			if err == nil && state == provisionerv1.InstanceState_INSTANCE_STATE_RUNNING && parseMark(cfg["description"]).managed {
				// RUNNING means running with an address: ask the guest
				// agent, as Get does. Without an answer the VM is listed
				// as still provisioning rather than left out.
				var aerr error
				if ip, state, aerr = be.agentIP(ctx, r.Node, r.VMID); aerr != nil {
					be.log.DebugContext(ctx, "proxmox guest agent gave no address for a listed vm", "vmid", r.VMID, "node", r.Node, "error", aerr.Error())
					ip, state = "", provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				be.log.DebugContext(ctx, "skipping unreadable proxmox vm", "vmid", r.VMID, "node", r.Node, "error", err.Error())
				skipped++
				return
			}
			m := parseMark(cfg["description"])
			if !m.managed {
				return
			}
			in := &provisionerv1.Instance{
				ProviderId: providerID(r.VMID, cfg["name"]), ProxyUid: m.uid, Name: cfg["name"],
				State: state, Ip: ip, Installation: m.installation,
				Details: map[string]string{"node": r.Node, "vmid": strconv.Itoa(r.VMID), "status": r.Status},
			}
			if !m.createdAt.IsZero() {
				in.CreateTime = timestamppb.New(m.createdAt)
			}
			be.log.Log(ctx, LevelTrace, "proxmox listed instance", "vmid", r.VMID, "node", r.Node, "name", cfg["name"], "proxy_uid", m.uid)
			out = append(out, in)
		}()
	}
	wg.Wait()
	be.log.DebugContext(ctx, "proxmox vms listed", "vms", len(res), "candidates", len(cands), "managed", len(out), "skipped", skipped)
	be.sweepSeeds(ctx)
	return out, nil
}

func stateOf(status string) provisionerv1.InstanceState {
	switch status {
	case "running":
		return provisionerv1.InstanceState_INSTANCE_STATE_RUNNING
	case "stopped":
		return provisionerv1.InstanceState_INSTANCE_STATE_STOPPED
	}
	return provisionerv1.InstanceState_INSTANCE_STATE_UNSPECIFIED
}

func hasTag(tags, t string) bool {
	for _, x := range strings.FieldsFunc(tags, func(r rune) bool { return r == ';' || r == ',' || r == ' ' }) {
		if x == t {
			return true
		}
	}
	return false
}
