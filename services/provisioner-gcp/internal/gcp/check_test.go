package gcp

import (
	"context"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/proto"

	"github.com/egress-proxies/egress-proxies/services/provisioner-gcp/internal/gcpfake"
)

// TestCheckOneRequest: one request with maxResults=1 even though the
// project holds more and a next page exists.
func TestCheckOneRequest(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	for _, n := range []string{"proxy-c1", "proxy-c2", "proxy-c3"} {
		e.fake.Put(zoneA, &computepb.Instance{Name: proto.String(n), Status: proto.String("RUNNING"), Labels: ours(n)})
	}
	got := e.be.Check(ctxT(t))
	if len(got) != 1 {
		t.Fatalf("%d targets, want 1", len(got))
	}
	ts := got[0]
	if !ts.GetReady() || ts.GetReason() != provisioner.ReasonReachable || ts.GetName() != project || ts.GetAddress() != e.srv.URL || ts.GetLatency() == nil {
		t.Errorf("Check = %v", ts)
	}
	reqs := e.fake.Requests()
	if len(reqs) != 1 {
		t.Fatalf("%d requests, want exactly 1", len(reqs))
	}
	r := reqs[0]
	if r.Path != "/compute/v1/projects/"+project+"/aggregated/instances" || r.Query["maxResults"][0] != "1" ||
		r.Query["filter"][0] != managedFilter || r.Query["returnPartialSuccess"][0] != "true" {
		t.Errorf("request %s %v", r.Path, r.Query)
	}
}

func TestCheckReasons(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		fault  *gcpfake.Fault
		mut    func(t *testing.T, e *env)
		reason string
		detail string
	}{
		{name: "unauthorized", fault: &gcpfake.Fault{Code: 401, Reason: "authError", Message: "Request had invalid authentication credentials."}, reason: provisioner.ReasonUnauthorized, detail: "authError"},
		{name: "forbidden", fault: &gcpfake.Fault{Code: 403, Reason: "forbidden", Message: "Required 'compute.instances.list' permission for 'projects/" + project + "'"}, reason: provisioner.ReasonForbidden, detail: "forbidden"},
		{name: "api disabled", fault: &gcpfake.Fault{Code: 403, Reason: "accessNotConfigured", Message: "Compute Engine API has not been used in project 123 before or it is disabled."}, reason: provisioner.ReasonForbidden, detail: "accessNotConfigured"},
		{name: "server error", fault: &gcpfake.Fault{Code: 500, Reason: "backendError", Message: "Internal error."}, reason: provisioner.ReasonAPIError, detail: "backendError"},
		{name: "unreachable", mut: func(t *testing.T, e *env) { e.srv.Close() }, reason: provisioner.ReasonUnreachable},
		{name: "credentials missing", mut: func(t *testing.T, e *env) {}, reason: provisioner.ReasonCredentialsUnavailable},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, func(c *Config) {
				if tc.name == "credentials missing" {
					c.WithoutAuthentication = false
					c.CredentialsFile = filepath.Join(t.TempDir(), "sa.json")
				}
			})
			if tc.fault != nil {
				e.fake.Inject(*tc.fault)
			}
			if tc.mut != nil {
				tc.mut(t, e)
			}
			ts := e.be.Check(ctxT(t))[0]
			if ts.GetReady() || ts.GetReason() != tc.reason || ts.GetMessage() == "" {
				t.Errorf("Check = %v, want %s", ts, tc.reason)
			}
			if tc.fault != nil && (ts.GetDetails()["reason"] != tc.detail || !strings.Contains(ts.GetMessage(), tc.fault.Message)) {
				t.Errorf("details %v message %q", ts.GetDetails(), ts.GetMessage())
			}
		})
	}
}

func TestCheckTimeout(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(hang.Close)
	t.Cleanup(func() { close(release) })
	e := newEnv(t, func(c *Config) { c.Endpoint = hang.URL; c.RequestTimeoutSeconds = 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if ts := e.be.Check(ctx)[0]; ts.GetReady() || ts.GetReason() != provisioner.ReasonTimeout {
		t.Errorf("Check = %v, want Timeout", ts)
	}
}

// A credentials file that is not a key: Permanent on every call, and the
// health check says CredentialsUnavailable without quoting the file.
func TestCheckUnparseableCredentials(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "sa.json")
	if err := os.WriteFile(path, []byte(`{"type":"service_account","client_email":"x@y","private_key":"s3cr3t-not-pem"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, func(c *Config) { c.WithoutAuthentication = false; c.CredentialsFile = path })
	ts := e.be.Check(ctxT(t))[0]
	if ts.GetReason() != provisioner.ReasonCredentialsUnavailable || strings.Contains(ts.GetMessage(), "s3cr3t") {
		t.Errorf("Check = %v", ts)
	}
}
