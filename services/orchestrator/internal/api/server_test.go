package api_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

func TestCreateValidation(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	ext := func(host string, port uint32) *proxyv1.ProxySpec {
		return &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: host, Port: port}}
	}
	mgd := func(mut func(*proxyv1.ProxySpec)) *proxyv1.ProxySpec {
		s := orchtest.Managed("x").GetSpec()
		mut(s)
		return s
	}
	cases := []struct {
		name      string
		req       *proxyv1.CreateProxyRequest
		wantField string
	}{
		{"empty name", &proxyv1.CreateProxyRequest{Spec: orchtest.Managed("x").GetSpec()}, "name: does not match regex pattern"},
		{"upper-case name", &proxyv1.CreateProxyRequest{Name: "Proxy1", Spec: orchtest.Managed("x").GetSpec()}, "name: does not match regex pattern"},
		{"name too long", &proxyv1.CreateProxyRequest{Name: strings.Repeat("a", 64), Spec: orchtest.Managed("x").GetSpec()}, "name:"},
		{"no spec", &proxyv1.CreateProxyRequest{Name: "a"}, "spec: value is required"},
		{"no mode", &proxyv1.CreateProxyRequest{Name: "a", Spec: &proxyv1.ProxySpec{}}, "spec.mode: value is required"},
		{"NUL in the zone", &proxyv1.CreateProxyRequest{Name: "a", Spec: mgd(func(s *proxyv1.ProxySpec) { s.Placement.Zone = "z1\x00" })}, "spec.placement.zone: must be printable text"},
		{"newline in the zone", &proxyv1.CreateProxyRequest{Name: "a", Spec: mgd(func(s *proxyv1.ProxySpec) { s.Placement.Zone = "z1\nz2" })}, "spec.placement.zone: must be printable text"},
		{"managed without provider", &proxyv1.CreateProxyRequest{Name: "a", Spec: mgd(func(s *proxyv1.ProxySpec) { s.Provider = "" })}, "spec.provider: required"},
		{"unconfigured provider", &proxyv1.CreateProxyRequest{Name: "a", Spec: mgd(func(s *proxyv1.ProxySpec) { s.Provider = "gcp-eu" })}, `spec.provider: "gcp-eu" is not configured (configured: fake, other)`},
		{"managed with endpoint", &proxyv1.CreateProxyRequest{Name: "a", Spec: mgd(func(s *proxyv1.ProxySpec) { s.Endpoint = &proxyv1.Endpoint{Host: "h", Port: 1} })}, "spec.endpoint: only EXTERNAL"},
		{"port out of range", &proxyv1.CreateProxyRequest{Name: "a", Spec: mgd(func(s *proxyv1.ProxySpec) { s.Port = 70000 })}, "spec.port: must be less than or equal to 65535"},
		{"cloud-init too large", &proxyv1.CreateProxyRequest{Name: "a", Spec: mgd(func(s *proxyv1.ProxySpec) { s.CloudInit = strings.Repeat("x", 64<<10+1) })}, "spec.cloud_init: must be at most 65536 bytes"},
		{"external without endpoint", &proxyv1.CreateProxyRequest{Name: "a", Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL}}, "spec.endpoint: required for EXTERNAL"},
		{"external bad host", &proxyv1.CreateProxyRequest{Name: "a", Spec: ext("bad host!", 3128)}, "spec.endpoint.host:"},
		{"external port 0", &proxyv1.CreateProxyRequest{Name: "a", Spec: ext("10.0.0.5", 0)}, "spec.endpoint.port: must be greater than or equal to 1"},
		{"external with provider", &proxyv1.CreateProxyRequest{Name: "a", Spec: func() *proxyv1.ProxySpec { s := ext("h.example", 80); s.Provider = "fake"; return s }()}, "spec.provider: EXTERNAL proxies are not provisioned"},
		{"external with cloud-init", &proxyv1.CreateProxyRequest{Name: "a", Spec: func() *proxyv1.ProxySpec { s := ext("h.example", 80); s.CloudInit = "x"; return s }()}, "spec.cloud_init: EXTERNAL"},
		{"bad label key", &proxyv1.CreateProxyRequest{Name: "a", Labels: map[string]string{"-x": "y"}, Spec: orchtest.Managed("x").GetSpec()}, `labels["-x"]: does not match regex pattern`},
		{"bad label value", &proxyv1.CreateProxyRequest{Name: "a", Labels: map[string]string{"x": "a b"}, Spec: orchtest.Managed("x").GetSpec()}, `labels["x"]: does not match regex pattern`},
		{"probe interval too short", &proxyv1.CreateProxyRequest{Name: "a", Spec: mgd(func(s *proxyv1.ProxySpec) {
			s.HealthCheck = &proxyv1.HealthCheckSpec{Interval: durationpb.New(time.Millisecond)}
		})}, "spec.health_check.interval: must be greater than or equal to 0.1s"},
		{"timeout over interval", &proxyv1.CreateProxyRequest{Name: "a", Spec: mgd(func(s *proxyv1.ProxySpec) {
			s.HealthCheck = &proxyv1.HealthCheckSpec{Interval: durationpb.New(time.Second), Timeout: durationpb.New(2 * time.Second)}
		})}, "spec.health_check.timeout: 2s is longer than the interval 1s"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := h.Client.CreateProxy(context.Background(), tc.req)
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), tc.wantField) {
				t.Errorf("err = %v, want InvalidArgument naming %q", err, tc.wantField)
			}
		})
	}
	// Nothing was half-applied.
	rows, _, err := h.Store.List(context.Background(), store.Filter{Limit: 10})
	if err != nil || len(rows) != 0 {
		t.Errorf("proxies after rejected creates: %d (err %v)", len(rows), err)
	}
}

func TestCreateIdempotentAndConflicts(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	ctx := context.Background()
	first, err := h.API.CreateProxy(ctx, orchtest.Managed("p1"))
	if err != nil || !first.GetCreated() {
		t.Fatalf("first create: %v %v", first, err)
	}
	again, err := h.API.CreateProxy(ctx, orchtest.Managed("p1"))
	if err != nil || again.GetCreated() || again.GetProxy().GetUid() != first.GetProxy().GetUid() {
		t.Fatalf("same create again: created=%v uid %s vs %s, err %v", again.GetCreated(), again.GetProxy().GetUid(), first.GetProxy().GetUid(), err)
	}
	other := orchtest.Managed("p1")
	other.Spec.Placement.Zone = "z2"
	if _, err := h.API.CreateProxy(ctx, other); status.Code(err) != codes.AlreadyExists {
		t.Errorf("different spec: %v, want AlreadyExists", err)
	}

	// Optimistic concurrency.
	p := first.GetProxy()
	upd := &proxyv1.UpdateProxyRequest{Name: "p1", Spec: orchtest.Managed("p1").GetSpec(), Labels: map[string]string{"a": "b"}}
	if _, err := h.Client.UpdateProxy(ctx, upd); status.Code(err) != codes.InvalidArgument {
		t.Errorf("update without generation/etag: %v", err)
	}
	upd.Generation = p.GetGeneration() + 7
	if _, err := h.API.UpdateProxy(ctx, upd); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("stale generation: %v, want FailedPrecondition", err)
	}
	upd.Generation = 0
	upd.Etag = "r999999"
	if _, err := h.API.UpdateProxy(ctx, upd); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("stale etag: %v, want FailedPrecondition", err)
	}
	cur, _ := h.Store.Get(ctx, "p1")
	upd.Etag, upd.Generation = "", cur.Generation
	out, err := h.API.UpdateProxy(ctx, upd)
	if err != nil || out.GetProxy().GetGeneration() != cur.Generation+1 || out.GetProxy().GetLabels()["a"] != "b" {
		t.Fatalf("update: %v %v", out, err)
	}
	ext := &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "h.example", Port: 8080}}
	if _, err := h.API.UpdateProxy(ctx, &proxyv1.UpdateProxyRequest{Name: "p1", Spec: ext, Generation: out.GetProxy().GetGeneration()}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("mode change: %v, want InvalidArgument", err)
	}
	if _, err := h.API.GetProxy(ctx, &proxyv1.GetProxyRequest{Name: "nope"}); status.Code(err) != codes.NotFound {
		t.Errorf("get missing: %v", err)
	}
	if _, err := h.API.DeleteProxy(ctx, &proxyv1.DeleteProxyRequest{Name: "nope"}); status.Code(err) != codes.NotFound {
		t.Errorf("delete missing: %v", err)
	}
}

func TestExternalProxyLifecycle(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	h.StartReplica()
	ctx := context.Background()
	resp, err := h.API.CreateProxy(ctx, &proxyv1.CreateProxyRequest{Name: "ext", Spec: &proxyv1.ProxySpec{
		Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "203.0.113.7", Port: 3128},
	}})
	if err != nil {
		t.Fatal(err)
	}
	st := resp.GetProxy().GetStatus()
	if st.GetPhase() != proxyv1.ProxyPhase_PROXY_PHASE_RUNNING || st.GetIp() != "203.0.113.7" || st.GetPort() != 3128 {
		t.Errorf("external status %v", st)
	}
	h.PublishHealth(resp.GetProxy().GetUid(), "", 1, true)
	h.WaitFor("ext", "Ready", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_READY))
	del, err := h.API.DeleteProxy(ctx, &proxyv1.DeleteProxyRequest{Name: "ext"})
	if err != nil || del.GetProxy().GetDeleteTime() == nil {
		t.Fatalf("delete: %v %v", del, err)
	}
	if _, err := h.Store.Get(ctx, "ext"); err != store.ErrNotFound {
		t.Errorf("an external proxy has nothing to clean up and must go at once: %v", err)
	}
}

func TestListPaginationAndFilters(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	ctx := context.Background()
	for _, n := range []string{"c", "a", "e", "b", "d"} {
		req := orchtest.Managed(n)
		if n == "b" || n == "d" {
			req.Spec.Provider = "other"
			req.Labels = map[string]string{"pool": "eu"}
		}
		h.Create(req)
	}
	var names []string
	token := ""
	for {
		resp, err := h.API.ListProxies(ctx, &proxyv1.ListProxiesRequest{PageSize: 2, PageToken: token})
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetRevision() < 5 {
			t.Errorf("revision %d", resp.GetRevision())
		}
		for _, p := range resp.GetProxies() {
			names = append(names, p.GetName())
		}
		if token = resp.GetNextPageToken(); token == "" {
			break
		}
	}
	if strings.Join(names, "") != "abcde" {
		t.Errorf("pages = %v, want a..e in order", names)
	}
	resp, err := h.API.ListProxies(ctx, &proxyv1.ListProxiesRequest{Provider: "other", Labels: map[string]string{"pool": "eu"}})
	if err != nil || len(resp.GetProxies()) != 2 || resp.GetProxies()[0].GetName() != "b" {
		t.Errorf("filtered list: %v %v", resp, err)
	}
	first, _ := h.API.ListProxies(ctx, &proxyv1.ListProxiesRequest{PageSize: 1})
	if _, err := h.API.ListProxies(ctx, &proxyv1.ListProxiesRequest{PageSize: 1, Provider: "other", PageToken: first.GetNextPageToken()}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("token reused with other filters: %v", err)
	}
	if _, err := h.API.ListProxies(ctx, &proxyv1.ListProxiesRequest{PageToken: "garbage!"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("garbage token: %v", err)
	}
	for _, req := range []*proxyv1.ListProxiesRequest{
		{PageSize: 5000}, {PageSize: -1}, {Phase: 42}, {Provider: "fake\x00"}, {Provider: "fake\n"},
		{Labels: map[string]string{"pool": "eu\x00"}}, {PageToken: "\x00"},
	} {
		_, err := h.Client.ListProxies(ctx, req)
		if st := status.Convert(err); st.Code() != codes.InvalidArgument || len(st.Details()) == 0 {
			t.Errorf("ListProxies(%v) = %v, want INVALID_ARGUMENT with a BadRequest", req, err)
		}
	}
}

// Watch resumes from any retained revision over a real gRPC stream, and a
// pruned revision is OUT_OF_RANGE.
func TestWatchResume(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	client := h.Client

	a := h.Create(orchtest.Managed("a"))
	list, err := client.ListProxies(ctx, &proxyv1.ListProxiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	h.Create(orchtest.Managed("b"))
	h.Create(orchtest.Managed("c"))

	stream, err := client.WatchProxies(ctx, &proxyv1.WatchProxiesRequest{SinceRevision: list.GetRevision()})
	if err != nil {
		t.Fatal(err)
	}
	// Each create is followed by its first decision (an UPDATED change of
	// the same proxy); the creations come in order.
	var got []string
	var last int64
	for len(got) < 2 {
		ev, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if ev.GetRevision() <= last {
			t.Errorf("revision %d after %d", ev.GetRevision(), last)
		}
		last = ev.GetRevision()
		if ev.GetType() == proxyv1.ChangeType_CHANGE_TYPE_CREATED {
			got = append(got, ev.GetProxy().GetName())
		}
	}
	if strings.Join(got, ",") != "b,c" {
		t.Errorf("resumed watch = %v, want b,c", got)
	}
	// A live change arrives on the open stream.
	if _, err := h.API.DeleteProxy(ctx, &proxyv1.DeleteProxyRequest{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	var ev *proxyv1.WatchProxiesResponse
	for ev.GetProxy().GetUid() != a.GetUid() {
		if ev, err = stream.Recv(); err != nil {
			t.Fatalf("live event: %v", err)
		}
	}
	if ev.GetProxy().GetDeleteTime() == nil {
		t.Fatalf("live event: %v", ev)
	}
	// Its Create is in flight (no replica applies the result here): the
	// proxy is DELETING until the result is in, not released.
	if ev.GetType() != proxyv1.ChangeType_CHANGE_TYPE_UPDATED || ev.GetProxy().GetStatus().GetPhase() != proxyv1.ProxyPhase_PROXY_PHASE_DELETING {
		t.Errorf("type %v phase %v, want UPDATED, DELETING", ev.GetType(), ev.GetProxy().GetStatus().GetPhase())
	}

	// Prune everything the outbox has published, then resume from before.
	if _, err := h.Store.Pool().Exec(ctx, "UPDATE orchestrator.event_cursor SET revision = (SELECT value FROM orchestrator.revision)"); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Store.PruneChanges(ctx, -time.Hour); err != nil {
		t.Fatal(err)
	}
	old, err := client.WatchProxies(ctx, &proxyv1.WatchProxiesRequest{SinceRevision: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := old.Recv(); status.Code(err) != codes.OutOfRange {
		t.Errorf("watch from a pruned revision: %v, want OutOfRange", err)
	}
}

// Concurrent creates share transactions; duplicates inside one batch still
// resolve as idempotent (same spec) or AlreadyExists (different spec).
func TestConcurrentCreatesOfOneName(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	const n = 40
	type result struct {
		uid     string
		created bool
		code    codes.Code
	}
	results := make(chan result, n)
	for i := range n {
		go func() {
			req := orchtest.Managed("same")
			if i%4 == 3 {
				req.Spec.Placement.Zone = "z9" // a different spec
			}
			resp, err := h.API.CreateProxy(context.Background(), req)
			results <- result{resp.GetProxy().GetUid(), resp.GetCreated(), status.Code(err)}
		}()
	}
	uids := map[string]bool{}
	created, conflicts := 0, 0
	for range n {
		r := <-results
		switch r.code {
		case codes.OK:
			uids[r.uid] = true
			if r.created {
				created++
			}
		case codes.AlreadyExists:
			conflicts++
		default:
			t.Errorf("unexpected code %v", r.code)
		}
	}
	if created != 1 || len(uids) != 1 {
		t.Errorf("created %d times with %d uids; want exactly one proxy", created, len(uids))
	}
	// Whichever spec won, the other quarter (or three quarters) conflicts.
	if conflicts != n/4 && conflicts != n-n/4 {
		t.Errorf("conflicts = %d, want %d or %d", conflicts, n/4, n-n/4)
	}
	rows, _, err := h.Store.List(context.Background(), store.Filter{Limit: 10})
	if err != nil || len(rows) != 1 {
		t.Errorf("stored proxies: %d (err %v)", len(rows), err)
	}
}

// ListProxyChanges returns one proxy's retained changes newest first (its
// timeline), pages with before_revision, ignores other proxies, and is
// NOT_FOUND for a name no proxy has.
func TestListProxyChanges(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	h.StartReplica()
	ctx := context.Background()
	resp, err := h.API.CreateProxy(ctx, &proxyv1.CreateProxyRequest{Name: "ext", Spec: &proxyv1.ProxySpec{
		Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "203.0.113.7", Port: 3128},
	}})
	if err != nil {
		t.Fatal(err)
	}
	h.Create(orchtest.Managed("other"))
	h.PublishHealth(resp.GetProxy().GetUid(), "", 1, true)
	h.WaitFor("ext", "Ready", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_READY))

	got, err := h.Client.ListProxyChanges(ctx, &proxyv1.ListProxyChangesRequest{Name: "ext"})
	if err != nil {
		t.Fatal(err)
	}
	changes := got.GetChanges()
	if len(changes) < 2 {
		t.Fatalf("%d changes, want the creation and the Ready transition at least", len(changes))
	}
	for i, c := range changes {
		if c.GetProxy().GetName() != "ext" {
			t.Errorf("change %d is of %q", i, c.GetProxy().GetName())
		}
		if i > 0 && c.GetRevision() >= changes[i-1].GetRevision() {
			t.Errorf("changes not newest first: %d after %d", c.GetRevision(), changes[i-1].GetRevision())
		}
	}
	if p := changes[0].GetProxy().GetStatus(); p.GetPhase() != proxyv1.ProxyPhase_PROXY_PHASE_READY || !p.GetHealthy() {
		t.Errorf("newest change %v, want Ready and healthy", p)
	}
	if last := changes[len(changes)-1]; last.GetType() != proxyv1.ChangeType_CHANGE_TYPE_CREATED {
		t.Errorf("oldest change is %v, want the creation", last.GetType())
	}
	page, err := h.Client.ListProxyChanges(ctx, &proxyv1.ListProxyChangesRequest{Name: "ext", PageSize: 1, BeforeRevision: changes[0].GetRevision()})
	if err != nil || len(page.GetChanges()) != 1 || page.GetChanges()[0].GetRevision() != changes[1].GetRevision() {
		t.Errorf("second page = %v, %v; want change %d", page, err, changes[1].GetRevision())
	}
	if _, err := h.Client.ListProxyChanges(ctx, &proxyv1.ListProxyChangesRequest{Name: "nope"}); status.Code(err) != codes.NotFound {
		t.Errorf("missing proxy: %v", err)
	}
	for _, req := range []*proxyv1.ListProxyChangesRequest{{Name: "Bad_Name"}, {Name: "ext", PageSize: 5000}, {Name: "ext", BeforeRevision: -1}} {
		if _, err := h.Client.ListProxyChanges(ctx, req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("ListProxyChanges(%v) = %v, want INVALID_ARGUMENT", req, err)
		}
	}
}
