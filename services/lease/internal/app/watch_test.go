package app_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/api"
	lt "github.com/egress-proxies/egress-proxies/services/lease/internal/leasetest"
)

// viewer is a gRPC LeaseService client with the viewer token.
func viewer(t *testing.T, env *lt.Env) leasev1.LeaseServiceClient {
	t.Helper()
	conn, err := grpc.NewClient(env.GRPCAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(auth.BearerToken(lt.ViewerToken)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return leasev1.NewLeaseServiceClient(conn)
}

// watch opens WatchLeases and waits until it is in place.
func watch(t *testing.T, c leasev1.LeaseServiceClient) leasev1.LeaseService_WatchLeasesClient {
	t.Helper()
	return watchWith(t, c, &leasev1.WatchLeasesRequest{})
}

// watchWith is watch with the request's filters.
func watchWith(t *testing.T, c leasev1.LeaseServiceClient, req *leasev1.WatchLeasesRequest) leasev1.LeaseService_WatchLeasesClient {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	w, err := c.WatchLeases(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	h, err := w.Header()
	if err != nil || len(h.Get(api.WatchReadyHeader)) == 0 {
		t.Fatalf("watch header %v, %v", h, err)
	}
	return w
}

func next(t *testing.T, w leasev1.LeaseService_WatchLeasesClient, want leasev1.LeaseChangeType) *leasev1.WatchLeasesResponse {
	t.Helper()
	got := make(chan *leasev1.WatchLeasesResponse, 1)
	errs := make(chan error, 1)
	go func() {
		c, err := w.Recv()
		if err != nil {
			errs <- err
			return
		}
		got <- c
	}()
	select {
	case c := <-got:
		if c.GetType() != want {
			t.Fatalf("change %v, want %v", c, want)
		}
		return c
	case err := <-errs:
		t.Fatalf("watch ended: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatalf("no %v change within 10s", want)
	}
	return nil
}

// A lease acquired, renewed, reported, released or expired on one replica
// reaches WatchLeases on another, and both list it; crawlers list no
// leases; a NATS outage ends the watch with UNAVAILABLE.
func TestListAndWatchLeasesAcrossReplicas(t *testing.T) {
	t.Parallel()
	a := lt.Start(t, lt.Options{})
	b := lt.Start(t, lt.Options{DatabaseURL: a.Config.Database.URL, NATS: a.NATS})
	pooled := func(p *proxyv1.Proxy) { p.Pool = "web" }
	a.Apply(t, lt.Proxy(uidA, "proxy-a", pooled), 1)
	a.Apply(t, lt.Proxy(uidB, "proxy-b"), 2)
	onB := viewer(t, b)
	w := watch(t, onB)

	crawler := a.Client("grpc", "crawler-a")
	l := mustAcquire(t, crawler, &leasev1.AcquireLeaseRequest{TargetHost: "shop.example", Selector: &leasev1.ProxySelector{Pool: "web"}})
	if l.GetPool() != "web" {
		t.Errorf("acquired lease's pool %q, want web", l.GetPool())
	}
	got := next(t, w, leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_ACQUIRED).GetLease()
	if got.GetLeaseId() != l.GetLeaseId() || got.GetClientId() != "crawler-a" || got.GetProxyName() != "proxy-a" ||
		got.GetPool() != "web" || got.GetTargetHost() != "shop.example" || got.GetAddress().GetPort() != 3128 {
		t.Errorf("watched lease %v, want %v", got, l)
	}
	// A millisecond later, so that "oldest first" has an order: leases of
	// one millisecond are listed in no particular one.
	a.Clock.Advance(time.Millisecond)
	b.Clock.Advance(time.Millisecond)
	other := mustAcquire(t, a.Client("grpc", "crawler-b"), &leasev1.AcquireLeaseRequest{Ttl: durationpb.New(10 * time.Second)})
	next(t, w, leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_ACQUIRED)

	ctx := lt.Ctx(t)
	all, err := onB.ListLeases(ctx, &leasev1.ListLeasesRequest{})
	if err != nil || len(all.GetLeases()) != 2 || all.GetLeases()[0].GetLeaseId() != l.GetLeaseId() {
		t.Fatalf("ListLeases = %v, %v; want both, oldest first", all, err)
	}
	for _, tc := range []struct {
		req  *leasev1.ListLeasesRequest
		want string
	}{
		{&leasev1.ListLeasesRequest{ClientId: "crawler-b"}, other.GetLeaseId()},
		{&leasev1.ListLeasesRequest{Pool: "web"}, l.GetLeaseId()},
		{&leasev1.ListLeasesRequest{TargetHost: "SHOP.example."}, l.GetLeaseId()},
		{&leasev1.ListLeasesRequest{ProxyName: "proxy-b"}, other.GetLeaseId()},
	} {
		resp, err := onB.ListLeases(ctx, tc.req)
		if err != nil || len(resp.GetLeases()) != 1 || resp.GetLeases()[0].GetLeaseId() != tc.want {
			t.Errorf("ListLeases(%v) = %v, %v; want %s only", tc.req, resp, err, tc.want)
		}
	}
	page, err := onB.ListLeases(ctx, &leasev1.ListLeasesRequest{PageSize: 1})
	if err != nil || len(page.GetLeases()) != 1 || page.GetNextPageToken() == "" {
		t.Fatalf("first page %v, %v", page, err)
	}
	page, err = onB.ListLeases(ctx, &leasev1.ListLeasesRequest{PageSize: 1, PageToken: page.GetNextPageToken()})
	if err != nil || len(page.GetLeases()) != 1 || page.GetLeases()[0].GetLeaseId() != other.GetLeaseId() || page.GetNextPageToken() != "" {
		t.Errorf("second page %v, %v", page, err)
	}
	if _, err := onB.ListLeases(ctx, &leasev1.ListLeasesRequest{PageToken: "nope"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("bad page token: %v", err)
	}

	if _, r := crawler.Renew(ctx, &leasev1.RenewLeaseRequest{LeaseId: l.GetLeaseId(), Ttl: durationpb.New(time.Minute)}); r.Code() != codes.OK {
		t.Fatal(r.Status)
	}
	if c := next(t, w, leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RENEWED).GetLease(); c.GetLeaseId() != l.GetLeaseId() || c.GetPool() != "web" {
		t.Errorf("renewed %v", c)
	}
	if _, r := crawler.Report(ctx, &leasev1.ReportOutcomeRequest{LeaseId: l.GetLeaseId(), Outcome: leasev1.Outcome_OUTCOME_BANNED}); r.Code() != codes.OK {
		t.Fatal(r.Status)
	}
	rep := next(t, w, leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_REPORTED)
	if rep.GetCooldown().GetProxyUid() != uidA || rep.GetCooldown().GetCooldown().GetTargetHost() != "shop.example" {
		t.Errorf("report change %v", rep)
	}
	cools, err := onB.ListCooldowns(ctx, &leasev1.ListCooldownsRequest{Pool: "web"})
	if err != nil || len(cools.GetCooldowns()) != 1 || cools.GetCooldowns()[0].GetProxyName() != "proxy-a" ||
		cools.GetCooldowns()[0].GetCooldown().GetOutcome() != leasev1.Outcome_OUTCOME_BANNED {
		t.Errorf("ListCooldowns = %v, %v", cools, err)
	}
	if _, r := crawler.Release(ctx, &leasev1.ReleaseLeaseRequest{LeaseId: l.GetLeaseId()}); r.Code() != codes.OK {
		t.Fatal(r.Status)
	}
	if c := next(t, w, leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RELEASED).GetLease(); c.GetLeaseId() != l.GetLeaseId() || c.GetProxyUid() != uidA {
		t.Errorf("released %v", c)
	}
	a.Clock.Advance(11 * time.Second)
	b.Clock.Advance(11 * time.Second)
	if res, err := b.Parts.Store.Sweep(ctx); err != nil || res.Expired != 1 {
		t.Fatalf("Sweep = %+v, %v", res, err)
	}
	if c := next(t, w, leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_EXPIRED).GetLease(); c.GetLeaseId() != other.GetLeaseId() || c.GetClientId() != "crawler-b" {
		t.Errorf("expired %v", c)
	}
	if left, err := onB.ListLeases(ctx, &leasev1.ListLeasesRequest{}); err != nil || len(left.GetLeases()) != 0 {
		t.Errorf("after release and expiry: %v, %v", left, err)
	}

	// Crawlers never list other clients' leases.
	conn, err := grpc.NewClient(a.GRPCAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(auth.BearerToken(lt.Tokens["crawler-a"])))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := leasev1.NewLeaseServiceClient(conn).ListLeases(ctx, &leasev1.ListLeasesRequest{}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("crawler ListLeases: %v, want PERMISSION_DENIED", err)
	}

	// Changes published while NATS is away are lost: the watch ends.
	a.NATS.Stop()
	if _, err := w.Recv(); status.Code(err) != codes.Unavailable {
		t.Errorf("watch during a NATS outage: %v, want UNAVAILABLE", err)
	}
}

// A watch filtered by change type and client receives only those changes
// (the gateway's use: a service token, its own lease ends); a filter of
// an unknown type is refused naming the field.
func TestWatchLeasesFilters(t *testing.T) {
	t.Parallel()
	env := lt.Start(t, lt.Options{})
	env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
	env.Apply(t, lt.Proxy(uidB, "proxy-b"), 2)
	conn, err := grpc.NewClient(env.GRPCAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(auth.BearerToken(lt.GatewayToken)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	gw := leasev1.NewLeaseServiceClient(conn)
	ctx := lt.Ctx(t)

	ended := watchWith(t, gw, &leasev1.WatchLeasesRequest{ClientId: "crawler-a", Types: []leasev1.LeaseChangeType{
		leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RELEASED, leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_EXPIRED}})
	reported := watchWith(t, gw, &leasev1.WatchLeasesRequest{Types: []leasev1.LeaseChangeType{leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_REPORTED}})

	// crawler-b's changes and crawler-a's acquire and report pass the
	// first watch by; only crawler-a's release reaches it.
	a, b := env.Client("grpc", "crawler-a"), env.Client("grpc", "crawler-b")
	lb := mustAcquire(t, b, &leasev1.AcquireLeaseRequest{})
	if _, r := b.Report(ctx, &leasev1.ReportOutcomeRequest{LeaseId: lb.GetLeaseId(), Outcome: leasev1.Outcome_OUTCOME_BANNED, TargetHost: "shop.example"}); r.Code() != codes.OK {
		t.Fatal(r.Status)
	}
	if _, r := b.Release(ctx, &leasev1.ReleaseLeaseRequest{LeaseId: lb.GetLeaseId()}); r.Code() != codes.OK {
		t.Fatal(r.Status)
	}
	la := mustAcquire(t, a, &leasev1.AcquireLeaseRequest{})
	if _, r := a.Release(ctx, &leasev1.ReleaseLeaseRequest{LeaseId: la.GetLeaseId()}); r.Code() != codes.OK {
		t.Fatal(r.Status)
	}
	if c := next(t, ended, leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RELEASED).GetLease(); c.GetLeaseId() != la.GetLeaseId() {
		t.Errorf("filtered watch got the release of %v, want crawler-a's %s", c, la.GetLeaseId())
	}
	// The report watch sees every client's reports, and nothing else.
	rep := next(t, reported, leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_REPORTED)
	if rep.GetLease().GetLeaseId() != lb.GetLeaseId() || rep.GetCooldown().GetCooldown().GetTargetHost() != "shop.example" {
		t.Errorf("report change %v", rep)
	}
	// The service role lists the cooldowns, to follow the watch.
	if cools, err := gw.ListCooldowns(ctx, &leasev1.ListCooldownsRequest{}); err != nil || len(cools.GetCooldowns()) != 1 {
		t.Errorf("ListCooldowns with the service role = %v, %v", cools, err)
	}

	w, err := gw.WatchLeases(ctx, &leasev1.WatchLeasesRequest{Types: []leasev1.LeaseChangeType{99}})
	if err == nil {
		_, err = w.Recv()
	}
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), "types") {
		t.Errorf("unknown change type: %v, want INVALID_ARGUMENT naming types", err)
	}
	w, err = gw.WatchLeases(ctx, &leasev1.WatchLeasesRequest{Types: []leasev1.LeaseChangeType{leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_UNSPECIFIED}})
	if err == nil {
		_, err = w.Recv()
	}
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), "types") {
		t.Errorf("unspecified change type: %v, want INVALID_ARGUMENT naming types", err)
	}
}
