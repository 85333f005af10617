package gcp

import (
	"context"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/services/provisioner-gcp/internal/gcpfake"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
		// the auth library's token refresher and the OpenCensus-era
		// default worker the SDK starts once per process
		goleak.IgnoreAnyFunction("go.opencensus.io/stats/view.(*worker).start"))
}

const (
	project   = "egress-test"
	zoneA     = "europe-west1-b"
	zoneB     = "europe-west1-c"
	zoneQuota = "us-central1-a"
	zoneFull  = "us-central1-f"
	zoneDown  = "asia-east1-a"
	cloudInit = "#cloud-config\r\nwrite_files:\n- path: /etc/secret\n  content: \"cl0ud-1n1t-s3cr3t ünïcode \\t\"\n   \n"
	debian    = "projects/debian-cloud/global/images/family/debian-13"
)

var fixedNow = time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)

type env struct {
	fake *gcpfake.Fake
	srv  *httptest.Server
	be   *Backend
	cfg  Config
	logs *logtest.Buffer
}

// newEnv starts a fake Compute API and a backend whose real SDK client
// talks to it without authentication; mut adjusts the config first.
func newEnv(t testing.TB, mut func(*Config), opts ...func(*Options)) *env {
	t.Helper()
	fake := gcpfake.New(gcpfake.Options{Project: project, Zones: []string{zoneA, zoneB, zoneQuota, zoneFull, zoneDown},
		QuotaZones: []string{zoneQuota}, ExhaustedZones: []string{zoneFull}})
	srv := httptest.NewServer(fake)
	t.Cleanup(srv.Close)
	e := &env{fake: fake, srv: srv, logs: &logtest.Buffer{}}
	e.cfg = Config{
		Project: project, Zones: []string{zoneA, zoneB, zoneQuota, zoneFull},
		MachineTypes: []string{"e2-small", "e2-medium"},
		Images:       map[string]string{"debian-13": debian},
		Endpoint:     srv.URL, WithoutAuthentication: true,
	}
	if mut != nil {
		mut(&e.cfg)
	}
	o := Options{Poll: time.Millisecond, Now: func() time.Time { return fixedNow }}
	for _, f := range opts {
		f(&o)
	}
	be, err := New("gcp-test", e.cfg, slog.New(slog.NewJSONHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug})), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = be.Close() })
	e.be = be
	return e
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func createReq(uid, zone string) *provisionerv1.CreateInstanceRequest {
	return &provisionerv1.CreateInstanceRequest{
		Provider: "gcp-test", ProxyUid: uid, ProxyName: "p-" + uid, CloudInit: cloudInit, Port: 3128,
		Placement: &proxyv1.Placement{Zone: zone, MachineType: "e2-small", Image: "debian-13"},
	}
}

// requests counts the fake's requests with method whose path contains sub.
func (e *env) requests(method, sub string) []gcpfake.Request {
	var out []gcpfake.Request
	for _, r := range e.fake.Requests() {
		if r.Method == method && strings.Contains(r.Path, sub) {
			out = append(out, r)
		}
	}
	return out
}
