package gcp

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	compute "cloud.google.com/go/compute/apiv1"
	"cloud.google.com/go/compute/apiv1/computepb"
	"github.com/google/uuid"
	"github.com/googleapis/gax-go/v2"
	"google.golang.org/api/googleapi"
	"google.golang.org/protobuf/proto"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/nocloud"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/crashpoint"
)

// placement is a Create request resolved against the config.
type placement struct {
	zone, machineType, image string
}

func (be *Backend) resolve(req *provisionerv1.CreateInstanceRequest) (placement, error) {
	pl := req.GetPlacement()
	var p placement
	var err error
	if p.zone, err = be.cfg.zoneFor(pl.GetZone()); err != nil {
		return p, errclass.Wrap(errclass.Permanent, err)
	}
	if p.machineType, err = be.cfg.machineTypeFor(pl.GetMachineType()); err != nil {
		return p, errclass.Wrap(errclass.Permanent, err)
	}
	if p.image, err = be.cfg.imageFor(pl.GetImage()); err != nil {
		return p, errclass.Wrap(errclass.Permanent, err)
	}
	if len(req.GetCloudInit()) > maxUserDataBytes {
		return p, errclass.New(errclass.Permanent, "cloud-init is %d bytes; Compute takes at most %d in one metadata value", len(req.GetCloudInit()), maxUserDataBytes)
	}
	return p, nil
}

// buildInsertRequest is the insert of the proxy's instance: its
// deterministic name, the three labels (plus the configured ones) on the
// instance and its boot disk, the cloud-init as user-data byte for byte.
func (be *Backend) buildInsertRequest(req *provisionerv1.CreateInstanceRequest, name string, p placement) *computepb.InsertInstanceRequest {
	c := be.cfg
	labels := make(map[string]string, len(c.Labels)+4)
	for k, v := range c.Labels {
		labels[k] = v
	}
	labels[labelManaged] = labelManagedOn
	labels[labelUID] = labelValue(req.GetProxyUid())
	labels[labelCreatedAt] = strconv.FormatInt(be.now().Unix(), 10)
	if in := req.GetInstallation(); in != "" {
		labels[labelInstallation] = in
	}

	nic := &computepb.NetworkInterface{Network: proto.String(c.Network)}
	if c.Subnetwork != "" {
		nic.Subnetwork = proto.String(c.Subnetwork)
	}
	if *c.ExternalIP {
		nic.AccessConfigs = []*computepb.AccessConfig{{
			Name:        proto.String("External NAT"),
			Type:        proto.String(computepb.AccessConfig_ONE_TO_ONE_NAT.String()),
			NetworkTier: proto.String(computepb.AccessConfig_PREMIUM.String()),
		}}
	}
	inst := &computepb.Instance{
		Name:        proto.String(name),
		Description: proto.String("egress proxy " + req.GetProxyName() + " (" + req.GetProxyUid() + ")"),
		MachineType: proto.String("zones/" + p.zone + "/machineTypes/" + p.machineType),
		Labels:      labels,
		Disks: []*computepb.AttachedDisk{{
			Boot:       proto.Bool(true),
			AutoDelete: proto.Bool(true),
			Type:       proto.String(computepb.AttachedDisk_PERSISTENT.String()),
			InitializeParams: &computepb.AttachedDiskInitializeParams{
				SourceImage: proto.String(p.image),
				DiskSizeGb:  proto.Int64(int64(c.DiskSizeGB)),
				DiskType:    proto.String("zones/" + p.zone + "/diskTypes/" + c.DiskType),
				Labels:      labels,
			},
		}},
		NetworkInterfaces: []*computepb.NetworkInterface{nic},
		Metadata:          &computepb.Metadata{Items: metadataItems(req)},
	}
	if len(c.NetworkTags) > 0 {
		inst.Tags = &computepb.Tags{Items: append([]string(nil), c.NetworkTags...)}
	}
	if c.ServiceAccount != nil {
		inst.ServiceAccounts = []*computepb.ServiceAccount{{
			Email:  proto.String(c.ServiceAccount.Email),
			Scopes: append([]string(nil), c.ServiceAccount.Scopes...),
		}}
	}
	switch {
	case c.Spot:
		// A reclaimed Spot instance is deleted rather than stopped, so Get
		// answers NotFound and the orchestrator creates a new one.
		inst.Scheduling = &computepb.Scheduling{
			ProvisioningModel:         proto.String(computepb.Scheduling_SPOT.String()),
			InstanceTerminationAction: proto.String(computepb.Scheduling_DELETE.String()),
			AutomaticRestart:          proto.Bool(false),
			OnHostMaintenance:         proto.String(computepb.Scheduling_TERMINATE.String()),
		}
	case c.Preemptible:
		inst.Scheduling = &computepb.Scheduling{
			Preemptible:       proto.Bool(true),
			AutomaticRestart:  proto.Bool(false),
			OnHostMaintenance: proto.String(computepb.Scheduling_TERMINATE.String()),
		}
	}
	return &computepb.InsertInstanceRequest{
		Project:          c.Project,
		Zone:             p.zone,
		InstanceResource: inst,
		// A fresh ID per attempt: Compute would answer a repeated ID with
		// the first attempt's operation, failed or not, for an hour.
		RequestId: proto.String(uuid.NewString()),
	}
}

// Create inserts the proxy's instance, or adopts the one an earlier
// attempt inserted (the name is fixed, so that is a 409 alreadyExists
// whose labels carry the proxy's UID). It watches the insert operation for
// at most operationWaitSeconds, so an asynchronous failure (quota, a zone
// out of resources) comes back classified, then answers with the
// instance's state as Get reads it; an insert still running then is
// answered as PROVISIONING and left to Get.
func (be *Backend) Create(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.Instance, error) {
	name, err := instanceName(req.GetProxyUid())
	if err != nil {
		return nil, err
	}
	p, err := be.resolve(req)
	if err != nil {
		return nil, err
	}
	c, err := be.client(ctx)
	if err != nil {
		return nil, err
	}
	pid := providerID(p.zone, name)
	log := be.log.With("name", name, "zone", p.zone)
	ins := be.buildInsertRequest(req, name, p)
	cctx, cancel := be.call(ctx)
	op, err := c.instances.Insert(cctx, ins)
	cancel()
	existed := false
	switch {
	case err == nil:
		log.DebugContext(ctx, "gcp instance insert accepted", "operation", op.Name(), "status", op.Proto().GetStatus().String())
		crashpoint.After(ctx, "gcp.inserted")
		if err := be.watch(ctx, op); err != nil {
			return nil, notFoundAsTransient(err)
		}
	case isAlreadyExists(err):
		existed = true
		log.DebugContext(ctx, "gcp instance already exists; checking it is ours")
	default:
		return nil, notFoundAsTransient(err)
	}
	inst, err := be.getInstance(ctx, c, p.zone, name)
	switch {
	case errclass.Is(err, errclass.NotFound) && existed:
		// The name is taken by an instance Get no longer finds: one
		// being deleted. Create answers only an instance it has seen.
		return nil, errclass.New(errclass.Transient, "instance %s in %s exists (the insert answered alreadyExists) but Get does not find it: it is being deleted; Create retries once the name is free", name, p.zone).
			WithMetadata("zone", p.zone, "name", name)
	case errclass.Is(err, errclass.NotFound):
		// Our insert is still running (or Get has not caught up).
		return &provisionerv1.Instance{ProviderId: pid, ProxyUid: req.GetProxyUid(), Name: name,
			State:   provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING,
			Details: map[string]string{"zone": p.zone, "project": be.cfg.Project}}, nil
	case err != nil:
		return nil, notFoundAsTransient(err)
	}
	m := markOf(inst.GetLabels())
	if !m.ours(req.GetProxyUid(), req.GetInstallation()) {
		who := "no proxy-operator labels"
		switch {
		case m.managed && m.uid == labelValue(req.GetProxyUid()):
			who = "the labels of installation " + m.installation + " (two installations hold this proxy UID: a copied database?)"
		case m.managed:
			who = "the labels of proxy UID " + m.uid
		}
		return nil, errclass.New(errclass.Permanent, "instance %s in %s already exists with %s; delete or rename it", name, p.zone, who).
			WithMetadata("zone", p.zone, "name", name)
	}
	if inst, err = be.claim(ctx, c, p.zone, inst, req.GetInstallation()); err != nil {
		return nil, err
	}
	switch inst.GetStatus() {
	case "STOPPING":
		// Being deleted (or stopped): adopting it would answer an
		// instance that is gone seconds later.
		return nil, errclass.New(errclass.Transient, "instance %s in %s is stopping (being deleted or stopped); Create retries once it is gone or stopped", name, p.zone).
			WithMetadata("zone", p.zone, "name", name, "status", inst.GetStatus())
	case "TERMINATED":
		// Ours, stopped (a maintenance event, a stop by hand): nothing
		// else would ever start it.
		if inst, err = be.start(ctx, c, p.zone, name); err != nil {
			return nil, notFoundAsTransient(err)
		}
		log.InfoContext(ctx, "gcp instance of the proxy was stopped; started it", "status", inst.GetStatus())
	}
	out := be.toInstance(inst, p.zone)
	log.DebugContext(ctx, "gcp instance created", "state", out.GetState().String(), "ip", out.GetIp())
	return out, nil
}

// claim labels the proxy's instance with installation when its labels
// name none (it was created before they did), so that it is this
// installation's from now on, and answers the instance as it is then.
func (be *Backend) claim(ctx context.Context, c *clients, zone string, inst *computepb.Instance, installation string) (*computepb.Instance, error) {
	if installation == "" || markOf(inst.GetLabels()).installation != "" {
		return inst, nil
	}
	labels := make(map[string]string, len(inst.GetLabels())+1)
	for k, v := range inst.GetLabels() {
		labels[k] = v
	}
	labels[labelInstallation] = installation
	cctx, cancel := be.call(ctx)
	op, err := c.instances.SetLabels(cctx, &computepb.SetLabelsInstanceRequest{
		Project: be.cfg.Project, Zone: zone, Instance: inst.GetName(), RequestId: proto.String(uuid.NewString()),
		InstancesSetLabelsRequestResource: &computepb.InstancesSetLabelsRequest{Labels: labels, LabelFingerprint: proto.String(inst.GetLabelFingerprint())},
	})
	cancel()
	if err != nil {
		return nil, notFoundAsTransient(classify(err))
	}
	if err := be.watch(ctx, op); err != nil {
		return nil, notFoundAsTransient(err)
	}
	be.log.InfoContext(ctx, "gcp instance labelled before installations claimed for this installation", "name", inst.GetName(), "zone", zone, "installation", installation)
	inst = proto.Clone(inst).(*computepb.Instance)
	inst.Labels = labels
	return inst, nil
}

// start starts a stopped instance, watches the start operation and reads
// the instance again.
func (be *Backend) start(ctx context.Context, c *clients, zone, name string) (*computepb.Instance, error) {
	cctx, cancel := be.call(ctx)
	op, err := c.instances.Start(cctx, &computepb.StartInstanceRequest{Project: be.cfg.Project, Zone: zone, Instance: name, RequestId: proto.String(uuid.NewString())})
	cancel()
	if err != nil {
		return nil, classify(err)
	}
	if err := be.watch(ctx, op); err != nil {
		return nil, err
	}
	return be.getInstance(ctx, c, zone, name)
}

// watch polls an operation until it is done or operationWait has passed.
// A done operation's failure is returned classified; running out of time
// is not an error (the caller's Get observes the rest).
func (be *Backend) watch(ctx context.Context, op *compute.Operation) error {
	if err := operationError(op.Proto()); err != nil {
		return err
	}
	if op.Done() || be.operationWait <= 0 {
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, be.operationWait)
	defer cancel()
	t := time.NewTicker(be.poll)
	defer t.Stop()
	for {
		select {
		case <-wctx.Done():
			if err := ctx.Err(); err != nil {
				return err
			}
			be.log.DebugContext(ctx, "gcp operation still running; leaving it to Get", "operation", op.Name(), "status", op.Proto().GetStatus().String())
			return nil
		case <-t.C:
		}
		err := be.retried(wctx, func(ctx context.Context, opt gax.CallOption) error { return op.Poll(ctx, opt) })
		if oerr := operationError(op.Proto()); oerr != nil {
			return oerr
		}
		if err != nil {
			if wctx.Err() != nil && ctx.Err() == nil {
				return nil
			}
			return err
		}
		if op.Done() {
			return nil
		}
	}
}

func isAlreadyExists(err error) bool {
	var gerr *googleapi.Error
	if !errors.As(err, &gerr) || gerr.Code != http.StatusConflict {
		return false
	}
	for _, e := range gerr.Errors {
		if e.Reason == "alreadyExists" {
			return true
		}
	}
	return len(gerr.Errors) == 0
}

// metadataItems are the instance's metadata: user-data (the proxy's
// cloud-init, byte for byte) and, when the proxy has credentials, the
// keys nocloud.MetaKeyProxyUser and nocloud.MetaKeyProxyPassword, the
// names the NoCloud backends use in meta-data, which the proxy's
// cloud-init reads from the metadata server. Secret: wire logs redact
// every one of them.
func metadataItems(req *provisionerv1.CreateInstanceRequest) []*computepb.Items {
	items := []*computepb.Items{{Key: proto.String("user-data"), Value: proto.String(req.GetCloudInit())}}
	if c := req.GetCredentials(); c != nil {
		items = append(items,
			&computepb.Items{Key: proto.String(nocloud.MetaKeyProxyUser), Value: proto.String(c.GetUsername())},
			&computepb.Items{Key: proto.String(nocloud.MetaKeyProxyPassword), Value: proto.String(c.GetPassword())})
	}
	return items
}
