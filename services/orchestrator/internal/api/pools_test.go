package api_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/pool"
)

func TestPoolValidation(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	mut := func(f func(*proxyv1.ProxyPoolSpec)) *proxyv1.ProxyPoolSpec {
		s := orchtest.PoolSpec(1)
		f(s)
		return s
	}
	cases := []struct {
		name string
		req  *proxyv1.CreateProxyPoolRequest
		want string
	}{
		{"name too long for its proxies", &proxyv1.CreateProxyPoolRequest{Name: strings.Repeat("a", 57), Spec: orchtest.PoolSpec(1)}, "name: does not match regex pattern"},
		{"no spec", &proxyv1.CreateProxyPoolRequest{Name: "p"}, "spec: value is required"},
		{"no template", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Template = nil })}, "spec.template: value is required"},
		{"negative replicas", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Replicas = -1 })}, "spec.replicas: must be greater than or equal to 0"},
		{"external template", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) {
			s.Template.Spec = &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "h", Port: 1}}
		})}, "spec.template.spec.mode: must be MANAGED"},
		{"unconfigured spread provider", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Spread[1].Provider = "gcp" })}, `spec.spread[1].provider: "gcp" is not configured`},
		{"spread twice the same", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Spread[1].Provider = "fake" })}, "spec.spread[1]: provider \"fake\" zone \"\" appears twice"},
		{"provider with spread", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Template.Spec.Provider = "fake" })}, "spec.template.spec.provider: leave it empty"},
		{"no provider at all", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Spread = nil })}, "spec.template.spec.provider: required"},
		{"pool label in template", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Template.Labels["pool"] = "x" })}, `spec.template.labels["pool"]: is set by the pool`},
		{"min over max", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) {
			s.Autoscaling = &proxyv1.Autoscaling{MinReplicas: 5, MaxReplicas: 2}
		})}, "spec.autoscaling.min_replicas: 5 is more than max_replicas 2"},
		{"max age too short", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.MaxAge = durationpb.New(time.Second) })}, "spec.max_age: must be greater than or equal to 60s"},
		{"weight too big", &proxyv1.CreateProxyPoolRequest{Name: "p", Spec: mut(func(s *proxyv1.ProxyPoolSpec) { s.Spread[0].Weight = 5000 })}, "spec.spread[0].weight: must be less than or equal to 1000"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := h.Pools.CreateProxyPool(context.Background(), tc.req)
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), tc.want) {
				t.Fatalf("err = %v, want InvalidArgument containing %q", err, tc.want)
			}
		})
	}
	if names, err := h.Store.PoolNames(context.Background()); err != nil || len(names) != 0 {
		t.Fatalf("refused creates stored pools: %v %v", names, err)
	}
}

func TestPoolAPI(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	ctx := context.Background()
	watch, err := h.Pools.WatchProxyPools(ctx, &proxyv1.WatchProxyPoolsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := watch.Header(); err != nil {
		t.Fatal(err)
	}
	created, err := h.Pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "web", Spec: orchtest.PoolSpec(0)})
	if err != nil || !created.GetCreated() {
		t.Fatalf("create: %v %v", created, err)
	}
	again, err := h.Pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "web", Spec: orchtest.PoolSpec(0)})
	if err != nil || again.GetCreated() || again.GetPool().GetUid() != created.GetPool().GetUid() {
		t.Fatalf("create again: %v %v", again, err)
	}
	if _, err := h.Pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "web", Spec: orchtest.PoolSpec(3)}); status.Code(err) != codes.AlreadyExists {
		t.Fatalf("create different: %v, want AlreadyExists", err)
	}
	scaled, err := h.Pools.ScaleProxyPool(ctx, &proxyv1.ScaleProxyPoolRequest{Name: "web", Replicas: 2})
	if err != nil {
		t.Fatal(err)
	}
	if scaled.GetPool().GetSpec().GetReplicas() != 2 || scaled.GetPool().GetGeneration() != 2 ||
		scaled.GetPool().GetStatus().GetLastScalingDecision().GetReason() != pool.ScaleScaled {
		t.Fatalf("scaled: %v", scaled.GetPool())
	}
	spec := orchtest.PoolSpec(2)
	spec.MaxSurge = 2
	if _, err := h.Pools.UpdateProxyPool(ctx, &proxyv1.UpdateProxyPoolRequest{Name: "web", Spec: spec}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("update without generation: %v", err)
	}
	if _, err := h.Pools.UpdateProxyPool(ctx, &proxyv1.UpdateProxyPoolRequest{Name: "web", Spec: spec, Generation: 1}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("update with an old generation: %v", err)
	}
	upd, err := h.Pools.UpdateProxyPool(ctx, &proxyv1.UpdateProxyPoolRequest{Name: "web", Spec: spec, Generation: 2, Labels: map[string]string{"env": "prod"}})
	if err != nil || upd.GetPool().GetSpec().GetMaxSurge() != 2 || upd.GetPool().GetLabels()["env"] != "prod" {
		t.Fatalf("update: %v %v", upd, err)
	}
	got, err := h.Pools.GetProxyPool(ctx, &proxyv1.GetProxyPoolRequest{Name: "web"})
	if err != nil || got.GetPool().GetEtag() != upd.GetPool().GetEtag() {
		t.Fatalf("get: %v %v", got, err)
	}
	if _, err := h.Pools.GetProxyPool(ctx, &proxyv1.GetProxyPoolRequest{Name: "nope"}); status.Code(err) != codes.NotFound {
		t.Fatalf("get missing: %v", err)
	}
	if _, err := h.Pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: "api", Spec: orchtest.PoolSpec(0)}); err != nil {
		t.Fatal(err)
	}
	page1, err := h.Pools.ListProxyPools(ctx, &proxyv1.ListProxyPoolsRequest{PageSize: 1})
	if err != nil || len(page1.GetPools()) != 1 || page1.GetPools()[0].GetName() != "api" || page1.GetNextPageToken() == "" {
		t.Fatalf("list page 1: %v %v", page1, err)
	}
	page2, err := h.Pools.ListProxyPools(ctx, &proxyv1.ListProxyPoolsRequest{PageSize: 1, PageToken: page1.GetNextPageToken()})
	if err != nil || len(page2.GetPools()) != 1 || page2.GetPools()[0].GetName() != "web" {
		t.Fatalf("list page 2: %v %v", page2, err)
	}
	del, err := h.Pools.DeleteProxyPool(ctx, &proxyv1.DeleteProxyPoolRequest{Name: "api"})
	if err != nil || del.GetPool().GetDeleteTime() == nil {
		t.Fatalf("delete: %v %v", del, err)
	}
	if _, err := h.Pools.GetProxyPool(ctx, &proxyv1.GetProxyPoolRequest{Name: "api"}); status.Code(err) != codes.NotFound {
		t.Fatalf("a pool without proxies is gone at once: %v", err)
	}
	var seen []string
	for len(seen) < 5 {
		c, err := watch.Recv()
		if err != nil {
			t.Fatal(err)
		}
		seen = append(seen, c.GetPool().GetName()+":"+strings.TrimPrefix(c.GetType().String(), "CHANGE_TYPE_"))
	}
	if want := "web:CREATED web:UPDATED web:UPDATED api:CREATED api:DELETED"; strings.Join(seen, " ") != want {
		t.Fatalf("watch saw %v, want %s", seen, want)
	}
}

func TestDrainProxy(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	ctx := context.Background()
	h.Create(orchtest.Managed("p1"))
	resp, err := h.Client.DrainProxy(ctx, &proxyv1.DrainProxyRequest{Name: "p1", DrainTimeout: durationpb.New(time.Minute)})
	if err != nil || !resp.GetProxy().GetDraining() || resp.GetProxy().GetDrainDeadline() == nil {
		t.Fatalf("drain: %v %v", resp, err)
	}
	first := resp.GetProxy().GetDrainDeadline().AsTime()
	again, err := h.Client.DrainProxy(ctx, &proxyv1.DrainProxyRequest{Name: "p1", DrainTimeout: durationpb.New(time.Hour)})
	if err != nil || !again.GetProxy().GetDrainDeadline().AsTime().Equal(first) {
		t.Fatalf("draining again moved the deadline: %v %v", again, err)
	}
	undo, err := h.Client.DrainProxy(ctx, &proxyv1.DrainProxyRequest{Name: "p1", Cancel: true})
	if err != nil || undo.GetProxy().GetDraining() || undo.GetProxy().GetDrainTime() != nil {
		t.Fatalf("cancel: %v %v", undo, err)
	}
	if _, err := h.Client.DrainProxy(ctx, &proxyv1.DrainProxyRequest{Name: "p1", DrainTimeout: durationpb.New(30 * 24 * time.Hour)}); status.Code(err) != codes.InvalidArgument ||
		!strings.Contains(err.Error(), "drain_timeout") {
		t.Fatalf("a month-long drain: %v", err)
	}
	if _, err := h.Client.DrainProxy(ctx, &proxyv1.DrainProxyRequest{Name: "nope"}); status.Code(err) != codes.NotFound {
		t.Fatalf("drain missing: %v", err)
	}
}

// TestPoolConcurrentCreates: creates of one name racing each other answer
// as if they had come one after the other: one creates the pool, the same
// spec is answered the same pool, another spec AlreadyExists; none is
// Aborted.
func TestPoolConcurrentCreates(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	ctx := context.Background()
	for round := 0; round < 5; round++ {
		name := fmt.Sprintf("race-%d", round)
		const n = 8
		type answer struct {
			resp *proxyv1.CreateProxyPoolResponse
			err  error
		}
		answers := make(chan answer, n)
		start := make(chan struct{})
		for i := 0; i < n; i++ {
			replicas := int32(0)
			if i%2 == 1 {
				replicas = 1 // another spec
			}
			go func() {
				<-start
				resp, err := h.Pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: name, Spec: orchtest.PoolSpec(replicas)})
				answers <- answer{resp, err}
			}()
		}
		close(start)
		createdN := 0
		for i := 0; i < n; i++ {
			a := <-answers
			switch {
			case a.err == nil && a.resp.GetCreated():
				createdN++
			case a.err == nil:
			case status.Code(a.err) == codes.AlreadyExists:
			default:
				t.Errorf("round %d: create answered %v, want OK or AlreadyExists", round, a.err)
			}
		}
		if createdN != 1 {
			t.Errorf("round %d: %d creates report created, want 1", round, createdN)
		}
	}
}
