package gcp

import (
	"context"

	"cloud.google.com/go/compute/apiv1/computepb"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// Delete deletes the instance (its boot disk goes with it: autoDelete) and
// watches the delete operation for at most operationWaitSeconds. An
// instance already gone (404 on read or on delete) is success; one whose
// labels are not the proxy's is left alone. When the operation outlives
// the wait, Delete still succeeds: Compute has accepted it, and the
// orchestrator reads the instance until Get answers NotFound.
func (be *Backend) Delete(ctx context.Context, req *provisionerv1.DeleteInstanceRequest) (bool, error) {
	zone, name, err := parseProviderID(req.GetProviderId())
	if err != nil {
		return false, err
	}
	c, err := be.client(ctx)
	if err != nil {
		return false, err
	}
	log := be.log.With("name", name, "zone", zone)
	inst, err := be.getInstance(ctx, c, zone, name)
	if errclass.Is(err, errclass.NotFound) {
		log.DebugContext(ctx, "gcp instance already gone")
		return false, nil
	}
	if err != nil {
		return false, err
	}
	m := markOf(inst.GetLabels())
	if !m.managed || m.foreignInstallation(req.GetInstallation()) || (req.GetProxyUid() != "" && !m.ours(req.GetProxyUid(), req.GetInstallation())) {
		log.InfoContext(ctx, "gcp instance is not the proxy's; left alone", "managed", m.managed, "labelUID", m.uid, "labelInstallation", m.installation)
		return false, nil
	}
	cctx, cancel := be.call(ctx)
	op, err := c.instances.Delete(cctx, &computepb.DeleteInstanceRequest{Project: be.cfg.Project, Zone: zone, Instance: name})
	cancel()
	if err != nil {
		err = classify(err)
		if errclass.Is(err, errclass.NotFound) {
			log.DebugContext(ctx, "gcp instance vanished before the delete")
			return false, nil
		}
		return false, err
	}
	if err := be.watch(ctx, op); err != nil {
		err = classify(err)
		if errclass.Is(err, errclass.NotFound) {
			return false, nil
		}
		return false, err
	}
	log.DebugContext(ctx, "gcp instance delete", "operation", op.Name(), "status", op.Proto().GetStatus().String())
	return true, nil
}
