package main

import (
	"errors"
	"fmt"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/proto"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/nocloud"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
	"github.com/egress-proxies/egress-proxies/services/provisioner-gcp/internal/gcpfake"
)

var binary = provisionertest.Binary{Package: ".", Service: "provisioner-gcp"}

const (
	project = "egress-test"
	zone    = "europe-west1-b"
	// zoneQuota fails every insert with QUOTA_EXCEEDED.
	zoneQuota = "us-central1-a"
)

// gcpBlock is the gcp block of a provider whose Compute API is at endpoint.
func gcpBlock(endpoint string) string {
	return fmt.Sprintf(`gcp:
  project: %s
  zones: [%s, %s]
  machineTypes: [e2-small]
  images: {debian-13: projects/debian-cloud/global/images/family/debian-13}
  endpoint: %s
  withoutAuthentication: true
`, project, zone, zoneQuota, endpoint)
}

// The contract, against the fake Compute Engine API.
func TestConformance(t *testing.T) {
	t.Parallel()
	fake := gcpfake.New(gcpfake.Options{Project: project, Zones: []string{zone, zoneQuota}, QuotaZones: []string{zoneQuota}})
	srv := httptest.NewServer(fake)
	t.Cleanup(srv.Close)
	put := func(uid string, status string, labels map[string]string) (string, *computepb.Instance) {
		in := &computepb.Instance{Name: proto.String("proxy-" + uid), Status: proto.String(status), Labels: labels,
			MachineType:       proto.String("zones/" + zone + "/machineTypes/e2-small"),
			NetworkInterfaces: []*computepb.NetworkInterface{{Name: proto.String("nic0"), NetworkIP: proto.String("10.128.9.9")}}}
		fake.Put(zone, in)
		return "zones/" + zone + "/instances/" + in.GetName(), fake.Instance(zone, in.GetName())
	}
	placement := func(z string) *proxyv1.Placement {
		return &proxyv1.Placement{Zone: z, MachineType: "e2-small", Image: "debian-13"}
	}
	provisionertest.TestAll(t, provisionertest.Tester{
		Binary:    binary,
		Type:      "gcp",
		Backend:   func(*testing.T) string { return gcpBlock(srv.URL) },
		Placement: placement(zone),
		Credentials: func(_ *testing.T, uid string, c *proxyv1.ProxyCredentials) error {
			in := fake.Instance(zone, "proxy-"+uid)
			if in == nil {
				return errors.New("no instance")
			}
			md := map[string]string{}
			for _, it := range in.GetMetadata().GetItems() {
				md[it.GetKey()] = it.GetValue()
			}
			if md[nocloud.MetaKeyProxyUser] != c.GetUsername() || md[nocloud.MetaKeyProxyPassword] != c.GetPassword() {
				return fmt.Errorf("the instance metadata carries user %q and a password of %d characters, not the proxy's", md[nocloud.MetaKeyProxyUser], len(md[nocloud.MetaKeyProxyPassword]))
			}
			return nil
		},
		Observe: func(_ *testing.T, uid string) provisionertest.Observed {
			var o provisionertest.Observed
			for _, z := range []string{zone, zoneQuota} {
				if fake.Instance(z, "proxy-"+uid) != nil {
					o.Instances = append(o.Instances, "instance "+z+"/proxy-"+uid)
				}
			}
			return o
		},
		// An insert the crashed attempt had accepted: the instance with its
		// labels, provisioning.
		HalfMade: func(_ *testing.T, uid string) string {
			pid, _ := put(uid, "PROVISIONING", map[string]string{"proxy-operator-managed": "true", "proxy-operator-uid": uid,
				"proxy-operator-created-at": strconv.FormatInt(time.Now().Unix(), 10)})
			return pid
		},
		Foreign: func(_ *testing.T, uid string) provisionertest.Foreign {
			pid, was := put(uid, "RUNNING", map[string]string{"team": "data"})
			return provisionertest.Foreign{ProviderID: pid, Unchanged: func() error {
				if now := fake.Instance(zone, was.GetName()); !proto.Equal(now, was) {
					return fmt.Errorf("instance was %v, is %v", was, now)
				}
				return nil
			}}
		},
		// The labels as written before installations: without one.
		Unclaim: func(t *testing.T, uid string) {
			in := fake.Instance(zone, "proxy-"+uid)
			if in == nil {
				t.Fatalf("no instance of %s to unclaim", uid)
			}
			delete(in.Labels, "proxy-operator-installation")
			in.LabelFingerprint = nil
			fake.Put(zone, in)
		},
		CrashSteps: []provisionertest.CrashStep{{Name: "gcp.inserted"}},
		Unreachable: func(t *testing.T) provisionertest.Outage {
			return provisionertest.Outage{Backend: gcpBlock("http://" + provisionertest.ClosedAddress(t))}
		},
		Stalled: func(t *testing.T) string { return gcpBlock("http://" + provisionertest.StalledAddress(t)) },
		Quota: func(*testing.T) provisionertest.Quota {
			return provisionertest.Quota{Backend: gcpBlock(srv.URL), Placement: placement(zoneQuota)}
		},
	})
}
