package proxmox

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// Delete stops (a paused VM too) and destroys the VM with its disks, then
// deletes its NoCloud seed ISO on the VM's node; an ISO that could not be
// deleted there fails the call, on a repeated Delete too. Another
// installation's VM is left alone with its ISO. A VM already gone, not
// ours or unmarked is left alone too, and the proxy's ISO is looked for on
// every node (deleteSeedEverywhere: a node that does not answer is
// skipped and its ISO left to List's sweep).
func (be *Backend) Delete(ctx context.Context, req *provisionerv1.DeleteInstanceRequest) (bool, error) {
	_, name, err := parseProviderID(req.GetProviderId())
	if err != nil {
		return false, err
	}
	loc, gone, err := be.locate(ctx, req.GetProviderId(), req.GetProxyUid(), req.GetInstallation())
	if err != nil {
		return false, classify(err)
	}
	if gone != nil && gone.otherInstallation {
		be.log.DebugContext(ctx, "proxmox vm is another installation's, left alone", "provider_id", req.GetProviderId(), "reason", gone.reason)
		return false, nil
	}
	if gone != nil {
		be.log.DebugContext(ctx, "proxmox vm already gone", "provider_id", req.GetProviderId(), "reason", gone.reason)
		if err := be.deleteSeedEverywhere(ctx, name); err != nil {
			return false, err
		}
		be.log.DebugContext(ctx, "proxmox vm deleted", "provider_id", req.GetProviderId(), "destroyed", false)
		return false, nil
	}
	log := be.log.With("vmid", loc.vmid, "name", loc.name, "node", loc.node)
	if lock := loc.cfg["lock"]; lock == "suspended" {
		return false, errclass.New(errclass.Permanent, "VM %d (%s) is hibernated (lock: suspended); resume or destroy it in Proxmox", loc.vmid, loc.name).
			WithMetadata("vmid", strconv.Itoa(loc.vmid), "node", loc.node)
	} else if lock != "" {
		return false, errclass.New(errclass.Transient, "VM %d is locked (%s)", loc.vmid, lock).WithMetadata("vmid", strconv.Itoa(loc.vmid), "lock", lock)
	}
	st, err := be.status(ctx, loc.node, loc.vmid)
	if err != nil {
		return false, be.deleteClass(err)
	}
	if st.Status != "stopped" {
		err := be.task(ctx, call{name: "Stop", method: http.MethodPost, path: vmPath(loc.node, loc.vmid) + "/status/stop", attrs: []any{"node", loc.node, "vmid", loc.vmid}}, loc.node, be.b.Stop)
		if err != nil {
			return false, be.deleteClass(err)
		}
	}
	err = be.task(ctx, call{name: "Destroy", method: http.MethodDelete, path: vmPath(loc.node, loc.vmid),
		form: url.Values{"purge": {"1"}, "destroy-unreferenced-disks": {"1"}}, attrs: []any{"node", loc.node, "vmid", loc.vmid}}, loc.node, be.b.Destroy)
	if err != nil {
		return false, be.deleteClass(err)
	}
	if err := be.deleteSeed(ctx, loc.node, name); err != nil {
		return false, classify(err)
	}
	log.DebugContext(ctx, "proxmox vm deleted", "destroyed", true)
	return true, nil
}

// deleteClass classifies a failure during Delete; a VM that vanished
// meanwhile is not an error for the caller to retry forever, but the next
// attempt finds it gone, so it stays Transient here.
func (be *Backend) deleteClass(err error) error {
	err = classify(err)
	if errclass.Is(err, errclass.NotFound) {
		return errclass.Wrap(errclass.Transient, err)
	}
	return err
}

// deleteSeed deletes <name>-seed.iso on node's isoStorage. A seed that is
// not there is done; a 403 (no Datastore.Allocate) is Permanent.
func (be *Backend) deleteSeed(ctx context.Context, node, name string) error {
	_, err := be.deleteSeedOn(ctx, node, name)
	return err
}

// deleteSeedOn is deleteSeed, also reporting a seed that was not there.
func (be *Backend) deleteSeedOn(ctx context.Context, node, name string) (absent bool, err error) {
	volid := be.cfg.ISOStorage + ":iso/" + name + "-seed.iso"
	err = be.task(ctx, call{name: "DeleteVolume", method: http.MethodDelete,
		path:  "/nodes/" + url.PathEscape(node) + "/storage/" + url.PathEscape(be.cfg.ISOStorage) + "/content/" + url.PathEscape(volid),
		attrs: []any{"node", node, "storage", be.cfg.ISOStorage, "volid", volid}}, node, be.b.SeedDelete)
	var te *TaskError
	if errors.As(err, &te) && !te.TimedOut && seedAbsent(te.ExitStatus) {
		return true, nil
	}
	if err != nil && apiStatus(err) == 500 && seedAbsent(apiMessage(err)) {
		return true, nil
	}
	return false, err
}

func seedAbsent(msg string) bool {
	return strings.Contains(msg, "No such file or directory") || strings.Contains(msg, "does not exist")
}

// deleteSeedEverywhere looks for the seed on every configured node, for a
// VM already gone. A node that does not answer is logged and skipped: a
// node down for good must not block the deletion, and List's sweep deletes
// the seed left there once the node answers. Any other failure (a 403 for
// a missing Datastore.Allocate, a task that fails on a node that answers)
// is returned, classified, after every node was tried.
func (be *Backend) deleteSeedEverywhere(ctx context.Context, name string) error {
	var first error
	for _, n := range be.cfg.Nodes {
		err := be.deleteSeed(ctx, n, name)
		if err == nil {
			continue
		}
		if ctx.Err() == nil && nodeUnanswered(err) {
			be.log.WarnContext(ctx, "WARNING: proxmox seed delete skipped on a node that does not answer; the sweep deletes the seed once it does", "node", n, "name", name, "error", err.Error())
			continue
		}
		err = be.deleteClass(err)
		be.log.WarnContext(ctx, "WARNING: proxmox seed delete failed on a node; the proxy's seed may be left there", "node", n, "name", name, "class", errclass.Of(err).String(), "error", err.Error())
		if first == nil {
			first = err
		}
	}
	return first
}

// nodeUnanswered reports a request or task the node did not answer: a
// transport failure or timeout, a 5xx (pveproxy's 595/596 for a node it
// cannot reach included), or a task that did not end within its budget.
func nodeUnanswered(err error) bool {
	var te *TaskError
	if errors.As(err, &te) {
		return te.TimedOut
	}
	var tr *transportError
	return errors.As(err, &tr) || isTimeout(err) || apiStatus(err) >= 500
}
