package gcp

import (
	"fmt"
	"net/http/httptest"
	"sort"
	"strings"
	"testing"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/proto"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/services/provisioner-gcp/internal/gcpfake"
)

// TestListEveryPage: seven managed instances over two zones, pages of
// three: every page is read, scopes without results on a page carry
// NO_RESULTS_ON_PAGE, unmanaged instances are filtered out by the API.
func TestListEveryPage(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil, func(o *Options) { o.ListPageSize = 3 })
	var want []string
	for i := range 7 {
		zone := []string{zoneA, zoneB}[i%2]
		name := fmt.Sprintf("proxy-l%d", i)
		e.fake.Put(zone, &computepb.Instance{Name: proto.String(name), Status: proto.String("RUNNING"), Labels: ours(fmt.Sprint("l", i)), NetworkInterfaces: nic()})
		want = append(want, "zones/"+zone+"/instances/"+name)
	}
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("web-1"), Status: proto.String("RUNNING"), Labels: map[string]string{"team": "web"}})
	got, err := e.be.List(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, in := range got {
		ids = append(ids, in.GetProviderId())
		if in.GetProxyUid() == "" || in.GetCreateTime() == nil || in.GetIp() == "" {
			t.Errorf("listed %v without uid, create time or address", in)
		}
	}
	sort.Strings(ids)
	sort.Strings(want)
	if strings.Join(ids, " ") != strings.Join(want, " ") {
		t.Errorf("listed\n %v\nwant\n %v", ids, want)
	}
	reqs := e.requests("GET", "/aggregated/instances")
	if len(reqs) != 3 {
		t.Fatalf("%d list requests, want 3 pages", len(reqs))
	}
	for i, r := range reqs {
		q := func(k string) string {
			if v := r.Query[k]; len(v) > 0 {
				return v[0]
			}
			return ""
		}
		if q("filter") != "labels.proxy-operator-managed = true" || q("returnPartialSuccess") != "true" || q("maxResults") != "3" {
			t.Errorf("page %d query %v", i, r.Query)
		}
		if (i == 0) != (q("pageToken") == "") {
			t.Errorf("page %d pageToken %q", i, q("pageToken"))
		}
	}
	if strings.Contains(e.logs.String(), "WARNING: gcp zones") {
		t.Errorf("NO_RESULTS_ON_PAGE was reported as a problem:\n%s", e.logs)
	}
}

// TestListPartialSuccess: a zone that does not answer is reported with a
// WARNING and the other zones are still listed.
func TestListPartialSuccess(t *testing.T) {
	t.Parallel()
	fake := gcpfake.New(gcpfake.Options{Project: project, Zones: []string{zoneA, zoneDown}, UnreachableZones: []string{zoneDown}})
	srv := httptest.NewServer(fake)
	t.Cleanup(srv.Close)
	e := newEnv(t, func(c *Config) { c.Endpoint = srv.URL })
	e.fake = fake
	fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-up"), Status: proto.String("RUNNING"), Labels: ours("up")})
	fake.Put(zoneDown, &computepb.Instance{Name: proto.String("proxy-down"), Status: proto.String("RUNNING"), Labels: ours("down")})
	got, err := e.be.List(ctxT(t))
	if err != nil {
		t.Fatalf("List = %v, want the reachable zone listed", err)
	}
	if len(got) != 1 || got[0].GetName() != "proxy-up" {
		t.Errorf("listed %v, want proxy-up only", got)
	}
	logs := e.logs.String()
	if !strings.Contains(logs, "WARNING: gcp zones did not answer the instance list") || !strings.Contains(logs, "zones/"+zoneDown) {
		t.Errorf("no WARNING naming the unreachable zone:\n%s", logs)
	}
}

func TestListFailsWhole(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil, func(o *Options) { o.ListPageSize = 1 })
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-1"), Status: proto.String("RUNNING"), Labels: ours("1")})
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-2"), Status: proto.String("RUNNING"), Labels: ours("2")})
	// The second page fails: List must not answer a partial list as if
	// it were complete (orphan GC would think the rest are gone).
	e.fake.Inject(gcpfake.Fault{Method: "GET", PathContains: "/aggregated/", Code: 503, Reason: "backendError", Message: "Internal error.", Times: 0})
	if _, err := e.be.List(ctxT(t)); !errclass.Is(err, errclass.Transient) {
		t.Fatalf("List = %v, want Transient", err)
	}
}
