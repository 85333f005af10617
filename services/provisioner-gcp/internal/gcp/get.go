package gcp

import (
	"context"
	"strconv"
	"strings"

	compute "cloud.google.com/go/compute/apiv1"
	"cloud.google.com/go/compute/apiv1/computepb"
	"github.com/googleapis/gax-go/v2"
	"google.golang.org/api/iterator"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// getInstance reads one instance; errors are classified (404 NotFound).
func (be *Backend) getInstance(ctx context.Context, c *clients, zone, name string) (*computepb.Instance, error) {
	var inst *computepb.Instance
	err := be.retried(ctx, func(ctx context.Context, opt gax.CallOption) (err error) {
		inst, err = c.instances.Get(ctx, &computepb.GetInstanceRequest{Project: be.cfg.Project, Zone: zone, Instance: name}, opt)
		return err
	})
	if err != nil {
		return nil, err
	}
	return inst, nil
}

// stateOf maps a Compute instance status onto the contract's states.
// RUNNING is Running only once the configured address is known.
//
//	PROVISIONING, STAGING      → PROVISIONING (being created, booting)
//	RUNNING                    → RUNNING, or PROVISIONING without an address
//	REPAIRING                  → PROVISIONING (Compute restores it by itself)
//	STOPPING, STOPPED          → STOPPED
//	SUSPENDING, SUSPENDED      → STOPPED
//	TERMINATED                 → STOPPED (Compute's word for a stopped VM)
//	anything else              → UNSPECIFIED
func stateOf(status string, hasIP bool) provisionerv1.InstanceState {
	switch status {
	case "PROVISIONING", "STAGING", "REPAIRING":
		return provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING
	case "RUNNING":
		if hasIP {
			return provisionerv1.InstanceState_INSTANCE_STATE_RUNNING
		}
		return provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING
	case "STOPPING", "STOPPED", "SUSPENDING", "SUSPENDED", "TERMINATED":
		return provisionerv1.InstanceState_INSTANCE_STATE_STOPPED
	}
	return provisionerv1.InstanceState_INSTANCE_STATE_UNSPECIFIED
}

// addressOf is the instance's internal (networkIP) or external (natIP)
// address of its first interface, as configured.
func (be *Backend) addressOf(inst *computepb.Instance) string {
	nics := inst.GetNetworkInterfaces()
	if len(nics) == 0 {
		return ""
	}
	if be.cfg.Address == AddressInternal {
		return nics[0].GetNetworkIP()
	}
	for _, ac := range nics[0].GetAccessConfigs() {
		if ip := ac.GetNatIP(); ip != "" {
			return ip
		}
	}
	return ""
}

func (be *Backend) toInstance(inst *computepb.Instance, zone string) *provisionerv1.Instance {
	m := markOf(inst.GetLabels())
	ip := be.addressOf(inst)
	out := &provisionerv1.Instance{
		ProviderId:   providerID(zone, inst.GetName()),
		ProxyUid:     m.uid,
		Name:         inst.GetName(),
		Installation: m.installation,
		State:        stateOf(inst.GetStatus(), ip != ""),
		Details: map[string]string{
			"zone": zone, "project": be.cfg.Project, "status": inst.GetStatus(),
			"machineType": lastSegment(inst.GetMachineType()),
		},
	}
	if out.State == provisionerv1.InstanceState_INSTANCE_STATE_RUNNING {
		out.Ip = ip
	}
	if id := inst.GetId(); id != 0 {
		out.Details["id"] = formatID(id)
	}
	if !m.createdAt.IsZero() {
		out.CreateTime = timestamppb.New(m.createdAt)
	}
	return out
}

// Get reads the instance: one request. NotFound when it is gone or its
// labels are not the proxy's.
func (be *Backend) Get(ctx context.Context, req *provisionerv1.GetInstanceRequest) (*provisionerv1.Instance, error) {
	zone, name, err := parseProviderID(req.GetProviderId())
	if err != nil {
		return nil, err
	}
	c, err := be.client(ctx)
	if err != nil {
		return nil, err
	}
	inst, err := be.getInstance(ctx, c, zone, name)
	if err != nil {
		return nil, err
	}
	m := markOf(inst.GetLabels())
	switch {
	case !m.managed:
		return nil, errclass.New(errclass.NotFound, "%s carries no proxy-operator labels", req.GetProviderId())
	case m.foreignInstallation(req.GetInstallation()):
		return nil, errclass.New(errclass.NotFound, "%s is labelled for installation %s", req.GetProviderId(), m.installation)
	case req.GetProxyUid() != "" && !m.ours(req.GetProxyUid(), req.GetInstallation()):
		return nil, errclass.New(errclass.NotFound, "%s is labelled for proxy UID %s", req.GetProviderId(), m.uid)
	}
	if req.GetProxyUid() != "" {
		if inst, err = be.claim(ctx, c, zone, inst, req.GetInstallation()); err != nil {
			return nil, err
		}
	}
	out := be.toInstance(inst, zone)
	be.log.DebugContext(ctx, "gcp instance fetched", "name", name, "zone", zone, "status", inst.GetStatus(), "state", out.GetState().String(), "ip", out.GetIp())
	return out, nil
}

// listPageSize is the page size List asks for, Compute's maximum.
const listPageSize = 500

func formatID(id uint64) string { return strconv.FormatUint(id, 10) }

// List walks every page of the project's aggregated instance list,
// filtered by the managed label. Zones that did not answer are logged
// with a WARNING and the rest is still listed: orphan GC then simply
// spares what it could not see.
func (be *Backend) List(ctx context.Context) ([]*provisionerv1.Instance, error) {
	c, err := be.client(ctx)
	if err != nil {
		return nil, err
	}
	it := c.instances.AggregatedList(ctx, &computepb.AggregatedListInstancesRequest{
		Project: be.cfg.Project,
		Filter:  proto.String(managedFilter),
	})
	pager := iterator.NewPager(it, be.opts.ListPageSize, "")
	var (
		out         []*provisionerv1.Instance
		unreachable = map[string]string{}
		pages       int
	)
	for {
		var pairs []compute.InstancesScopedListPair
		next, err := pager.NextPage(&pairs)
		if err != nil {
			return nil, classify(err)
		}
		pages++
		if r, ok := it.Response.(*computepb.InstanceAggregatedList); ok {
			for _, scope := range r.GetUnreachables() {
				unreachable[scope] = "unreachable"
			}
		}
		for _, pair := range pairs {
			scope, list := pair.Key, pair.Value
			if w := list.GetWarning(); w != nil && w.GetCode() != computepb.Warning_NO_RESULTS_ON_PAGE.String() {
				unreachable[scope] = w.GetCode() + ": " + w.GetMessage()
			}
			for _, inst := range list.GetInstances() {
				if !markOf(inst.GetLabels()).managed {
					continue
				}
				zone := lastSegment(inst.GetZone())
				if zone == "" {
					zone = strings.TrimPrefix(scope, "zones/")
				}
				out = append(out, be.toInstance(inst, zone))
			}
		}
		if next == "" {
			break
		}
	}
	if len(unreachable) > 0 {
		be.log.WarnContext(ctx, "WARNING: gcp zones did not answer the instance list; their instances are not listed", "zones", unreachable)
	}
	be.log.DebugContext(ctx, "gcp instances listed", "filter", managedFilter, "pages", pages, "count", len(out), "unreachable", len(unreachable))
	return out, nil
}
