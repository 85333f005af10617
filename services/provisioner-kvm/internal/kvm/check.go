package kvm

import (
	"context"
	"fmt"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"sync"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"google.golang.org/protobuf/types/known/durationpb"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
)

// hostFacts is what a passing check learns.
type hostFacts struct {
	libVersion, hvVersion uint64
	hostname              string
	poolState             libvirt.StoragePoolState
	capacity, available   uint64
}

// Check gives one verdict per host, in config order, checking the hosts
// concurrently over the same pooled connection the operations use: the
// handshakes (only when there is no live connection), the libvirt and
// hypervisor versions and the hostname, then the pool must exist and run.
func (be *Backend) Check(ctx context.Context) []*provisionerv1.TargetStatus {
	out := make([]*provisionerv1.TargetStatus, len(be.cfg.Hosts))
	var wg sync.WaitGroup
	for i, h := range be.cfg.Hosts {
		wg.Go(func() { out[i] = be.checkHost(ctx, h) })
	}
	wg.Wait()
	return out
}

// checkHost goes through probe, so a check that runs out of time abandons
// its RPCs rather than closing the shared connection. facts is read only
// when probe returned nil, since an abandoned fn may still write it.
func (be *Backend) checkHost(ctx context.Context, h Host) *provisionerv1.TargetStatus {
	ctx, cancel := context.WithTimeout(ctx, be.checkTimeout)
	defer cancel()
	ts := &provisionerv1.TargetStatus{
		Name:    h.Name,
		Address: h.Address,
		Details: map[string]string{"user": h.User, "pool": h.Pool, "socket": h.Socket},
	}
	start := time.Now()
	var facts hostFacts
	err := be.hosts.probe(ctx, h, func(api libvirtAPI) error {
		var f hostFacts
		var err error
		if f.libVersion, err = api.ConnectGetLibVersion(); err != nil {
			return err
		}
		if f.hvVersion, err = api.ConnectGetVersion(); err != nil {
			return err
		}
		if f.hostname, err = api.ConnectGetHostname(); err != nil {
			return err
		}
		pool, err := api.StoragePoolLookupByName(h.Pool)
		if err != nil {
			return err
		}
		state, capacity, _, available, err := api.StoragePoolGetInfo(pool)
		if err != nil {
			return err
		}
		f.poolState, f.capacity, f.available = libvirt.StoragePoolState(state), capacity, available
		facts = f
		return nil
	})
	ts.Latency = durationpb.New(time.Since(start))
	if err != nil {
		ts.Reason = checkReason(err)
		ts.Message = err.Error()
		return ts
	}
	ts.Details["hostname"] = facts.hostname
	ts.Details["libvirtVersion"] = formatVersion(facts.libVersion)
	ts.Details["hypervisorVersion"] = formatVersion(facts.hvVersion)
	ts.Details["poolState"] = poolStateName(facts.poolState)
	ts.Details["poolCapacity"] = formatGiB(facts.capacity)
	ts.Details["poolAvailable"] = formatGiB(facts.available)
	if facts.poolState != libvirt.StoragePoolRunning {
		ts.Reason = provisioner.ReasonPoolNotActive
		ts.Message = fmt.Sprintf("storage pool %q is %s; start it (virsh pool-start %s) and mark it autostart", h.Pool, poolStateName(facts.poolState), h.Pool)
		return ts
	}
	ts.Ready = true
	ts.Reason = provisioner.ReasonReachable
	return ts
}

// poolStateName uses virsh's words.
func poolStateName(s libvirt.StoragePoolState) string {
	switch s {
	case libvirt.StoragePoolInactive:
		return "inactive"
	case libvirt.StoragePoolBuilding:
		return "building"
	case libvirt.StoragePoolRunning:
		return "running"
	case libvirt.StoragePoolDegraded:
		return "degraded"
	case libvirt.StoragePoolInaccessible:
		return "inaccessible"
	default:
		return fmt.Sprintf("state %d", s)
	}
}

func formatGiB(b uint64) string { return fmt.Sprintf("%.1fGiB", float64(b)/(1<<30)) }
