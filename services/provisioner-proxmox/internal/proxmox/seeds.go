package proxmox

import (
	"context"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"time"
)

// seedGrace keeps a seed younger than this: the cluster's resources may
// not show yet the VM a Create has just cloned.
const seedGrace = 10 * time.Minute

// seedOfUID matches the seed volume of a proxy UID (a lowercase UUID, for
// which the VM name is proxy-<uid>).
var seedOfUID = regexp.MustCompile(`^iso/proxy-([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})-seed\.iso$`)

type seedFile struct {
	node, volid, uid string
	ctime            time.Time
}

// seedsOn lists the proxy seeds on a node's isoStorage.
func (be *Backend) seedsOn(ctx context.Context, node string) ([]seedFile, error) {
	var raw []map[string]any
	err := be.c.do(ctx, call{name: "StorageContent", method: http.MethodGet,
		path: "/nodes/" + url.PathEscape(node) + "/storage/" + url.PathEscape(be.cfg.ISOStorage) + "/content",
		form: url.Values{"content": {"iso"}}, attrs: []any{"node", node, "storage", be.cfg.ISOStorage}}, &raw)
	if err != nil {
		return nil, err
	}
	var out []seedFile
	for _, it := range raw {
		volid := str(it["volid"])
		vol, ok := strings.CutPrefix(volid, be.cfg.ISOStorage+":")
		if !ok {
			continue
		}
		m := seedOfUID.FindStringSubmatch(vol)
		if m == nil {
			continue
		}
		f := seedFile{node: node, volid: volid, uid: m[1]}
		if ct := num(it["ctime"]); ct > 0 {
			f.ctime = time.Unix(ct, 0)
		}
		out = append(out, f)
	}
	return out, nil
}

// sweepSeeds deletes the seeds of proxies that have no VM: those a Delete
// could not reach on a node that did not answer, those of VMs destroyed
// outside the system, and those a migration left on another node. It
// runs with List, never fails it, and spares a seed that may still be in
// use: one younger than seedGrace or without a ctime, one whose proxy's
// name is on any VM, and one with a VM at any of its proxy's VMIDs on a
// node that does not answer (it may be the proxy's own, unseen) or locked
// (a clone has no name yet). A node that fails is skipped until a later
// sweep.
func (be *Backend) sweepSeeds(ctx context.Context) {
	var cands []seedFile
	for _, n := range be.cfg.Nodes {
		seeds, err := be.seedsOn(ctx, n)
		if err != nil {
			be.log.DebugContext(ctx, "proxmox seeds not listed on a node, skipped", "node", n, "storage", be.cfg.ISOStorage, "error", classify(err).Error())
			continue
		}
		for _, f := range seeds {
			if !f.ctime.IsZero() && be.now().Sub(f.ctime) >= seedGrace {
				cands = append(cands, f)
			}
		}
	}
	for _, f := range cands {
		// Read after the listing and right before each delete: a listed
		// seed was uploaded after its VM's clone ended, and a new clone
		// shows at once (locked), so a VM of its proxy, if any, is here.
		res, err := be.resources(ctx)
		if err != nil {
			be.log.DebugContext(ctx, "proxmox seed sweep stopped: resources not read", "error", classify(err).Error())
			return
		}
		if be.seedMayBeInUse(f.uid, res) {
			continue
		}
		name := namePrefix + f.uid
		absent, err := be.deleteSeedOn(ctx, f.node, name)
		switch {
		case err != nil && nodeUnanswered(err):
			be.log.DebugContext(ctx, "proxmox orphaned seed not deleted on a node that does not answer", "node", f.node, "volid", f.volid, "error", err.Error())
		case err != nil:
			be.log.WarnContext(ctx, "WARNING: proxmox orphaned seed delete failed", "node", f.node, "volid", f.volid, "proxy_uid", f.uid, "error", classify(err).Error())
		case absent:
			be.log.DebugContext(ctx, "proxmox orphaned seed already gone", "node", f.node, "volid", f.volid)
		default:
			be.log.InfoContext(ctx, "proxmox orphaned seed deleted", "node", f.node, "volid", f.volid, "proxy_uid", f.uid, "name", name)
		}
	}
}

func (be *Backend) seedMayBeInUse(uid string, res []resource) bool {
	probes := map[int]bool{}
	for p := 0; p < maxProbes; p++ {
		probes[vmidFor(uid, be.cfg.VMIDRange, p)] = true
	}
	for _, r := range res {
		if r.Name == namePrefix+uid || (probes[r.VMID] && (r.Status == "unknown" || r.Lock != "")) {
			return true
		}
	}
	return false
}
