package gcp

import (
	"errors"
	"net/http"
	"strings"
	"testing"

	"cloud.google.com/go/compute/apiv1/computepb"
	"github.com/googleapis/gax-go/v2/apierror"
	"google.golang.org/api/googleapi"
	"google.golang.org/protobuf/proto"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/services/provisioner-gcp/internal/gcpfake"
)

// TestClassifySynchronousErrors sends each error body through the real
// SDK (an insert the fake fails) and checks the class Create answers.
func TestClassifySynchronousErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		code   int
		reason string
		msg    string
		want   errclass.Class
	}{
		{400, "invalid", "Invalid value for field 'resource.machineType': 'zones/x/machineTypes/y'.", errclass.Permanent},
		{400, "resourceNotReady", "The resource 'projects/p/zones/z/instances/x' is not ready", errclass.Transient},
		{401, "authError", "Request had invalid authentication credentials.", errclass.Permanent},
		{403, "forbidden", "Required 'compute.instances.create' permission for 'projects/p/zones/z/instances/x'", errclass.Permanent},
		{403, "accessNotConfigured", "Compute Engine API has not been used in project 1 before or it is disabled.", errclass.Permanent},
		{403, "quotaExceeded", "Quota 'INSTANCES' exceeded.  Limit: 24.0 in region europe-west1.", errclass.QuotaExceeded},
		{403, "rateLimitExceeded", "Rate Limit Exceeded", errclass.QuotaExceeded},
		{403, "userRateLimitExceeded", "User Rate Limit Exceeded", errclass.QuotaExceeded},
		{429, "rateLimitExceeded", "Quota exceeded for quota metric 'Queries'", errclass.QuotaExceeded},
		{409, "resourceInUseByAnotherResource", "The resource is in use", errclass.Transient},
		{409, "conflict", "The resource is being changed", errclass.Transient},
		{412, "conditionNotMet", "Supplied fingerprint does not match current metadata fingerprint.", errclass.Transient},
		{404, "notFound", "The resource 'projects/p/global/images/family/x' was not found", errclass.Transient}, // Create never answers NotFound
		{500, "backendError", "Internal error. Please try again or contact Google Support.", errclass.Transient},
		{502, "badGateway", "Bad Gateway", errclass.Transient},
		{503, "backendError", "Service unavailable", errclass.Transient},
		{504, "deadlineExceeded", "Deadline exceeded", errclass.Transient},
	}
	for _, tc := range tests {
		t.Run(tc.reason, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			e.fake.Inject(gcpfake.Fault{Method: http.MethodPost, PathContains: "/instances", Code: tc.code, Reason: tc.reason, Message: tc.msg})
			_, err := e.be.Create(ctxT(t), createReq("cls-1", zoneA))
			if got := errclass.Of(err); got != tc.want {
				t.Errorf("%d %s: class %v, want %v (%v)", tc.code, tc.reason, got, tc.want, err)
			}
			if !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("message %q lacks the API's %q", err, tc.msg)
			}
			// The SDK's types are reachable through the classified error.
			var ae *apierror.APIError
			var ge *googleapi.Error
			if !errors.As(err, &ae) || !errors.As(err, &ge) || ge.Code != tc.code {
				t.Errorf("errors.As: APIError %v googleapi.Error %v", ae != nil, ge)
			}
		})
	}
}

func TestClassifyGetNotFound(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	_, err := e.be.getInstance(ctxT(t), mustClient(t, e), zoneA, "proxy-nothing")
	if !errclass.Is(err, errclass.NotFound) {
		t.Fatalf("%v, want NotFound", err)
	}
}

func TestClassifyNetworkError(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.srv.Close()
	_, err := e.be.Create(ctxT(t), createReq("net-1", zoneA))
	if !errclass.Is(err, errclass.Transient) || !strings.Contains(err.Error(), "connect") {
		t.Fatalf("Create against a closed server = %v, want Transient", err)
	}
}

func TestOperationErrorTable(t *testing.T) {
	t.Parallel()
	op := func(status int32, codes ...string) *computepb.Operation {
		o := &computepb.Operation{Name: proto.String("operation-1"), OperationType: proto.String("insert"), Status: computepb.Operation_DONE.Enum()}
		if status != 0 {
			o.HttpErrorStatusCode = proto.Int32(status)
		}
		if len(codes) > 0 {
			o.Error = &computepb.Error{}
			for _, c := range codes {
				o.Error.Errors = append(o.Error.Errors, &computepb.Errors{Code: proto.String(c), Message: proto.String("m")})
			}
		}
		return o
	}
	tests := []struct {
		name string
		op   *computepb.Operation
		want errclass.Class
	}{
		{"done", op(0), 0},
		{"quota", op(403, "QUOTA_EXCEEDED"), errclass.QuotaExceeded},
		{"pool exhausted", op(503, "ZONE_RESOURCE_POOL_EXHAUSTED"), errclass.QuotaExceeded},
		{"pool exhausted with details", op(503, "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"), errclass.QuotaExceeded},
		{"resource exhausted", op(429, "RESOURCE_EXHAUSTED"), errclass.QuotaExceeded},
		{"bad image", op(400, "RESOURCE_NOT_FOUND"), errclass.Permanent},
		{"not ready", op(400, "RESOURCE_NOT_READY"), errclass.Transient},
		{"permission", op(403, "PERMISSIONS_ERROR"), errclass.Permanent},
		{"internal", op(500, "INTERNAL_ERROR"), errclass.Transient},
		{"code only", op(503), errclass.Transient},
		{"no status", op(0, "QUOTA_EXCEEDED"), errclass.QuotaExceeded},
	}
	for _, tc := range tests {
		err := operationError(tc.op)
		if got := errclass.Of(err); got != tc.want {
			t.Errorf("%s: %v (%v), want %v", tc.name, got, err, tc.want)
		}
	}
}

func mustClient(t *testing.T, e *env) *clients {
	t.Helper()
	c, err := e.be.client(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	return c
}
