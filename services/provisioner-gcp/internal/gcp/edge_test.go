package gcp

import (
	"strings"
	"testing"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/proto"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/services/provisioner-gcp/internal/gcpfake"
)

// TestCreateNeverAnswersAnUnseenInstance: an insert answering 409
// alreadyExists whose Get then answers 404 (the instance is being
// deleted) is Transient, not an instance.
func TestCreateNeverAnswersAnUnseenInstance(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.fake.Inject(gcpfake.Fault{Method: "POST", PathContains: "/instances", Code: 409, Reason: "alreadyExists",
		Message: "The resource 'projects/egress-test/zones/europe-west1-b/instances/proxy-gone-1' already exists", Times: 1})
	in, err := e.be.Create(ctxT(t), createReq("gone-1", zoneA))
	if !errclass.Is(err, errclass.Transient) || !strings.Contains(err.Error(), "being deleted") {
		t.Fatalf("Create = %v, %v; want Transient saying the instance is being deleted", in, err)
	}
	var ce *errclass.Error
	if !errorsAs(err, &ce) || ce.Metadata["zone"] != zoneA || ce.Metadata["name"] != "proxy-gone-1" {
		t.Errorf("metadata %v, want zone and name", ce)
	}
}

// TestCreateWaitsForItsDyingInstance: Create for a proxy whose instance
// is being deleted is Transient until the name is free, then inserts a
// new instance.
func TestCreateWaitsForItsDyingInstance(t *testing.T) {
	t.Parallel()
	zero := 0
	e := newEnv(t, func(c *Config) { c.OperationWaitSeconds = &zero })
	ctx := ctxT(t)
	req := createReq("dying-1", zoneA)
	first, err := e.be.Create(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	// The delete's operation is left running: the instance is STOPPING.
	if _, err := e.be.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: first.GetProviderId(), ProxyUid: "dying-1"}); err != nil {
		t.Fatal(err)
	}
	var answers []string
	for i := 0; i < 5; i++ {
		in, err := e.be.Create(ctx, req)
		if err == nil {
			if st := e.fake.Instance(zoneA, "proxy-dying-1").GetStatus(); st == "STOPPING" {
				t.Fatalf("Create answered %v while the instance is %s", in, st)
			}
			break
		}
		if !errclass.Is(err, errclass.Transient) {
			t.Fatalf("Create while the instance is deleted = %v, want Transient", err)
		}
		answers = append(answers, err.Error())
	}
	if len(answers) == 0 || !strings.Contains(answers[0], "stopping") {
		t.Errorf("answers while deleting %q, want the first to say the instance is stopping", answers)
	}
	if got := e.fake.Instance(zoneA, "proxy-dying-1"); got == nil || got.GetStatus() == "STOPPING" {
		t.Errorf("after the retries the instance is %v, want a new one", got)
	}
	if n := len(e.requests("POST", "/instances")); n < 2 {
		t.Errorf("%d inserts, want the first and the new one", n)
	}
}

// TestCreateStartsItsStoppedInstance: our own TERMINATED instance is
// started, not answered as STOPPED.
func TestCreateStartsItsStoppedInstance(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-stopped-1"), Status: proto.String("TERMINATED"),
		Labels: map[string]string{labelManaged: labelManagedOn, labelUID: "stopped-1", labelCreatedAt: "1764756000"}})
	in, err := e.be.Create(ctxT(t), createReq("stopped-1", zoneA))
	if err != nil {
		t.Fatal(err)
	}
	if in.GetState() == provisionerv1.InstanceState_INSTANCE_STATE_STOPPED {
		t.Errorf("Create answered STOPPED for its stopped instance")
	}
	if n := len(e.requests("POST", "/instances/proxy-stopped-1/start")); n != 1 {
		t.Errorf("%d starts, want 1", n)
	}
	if st := e.fake.Instance(zoneA, "proxy-stopped-1").GetStatus(); st == "TERMINATED" {
		t.Errorf("instance still %s", st)
	}
}

// TestPersistent503KeepsTheCause: a Get that Compute answers 503 until its
// deadline says so, with the status and reason in the metadata.
func TestPersistent503KeepsTheCause(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.RequestTimeoutSeconds = 1 })
	e.fake.Inject(gcpfake.Fault{Method: "GET", PathContains: "/instances/proxy-busy-1", Code: 503, Reason: "backendError", Message: "Internal error. Please try again."})
	_, err := e.be.Get(ctxT(t), &provisionerv1.GetInstanceRequest{ProviderId: "zones/" + zoneA + "/instances/proxy-busy-1", ProxyUid: "busy-1"})
	if !errclass.Is(err, errclass.Transient) || !strings.Contains(err.Error(), "503") || !strings.Contains(err.Error(), "Internal error") {
		t.Fatalf("Get = %v, want Transient naming Compute's 503", err)
	}
	var ce *errclass.Error
	if !errorsAs(err, &ce) || ce.Metadata["httpStatus"] != "503" || ce.Metadata["reason"] != "backendError" {
		t.Errorf("metadata %v, want httpStatus 503 and reason backendError", ce)
	}
	if n := len(e.requests("GET", "/instances/proxy-busy-1")); n < 2 {
		t.Errorf("%d Gets, want the SDK's retries", n)
	}
}

// TestInsert404KeepsItsMetadata: an insert answering 404 (an image or
// network that does not exist) is Transient for Create, with Compute's
// status like every other API error.
func TestInsert404KeepsItsMetadata(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.fake.Inject(gcpfake.Fault{Method: "POST", PathContains: "/instances", Code: 404, Reason: "notFound", Message: "The resource 'projects/debian-cloud/global/images/family/debian-13' was not found", Times: 1})
	_, err := e.be.Create(ctxT(t), createReq("nf-1", zoneA))
	var ce *errclass.Error
	if !errclass.Is(err, errclass.Transient) || !errorsAs(err, &ce) || ce.Metadata["httpStatus"] != "404" || ce.Metadata["reason"] != "notFound" {
		t.Fatalf("Create = %v (metadata %v), want Transient with httpStatus 404 and reason notFound", err, ce)
	}
}
