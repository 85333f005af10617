package gcp

import (
	"encoding/json"
	"maps"
	"strings"
	"testing"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// TestCreateInsertRequest checks the insert the real SDK sends, field by
// field, decoded from the body the fake received.
func TestCreateInsertRequest(t *testing.T) {
	t.Parallel()
	ext := false
	tests := []struct {
		name  string
		mut   func(*Config)
		check func(t *testing.T, in *computepb.Instance)
	}{
		{"defaults", nil, func(t *testing.T, in *computepb.Instance) {
			nic := in.GetNetworkInterfaces()[0]
			if nic.GetNetwork() != DefaultNetwork || nic.Subnetwork != nil {
				t.Errorf("network %q subnetwork %v", nic.GetNetwork(), nic.Subnetwork)
			}
			if len(nic.GetAccessConfigs()) != 1 || nic.GetAccessConfigs()[0].GetType() != "ONE_TO_ONE_NAT" || nic.GetAccessConfigs()[0].GetNetworkTier() != "PREMIUM" {
				t.Errorf("access configs %v, want one ONE_TO_ONE_NAT", nic.GetAccessConfigs())
			}
			if in.Tags != nil || in.ServiceAccounts != nil || in.Scheduling != nil {
				t.Errorf("tags %v serviceAccounts %v scheduling %v, want none", in.Tags, in.ServiceAccounts, in.Scheduling)
			}
			d := in.GetDisks()[0].GetInitializeParams()
			if d.GetDiskSizeGb() != 10 || d.GetDiskType() != "zones/"+zoneA+"/diskTypes/pd-balanced" {
				t.Errorf("disk %d GB %q", d.GetDiskSizeGb(), d.GetDiskType())
			}
		}},
		{"everything set", func(c *Config) {
			c.Network = "projects/host/global/networks/egress"
			c.Subnetwork = "regions/europe-west1/subnetworks/proxies"
			c.ExternalIP = &ext
			c.NetworkTags = []string{"egress-proxy", "allow-3128"}
			c.ServiceAccount = &ServiceAccount{Email: "proxy@egress-test.iam.gserviceaccount.com"}
			c.Labels = map[string]string{"team": "crawl"}
			c.DiskSizeGB, c.DiskType = 20, "pd-ssd"
			c.Spot = true
		}, func(t *testing.T, in *computepb.Instance) {
			nic := in.GetNetworkInterfaces()[0]
			if nic.GetNetwork() != "projects/host/global/networks/egress" || nic.GetSubnetwork() != "regions/europe-west1/subnetworks/proxies" {
				t.Errorf("network %q subnetwork %q", nic.GetNetwork(), nic.GetSubnetwork())
			}
			if len(nic.GetAccessConfigs()) != 0 {
				t.Errorf("access configs %v, want none with externalIP off", nic.GetAccessConfigs())
			}
			if got := in.GetTags().GetItems(); strings.Join(got, ",") != "egress-proxy,allow-3128" {
				t.Errorf("tags %v", got)
			}
			sa := in.GetServiceAccounts()
			if len(sa) != 1 || sa[0].GetEmail() != "proxy@egress-test.iam.gserviceaccount.com" || strings.Join(sa[0].GetScopes(), ",") != defaultServiceScope {
				t.Errorf("service accounts %v", sa)
			}
			if in.GetLabels()["team"] != "crawl" {
				t.Errorf("labels %v lack team=crawl", in.GetLabels())
			}
			d := in.GetDisks()[0].GetInitializeParams()
			if d.GetDiskSizeGb() != 20 || d.GetDiskType() != "zones/"+zoneA+"/diskTypes/pd-ssd" {
				t.Errorf("disk %d GB %q", d.GetDiskSizeGb(), d.GetDiskType())
			}
			s := in.GetScheduling()
			if s.GetProvisioningModel() != "SPOT" || s.GetInstanceTerminationAction() != "DELETE" || s.GetAutomaticRestart() || s.GetOnHostMaintenance() != "TERMINATE" || s.GetPreemptible() {
				t.Errorf("scheduling %v", s)
			}
		}},
		{"preemptible", func(c *Config) { c.Preemptible = true }, func(t *testing.T, in *computepb.Instance) {
			s := in.GetScheduling()
			if !s.GetPreemptible() || s.GetAutomaticRestart() || s.GetOnHostMaintenance() != "TERMINATE" || s.ProvisioningModel != nil {
				t.Errorf("scheduling %v", s)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, tc.mut)
			const uid = "0b6f1c2e-7d4a-4f5e-9c3b-2a1d0e9f8c7b"
			if _, err := e.be.Create(ctxT(t), createReq(uid, zoneA)); err != nil {
				t.Fatal(err)
			}
			posts := e.requests("POST", "/instances")
			if len(posts) != 1 {
				t.Fatalf("%d inserts, want 1", len(posts))
			}
			r := posts[0]
			if r.Path != "/compute/v1/projects/"+project+"/zones/"+zoneA+"/instances" {
				t.Errorf("path %s", r.Path)
			}
			if r.Query["requestId"] == nil || len(r.Query["requestId"][0]) != 36 {
				t.Errorf("requestId %v, want a UUID", r.Query["requestId"])
			}
			if got := r.Header.Get("Content-Type"); got != "application/json" {
				t.Errorf("Content-Type %q", got)
			}
			if got := r.Header.Get("x-goog-request-params"); got != "project="+project+"&zone="+zoneA {
				t.Errorf("x-goog-request-params %q", got)
			}
			var in computepb.Instance
			if err := protojson.Unmarshal(r.Body, &in); err != nil {
				t.Fatal(err)
			}
			if in.GetName() != "proxy-"+uid {
				t.Errorf("name %q", in.GetName())
			}
			if in.GetMachineType() != "zones/"+zoneA+"/machineTypes/e2-small" {
				t.Errorf("machineType %q", in.GetMachineType())
			}
			if !strings.Contains(in.GetDescription(), "p-"+uid) {
				t.Errorf("description %q", in.GetDescription())
			}
			wantLabels := map[string]string{labelManaged: "true", labelUID: uid, labelCreatedAt: "1796292000"}
			for k, v := range wantLabels {
				if in.GetLabels()[k] != v {
					t.Errorf("label %s = %q, want %q", k, in.GetLabels()[k], v)
				}
			}
			if len(in.GetDisks()) != 1 {
				t.Fatalf("disks %v", in.GetDisks())
			}
			d := in.GetDisks()[0]
			if !d.GetBoot() || !d.GetAutoDelete() || d.GetType() != "PERSISTENT" || d.GetInitializeParams().GetSourceImage() != debian {
				t.Errorf("boot disk %v", d)
			}
			for k, v := range wantLabels {
				if d.GetInitializeParams().GetLabels()[k] != v {
					t.Errorf("disk label %s = %q, want %q", k, d.GetInitializeParams().GetLabels()[k], v)
				}
			}
			items := in.GetMetadata().GetItems()
			if len(items) != 1 || items[0].GetKey() != "user-data" || items[0].GetValue() != cloudInit {
				t.Errorf("metadata %v, want user-data byte for byte", items)
			}
			// The raw JSON too: the value is the cloud-init's bytes, escaped
			// only as JSON requires.
			var raw struct {
				Metadata struct {
					Items []struct{ Key, Value string }
				}
			}
			if err := json.Unmarshal(r.Body, &raw); err != nil || raw.Metadata.Items[0].Value != cloudInit {
				t.Errorf("raw user-data %q (%v)", raw.Metadata.Items, err)
			}
			tc.check(t, &in)
		})
	}
}

func TestCreateReturnsTheInstance(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	const uid = "11111111-2222-4333-8444-555555555555"
	in, err := e.be.Create(ctxT(t), createReq(uid, zoneB))
	if err != nil {
		t.Fatal(err)
	}
	want := "zones/" + zoneB + "/instances/proxy-" + uid
	if in.GetProviderId() != want || in.GetName() != "proxy-"+uid || in.GetProxyUid() != uid {
		t.Errorf("instance %v, want providerID %s", in, want)
	}
	if !in.GetCreateTime().AsTime().Equal(fixedNow) {
		t.Errorf("create time %v, want %v", in.GetCreateTime().AsTime(), fixedNow)
	}
	if in.GetDetails()["zone"] != zoneB || in.GetDetails()["project"] != project {
		t.Errorf("details %v", in.GetDetails())
	}
	// The insert operation was watched until DONE, then one Get.
	if n := len(e.requests("GET", "/operations/")); n < 1 {
		t.Errorf("%d operation polls, want the insert watched", n)
	}
	if n := len(e.requests("GET", "/instances/proxy-")); n != 1 {
		t.Errorf("%d instance reads, want 1", n)
	}
	// Get observes it until it runs with its external address.
	var got *provisionerv1.Instance
	for range 5 {
		got, err = e.be.Get(ctxT(t), &provisionerv1.GetInstanceRequest{ProviderId: want, ProxyUid: uid})
		if err != nil {
			t.Fatal(err)
		}
		if got.GetState() == provisionerv1.InstanceState_INSTANCE_STATE_RUNNING {
			break
		}
	}
	if got.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_RUNNING || !strings.HasPrefix(got.GetIp(), "203.0.") {
		t.Errorf("after polling: %v, want RUNNING with the natIP", got)
	}
}

func TestCreateFireAndForget(t *testing.T) {
	t.Parallel()
	zero := 0
	e := newEnv(t, func(c *Config) { c.OperationWaitSeconds = &zero })
	in, err := e.be.Create(ctxT(t), createReq("fire-and-forget", zoneA))
	if err != nil {
		t.Fatal(err)
	}
	if in.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING {
		t.Errorf("state %v, want PROVISIONING", in.GetState())
	}
	if n := len(e.requests("GET", "/operations/")); n != 0 {
		t.Errorf("%d operation polls, want none", n)
	}
}

// TestCreateResumesAfterACrash: an earlier attempt inserted the instance
// and died before reading it; the next Create meets 409 alreadyExists and
// adopts it by its labels.
func TestCreateResumesAfterACrash(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	const uid = "crashed-0001"
	req := createReq(uid, zoneA)
	c, err := e.be.client(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	p, err := e.be.resolve(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.instances.Insert(ctxT(t), e.be.buildInsertRequest(req, "proxy-"+uid, p)); err != nil {
		t.Fatal(err)
	}
	in, err := e.be.Create(ctxT(t), req)
	if err != nil {
		t.Fatalf("Create after the crash: %v", err)
	}
	if in.GetProviderId() != "zones/"+zoneA+"/instances/proxy-"+uid || in.GetProxyUid() != uid {
		t.Errorf("adopted %v", in)
	}
	if n := e.fake.Instances(); n != 1 {
		t.Errorf("%d instances, want the one", n)
	}
	if n := len(e.requests("POST", "/instances")); n != 2 {
		t.Errorf("%d inserts, want 2 (the crashed one and the 409)", n)
	}
}

func TestCreateMeetsAForeignInstance(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		labels map[string]string
		want   string
	}{
		{"another proxy's", map[string]string{labelManaged: "true", labelUID: "someone-else"}, "proxy UID someone-else"},
		{"unlabelled", map[string]string{"team": "web"}, "no proxy-operator labels"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-mine"), Status: proto.String("RUNNING"), Labels: tc.labels})
			_, err := e.be.Create(ctxT(t), createReq("mine", zoneA))
			if !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Create = %v, want Permanent naming %q", err, tc.want)
			}
		})
	}
}

func TestCreateAsynchronousFailures(t *testing.T) {
	t.Parallel()
	tests := []struct {
		zone, code, msg string
	}{
		{zoneQuota, "QUOTA_EXCEEDED", "Quota 'CPUS' exceeded.  Limit: 24.0 in region us-central1."},
		{zoneFull, "ZONE_RESOURCE_POOL_EXHAUSTED", "does not have enough resources available"},
	}
	for _, tc := range tests {
		t.Run(tc.code, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			_, err := e.be.Create(ctxT(t), createReq("quota-1", tc.zone))
			if !errclass.Is(err, errclass.QuotaExceeded) {
				t.Fatalf("Create = %v (%v), want QuotaExceeded", err, errclass.Of(err))
			}
			if !strings.Contains(err.Error(), tc.code) || !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("message %q lacks %s / %q", err, tc.code, tc.msg)
			}
			var ce *errclass.Error
			if !errorsAs(err, &ce) || ce.Metadata["reason"] != tc.code || ce.Metadata["operation"] == "" {
				t.Errorf("metadata %v", ce)
			}
			if e.fake.Instances() != 0 {
				t.Errorf("an instance exists after a failed insert")
			}
		})
	}
}

func TestCreateRefusesBadPlacement(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	tests := []struct {
		name string
		mut  func(*provisionerv1.CreateInstanceRequest)
		want string
	}{
		{"zone not configured", func(r *provisionerv1.CreateInstanceRequest) { r.Placement.Zone = "us-east1-b" }, "placement.zone"},
		{"zone missing with several", func(r *provisionerv1.CreateInstanceRequest) { r.Placement.Zone = "" }, "placement.zone is required"},
		{"machine type", func(r *provisionerv1.CreateInstanceRequest) { r.Placement.MachineType = "n2-highmem-96" }, "placement.machineType"},
		{"image", func(r *provisionerv1.CreateInstanceRequest) { r.Placement.Image = "windows" }, "placement.image"},
		{"cloud-init too large", func(r *provisionerv1.CreateInstanceRequest) { r.CloudInit = strings.Repeat("x", maxUserDataBytes+1) }, "cloud-init is"},
		{"uid without name", func(r *provisionerv1.CreateInstanceRequest) { r.ProxyUid = "___" }, "yields no instance name"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := createReq("bad-1", zoneA)
			tc.mut(req)
			_, err := e.be.Create(ctxT(t), req)
			if !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Create = %v, want Permanent with %q", err, tc.want)
			}
		})
	}
	if n := len(e.fake.Requests()); n != 0 {
		t.Errorf("%d requests for refused creates, want none", n)
	}
}

// A proxy's credentials are instance metadata keys named as the NoCloud
// backends' meta-data keys, next to user-data; the wire log, even with
// payloads, shows neither.
func TestCreateDeliversCredentials(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil, func(o *Options) { o.WirePayloads = true })
	const uid = "0b6f1c2e-7d4a-4f5e-9c3b-2a1d0e9f8c7c"
	req := createReq(uid, zoneA)
	req.Credentials = &proxyv1.ProxyCredentials{Username: "egress-0a1b2c3d4e5f", Password: "Zq9-xY_0aBcDeFgHiJkLmNoPqRsTuVwX"}
	if _, err := e.be.Create(ctxT(t), req); err != nil {
		t.Fatal(err)
	}
	in := e.fake.Instance(zoneA, "proxy-"+uid)
	if in == nil {
		t.Fatal("the fake holds no instance")
	}
	got := map[string]string{}
	for _, it := range in.GetMetadata().GetItems() {
		got[it.GetKey()] = it.GetValue()
	}
	want := map[string]string{"user-data": cloudInit, "egress_proxy_user": "egress-0a1b2c3d4e5f", "egress_proxy_password": "Zq9-xY_0aBcDeFgHiJkLmNoPqRsTuVwX"}
	if !maps.Equal(got, want) {
		t.Errorf("instance metadata %v, want %v", got, want)
	}
	if _, err := e.be.Get(ctxT(t), &provisionerv1.GetInstanceRequest{ProviderId: "zones/" + zoneA + "/instances/proxy-" + uid, ProxyUid: uid}); err != nil {
		t.Fatal(err)
	}
	logs := e.logs.String()
	if strings.Contains(logs, req.Credentials.Password) || strings.Contains(logs, req.Credentials.Username) || !strings.Contains(logs, `"requestBody"`) {
		t.Errorf("the wire log shows the credentials, or no body (the check would prove nothing):\n%s", logs)
	}
}
