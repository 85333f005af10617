package gcp

import (
	"fmt"
	"strings"
	"testing"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/proto"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

func ours(uid string) map[string]string {
	return map[string]string{labelManaged: "true", labelUID: uid, labelCreatedAt: "1796292000"}
}

func nic() []*computepb.NetworkInterface {
	return []*computepb.NetworkInterface{{
		NetworkIP:     proto.String("10.128.0.7"),
		AccessConfigs: []*computepb.AccessConfig{{Name: proto.String("External NAT"), NatIP: proto.String("34.77.1.2")}},
	}}
}

// TestGetStateTable reads an instance in every Compute status through the
// fake and the SDK.
func TestGetStateTable(t *testing.T) {
	t.Parallel()
	const (
		prov    = provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING
		running = provisionerv1.InstanceState_INSTANCE_STATE_RUNNING
		stopped = provisionerv1.InstanceState_INSTANCE_STATE_STOPPED
		unknown = provisionerv1.InstanceState_INSTANCE_STATE_UNSPECIFIED
	)
	tests := []struct {
		status string
		nics   []*computepb.NetworkInterface
		want   provisionerv1.InstanceState
		ip     string
	}{
		{"PROVISIONING", nil, prov, ""},
		{"STAGING", nic(), prov, ""},
		{"RUNNING", nic(), running, "34.77.1.2"},
		{"RUNNING", []*computepb.NetworkInterface{{NetworkIP: proto.String("10.128.0.7")}}, prov, ""},
		{"STOPPING", nic(), stopped, ""},
		{"STOPPED", nic(), stopped, ""},
		{"SUSPENDING", nic(), stopped, ""},
		{"SUSPENDED", nic(), stopped, ""},
		{"REPAIRING", nic(), prov, ""},
		{"TERMINATED", nic(), stopped, ""},
		{"SOMETHING_NEW", nic(), unknown, ""},
	}
	e := newEnv(t, nil)
	for i, tc := range tests {
		t.Run(fmt.Sprintf("%s-%d", tc.status, i), func(t *testing.T) {
			name := fmt.Sprintf("proxy-state-%d", i)
			e.fake.Put(zoneA, &computepb.Instance{Name: proto.String(name), Status: proto.String(tc.status), Labels: ours(fmt.Sprint("state-", i)), NetworkInterfaces: tc.nics})
			got, err := e.be.Get(ctxT(t), &provisionerv1.GetInstanceRequest{ProviderId: "zones/" + zoneA + "/instances/" + name, ProxyUid: fmt.Sprint("state-", i)})
			if err != nil {
				t.Fatal(err)
			}
			if got.GetState() != tc.want || got.GetIp() != tc.ip {
				t.Errorf("%s: state %v ip %q, want %v %q", tc.status, got.GetState(), got.GetIp(), tc.want, tc.ip)
			}
			if got.GetDetails()["status"] != tc.status || got.GetCreateTime().AsTime() != fixedNow {
				t.Errorf("details %v create time %v", got.GetDetails(), got.GetCreateTime())
			}
		})
	}
}

func TestGetInternalAddress(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.Address = AddressInternal })
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-int"), Status: proto.String("RUNNING"), Labels: ours("int"), NetworkInterfaces: nic()})
	got, err := e.be.Get(ctxT(t), &provisionerv1.GetInstanceRequest{ProviderId: "zones/" + zoneA + "/instances/proxy-int", ProxyUid: "int"})
	if err != nil || got.GetIp() != "10.128.0.7" {
		t.Fatalf("Get = %v %v, want the networkIP", got, err)
	}
}

func TestGetNotFound(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-foreign"), Status: proto.String("RUNNING"), Labels: map[string]string{"team": "web"}})
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-other"), Status: proto.String("RUNNING"), Labels: ours("other")})
	tests := []struct {
		pid, uid string
		class    errclass.Class
		want     string
	}{
		{"zones/" + zoneA + "/instances/proxy-gone", "gone", errclass.NotFound, "was not found"},
		{"zones/" + zoneA + "/instances/proxy-foreign", "foreign", errclass.NotFound, "no proxy-operator labels"},
		{"zones/" + zoneA + "/instances/proxy-other", "mine", errclass.NotFound, "labelled for proxy UID other"},
		{"vms/100/proxy-x", "x", errclass.Permanent, "is not zones/<zone>/instances/<name>"},
		{"zones/../instances/x", "x", errclass.Permanent, "is not zones/"},
	}
	for _, tc := range tests {
		_, err := e.be.Get(ctxT(t), &provisionerv1.GetInstanceRequest{ProviderId: tc.pid, ProxyUid: tc.uid})
		if !errclass.Is(err, tc.class) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Get(%s) = %v (%v), want %v with %q", tc.pid, err, errclass.Of(err), tc.class, tc.want)
		}
	}
}
