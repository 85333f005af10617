package gcpfake

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/proto"
)

// TestWireShapes checks the fake's raw answers: Compute's error body,
// protojson instances, operations stepping to DONE, aggregated lists with
// scope warnings, unreachables and pages.
func TestWireShapes(t *testing.T) {
	t.Parallel()
	f := New(Options{Project: "p1", Zones: []string{"europe-west1-b", "europe-west1-c", "asia-east1-a"}, UnreachableZones: []string{"asia-east1-a"}})
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, body := get("/compute/v1/projects/p1/zones/europe-west1-b/instances/nope")
	var e struct {
		Error struct {
			Code    int
			Message string
			Errors  []struct{ Message, Domain, Reason string }
		}
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil || code != 404 || e.Error.Code != 404 ||
		e.Error.Message != "The resource 'projects/p1/zones/europe-west1-b/instances/nope' was not found" ||
		len(e.Error.Errors) != 1 || e.Error.Errors[0].Reason != "notFound" || e.Error.Errors[0].Domain != "global" {
		t.Errorf("404 = %d %s", code, body)
	}

	f.Put("europe-west1-b", &computepb.Instance{Name: proto.String("a"), Id: proto.Uint64(123), Labels: map[string]string{"m": "true"}})
	f.Put("europe-west1-b", &computepb.Instance{Name: proto.String("b"), Labels: map[string]string{"m": "true"}})
	f.Put("europe-west1-c", &computepb.Instance{Name: proto.String("c"), Labels: map[string]string{"m": "false"}})
	if _, body := get("/compute/v1/projects/p1/zones/europe-west1-b/instances/a"); !strings.Contains(body, `"id":"123"`) || !strings.Contains(body, `"selfLink":"https://www.googleapis.com/compute/v1/projects/p1/zones/europe-west1-b/instances/a"`) {
		t.Errorf("instance JSON %s: want quoted int64 and camelCase", body)
	}

	if code, _ := get("/compute/v1/projects/p1/aggregated/instances"); code != 503 {
		t.Errorf("aggregated list with an unreachable zone and no returnPartialSuccess: %d, want 503", code)
	}
	code, body = get("/compute/v1/projects/p1/aggregated/instances?returnPartialSuccess=true&filter=labels.m+%3D+true&maxResults=1")
	var list computepbList
	if err := json.Unmarshal([]byte(body), &list); err != nil || code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	if list.NextPageToken == "" || len(list.Items["zones/europe-west1-b"].Instances) != 1 ||
		list.Items["zones/europe-west1-c"].Warning.Code != "NO_RESULTS_ON_PAGE" ||
		list.Items["zones/asia-east1-a"].Warning.Code != "UNREACHABLE" || strings.Join(list.Unreachables, ",") != "zones/asia-east1-a" {
		t.Errorf("page 1: %s", body)
	}
	_, body = get("/compute/v1/projects/p1/aggregated/instances?returnPartialSuccess=true&filter=labels.m+%3D+true&maxResults=1&pageToken=" + list.NextPageToken)
	list = computepbList{}
	_ = json.Unmarshal([]byte(body), &list)
	if list.NextPageToken != "" || len(list.Items["zones/europe-west1-b"].Instances) != 1 || list.Items["zones/europe-west1-b"].Instances[0].Name != "b" {
		t.Errorf("page 2: %s", body)
	}
	if code, body := get("/compute/v1/projects/p1/aggregated/instances?returnPartialSuccess=true&filter=name+eq+x"); code != 400 || !strings.Contains(body, "Invalid value for field 'filter'") {
		t.Errorf("bad filter: %d %s", code, body)
	}

	// A delete is an operation that steps PENDING → RUNNING → DONE, and
	// the instance goes at DONE.
	req, _ := http.NewRequest(http.MethodDelete, srv.URL+"/compute/v1/projects/p1/zones/europe-west1-b/instances/a", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var op struct{ Name, Status, OperationType, Kind string }
	_ = json.NewDecoder(resp.Body).Decode(&op)
	resp.Body.Close()
	if op.Kind != "compute#operation" || op.Status != "PENDING" || op.OperationType != "delete" || !strings.HasPrefix(op.Name, "operation-") {
		t.Fatalf("delete answered %+v", op)
	}
	for _, want := range []string{"RUNNING", "DONE"} {
		_, body := get("/compute/v1/projects/p1/zones/europe-west1-b/operations/" + op.Name)
		if !strings.Contains(body, `"status":"`+want+`"`) {
			t.Errorf("operation %s, want %s", body, want)
		}
	}
	if f.Instance("europe-west1-b", "a") != nil {
		t.Errorf("instance still there after its delete operation is DONE")
	}
	if code, _ := get("/compute/v1/projects/other/zones/europe-west1-b/instances/a"); code != 404 {
		t.Errorf("another project: %d", code)
	}
}

type computepbList struct {
	Items map[string]struct {
		Instances []struct{ Name string }
		Warning   struct{ Code, Message string }
	}
	NextPageToken string
	Unreachables  []string
}
