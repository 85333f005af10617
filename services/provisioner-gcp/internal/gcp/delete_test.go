package gcp

import (
	"testing"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/proto"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/services/provisioner-gcp/internal/gcpfake"
)

func TestDelete(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	const uid = "del-1"
	in, err := e.be.Create(ctxT(t), createReq(uid, zoneA))
	if err != nil {
		t.Fatal(err)
	}
	req := &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uid}
	deleted, err := e.be.Delete(ctxT(t), req)
	if err != nil || !deleted {
		t.Fatalf("Delete = %v %v, want deleted", deleted, err)
	}
	if e.fake.Instance(zoneA, "proxy-"+uid) != nil {
		t.Errorf("the instance is still there after its delete operation finished")
	}
	// Idempotent: gone is success.
	deleted, err = e.be.Delete(ctxT(t), req)
	if err != nil || deleted {
		t.Fatalf("second Delete = %v %v, want (false, nil)", deleted, err)
	}
	if _, err := e.be.Get(ctxT(t), &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uid}); !errclass.Is(err, errclass.NotFound) {
		t.Errorf("Get after delete = %v, want NotFound", err)
	}
}

func TestDeleteLeavesOthersAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-a"), Status: proto.String("RUNNING"), Labels: ours("a")})
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-b"), Status: proto.String("RUNNING"), Labels: map[string]string{"team": "web"}})
	for _, name := range []string{"proxy-a", "proxy-b"} {
		deleted, err := e.be.Delete(ctxT(t), &provisionerv1.DeleteInstanceRequest{ProviderId: "zones/" + zoneA + "/instances/" + name, ProxyUid: "mine"})
		if err != nil || deleted {
			t.Errorf("Delete(%s) = %v %v, want left alone", name, deleted, err)
		}
	}
	if len(e.requests("DELETE", "")) != 0 || e.fake.Instances() != 2 {
		t.Errorf("a foreign instance was deleted")
	}
}

// TestDeleteVanishedMeanwhile: the instance was readable, then the delete
// answers 404 (deleted by someone else in between): success.
func TestDeleteVanishedMeanwhile(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-v"), Status: proto.String("RUNNING"), Labels: ours("v")})
	e.fake.Inject(gcpfake.Fault{Method: "DELETE", PathContains: "/instances/proxy-v", Code: 404, Reason: "notFound",
		Message: "The resource 'projects/" + project + "/zones/" + zoneA + "/instances/proxy-v' was not found", Times: 1})
	deleted, err := e.be.Delete(ctxT(t), &provisionerv1.DeleteInstanceRequest{ProviderId: "zones/" + zoneA + "/instances/proxy-v", ProxyUid: "v"})
	if err != nil || deleted {
		t.Fatalf("Delete = %v %v, want (false, nil)", deleted, err)
	}
}

func TestDeleteWithoutWaiting(t *testing.T) {
	t.Parallel()
	zero := 0
	e := newEnv(t, func(c *Config) { c.OperationWaitSeconds = &zero })
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-w"), Status: proto.String("RUNNING"), Labels: ours("w")})
	deleted, err := e.be.Delete(ctxT(t), &provisionerv1.DeleteInstanceRequest{ProviderId: "zones/" + zoneA + "/instances/proxy-w", ProxyUid: "w"})
	if err != nil || !deleted {
		t.Fatalf("Delete = %v %v", deleted, err)
	}
	// Get observes the deletion: STOPPING, then gone.
	pid := &provisionerv1.GetInstanceRequest{ProviderId: "zones/" + zoneA + "/instances/proxy-w", ProxyUid: "w"}
	got, err := e.be.Get(ctxT(t), pid)
	if err != nil || got.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_STOPPED {
		t.Fatalf("Get right after = %v %v, want STOPPED (STOPPING)", got, err)
	}
	if _, err := e.be.Get(ctxT(t), pid); !errclass.Is(err, errclass.NotFound) {
		t.Fatalf("Get later = %v, want NotFound", err)
	}
}
