package api_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/api"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/providerhealth"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store/storetest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/transitions"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

var t0 = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

type fixture struct {
	st     *store.Store
	hub    *transitions.Hub
	client healthv1.HealthServiceClient
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	_, st := storetest.New(t)
	log := slog.New(slog.DiscardHandler)
	hub := &transitions.Hub{Store: st, Log: log, Every: 20 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	hubDone := make(chan struct{})
	go func() { _ = hub.Run(ctx); close(hubDone) }()

	srv := grpctest.NewServer(t)
	healthv1.RegisterHealthServiceServer(srv, &api.Server{Store: st, Hub: hub, Log: log,
		Providers: func() []api.Provider {
			return []api.Provider{{Name: "pve", Type: "proxmox"}, {Name: "kvm-home", Type: "kvm"}}
		}})
	t.Cleanup(func() {
		cancel()
		<-hubDone
	})
	conn := grpctest.Dial(t, grpctest.Serve(t, srv))
	return &fixture{st: st, hub: hub, client: healthv1.NewHealthServiceClient(conn)}
}

func state(uid, name string, healthy bool) engine.State {
	return engine.State{
		Spec:         engine.Spec{UID: uid, Name: name, ProviderID: "vm-" + uid, Address: "10.0.0.1:3128"},
		VerdictKnown: true, Healthy: healthy, Reason: "ProbeSucceeded", Message: "200 OK", Latency: 12 * time.Millisecond,
		ConsecutiveSuccesses: 3, LastProbe: t0, LastTransition: t0.Add(-time.Minute),
	}
}

func (f *fixture) transition(t *testing.T, uid string, healthy bool) int64 {
	t.Helper()
	tr, err := f.st.RecordTransition(context.Background(), engine.Transition{UID: uid, Name: "p-" + uid, ProviderID: "vm-" + uid,
		Healthy: healthy, Reason: "ProbeSucceeded", Latency: time.Millisecond, Time: t0}, nil, "replica-a")
	if err != nil {
		t.Fatal(err)
	}
	f.hub.Wake()
	return tr.GetSequence()
}

func TestGetProxyHealth(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	if err := f.st.SaveStates(ctx, []engine.State{state("u1", "alpha", true)}, "replica-a"); err != nil {
		t.Fatal(err)
	}
	resp, err := f.client.GetProxyHealth(ctx, &healthv1.GetProxyHealthRequest{ProxyName: "alpha"})
	if err != nil {
		t.Fatal(err)
	}
	h := resp.GetHealth()
	if h.GetProxyUid() != "u1" || h.GetProviderId() != "vm-u1" || h.GetAddress() != "10.0.0.1:3128" || !h.GetVerdictKnown() || !h.GetHealthy() ||
		h.GetReason() != "ProbeSucceeded" || h.GetLatency().AsDuration() != 12*time.Millisecond || h.GetConsecutiveSuccesses() != 3 ||
		!h.GetLastProbeTime().AsTime().Equal(t0) || !h.GetLastTransitionTime().AsTime().Equal(t0.Add(-time.Minute)) || h.GetProber() != "replica-a" {
		t.Errorf("GetProxyHealth = %v", h)
	}

	for _, tc := range []struct {
		name string
		code codes.Code
	}{{"missing", codes.NotFound}, {"", codes.InvalidArgument}} {
		if _, err := f.client.GetProxyHealth(ctx, &healthv1.GetProxyHealthRequest{ProxyName: tc.name}); status.Code(err) != tc.code {
			t.Errorf("GetProxyHealth(%q) = %v, want %s", tc.name, err, tc.code)
		}
	}
	if err := f.st.DeleteProxy(ctx, "u1", 1); err != nil {
		t.Fatal(err)
	}
	if _, err := f.client.GetProxyHealth(ctx, &healthv1.GetProxyHealthRequest{ProxyName: "alpha"}); status.Code(err) != codes.NotFound {
		t.Errorf("after DeleteProxy: %v, want NotFound", err)
	}
}

func TestListProxyHealth_pages(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	var states []engine.State
	for i := range 25 {
		states = append(states, state(fmt.Sprintf("u%02d", i), fmt.Sprintf("proxy-%02d", 24-i), i%2 == 0))
	}
	if err := f.st.SaveStates(ctx, states, "replica-a"); err != nil {
		t.Fatal(err)
	}
	var names []string
	token := ""
	pages := 0
	for {
		resp, err := f.client.ListProxyHealth(ctx, &healthv1.ListProxyHealthRequest{PageSize: 10, PageToken: token})
		if err != nil {
			t.Fatal(err)
		}
		pages++
		for _, h := range resp.GetProxies() {
			names = append(names, h.GetProxyName())
		}
		token = resp.GetNextPageToken()
		if token == "" {
			break
		}
	}
	if pages != 3 || len(names) != 25 {
		t.Fatalf("%d pages, %d proxies; want 3 pages of 25", pages, len(names))
	}
	for i, n := range names {
		if want := fmt.Sprintf("proxy-%02d", i); n != want {
			t.Fatalf("names[%d] = %s, want %s (name order)", i, n, want)
		}
	}
	all, err := f.client.ListProxyHealth(ctx, &healthv1.ListProxyHealthRequest{})
	if err != nil || len(all.GetProxies()) != 25 || all.GetNextPageToken() != "" {
		t.Errorf("default page = %d proxies, token %q, err %v; want all 25", len(all.GetProxies()), all.GetNextPageToken(), err)
	}
	for _, req := range []*healthv1.ListProxyHealthRequest{{PageSize: -1}, {PageToken: "not-a-token!"}} {
		if _, err := f.client.ListProxyHealth(ctx, req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("ListProxyHealth(%v) = %v, want InvalidArgument", req, err)
		}
	}
}

func recv(t *testing.T, s healthv1.HealthService_WatchProxyHealthClient) *healthv1.HealthTransition {
	t.Helper()
	m, err := s.Recv()
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	return m.GetTransition()
}

func TestWatchProxyHealth(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s1 := f.transition(t, "u1", true)
	s2 := f.transition(t, "u2", false)
	waitHub(t, f, s2)

	// From a sequence: the backlog, then live ones, without gaps or
	// duplicates.
	resumed, err := f.client.WatchProxyHealth(ctx, &healthv1.WatchProxyHealthRequest{SinceSequence: s1})
	if err != nil {
		t.Fatal(err)
	}
	// From 0: only what happens after the call.
	live, err := f.client.WatchProxyHealth(ctx, &healthv1.WatchProxyHealthRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if got := recv(t, resumed); got.GetSequence() != s2 || got.GetProxyUid() != "u2" || got.GetHealthy() {
		t.Fatalf("first resumed transition = %v, want sequence %d of u2", got, s2)
	}
	// Give both streams time to subscribe: the live watch must not see s2.
	waitSubscribed(t, live)
	s3 := f.transition(t, "u1", false)
	for name, s := range map[string]healthv1.HealthService_WatchProxyHealthClient{"resumed": resumed, "live": live} {
		if got := recv(t, s); got.GetSequence() != s3 || got.GetProxyName() != "p-u1" || got.GetProviderId() != "vm-u1" ||
			got.GetLatency().AsDuration() != time.Millisecond || !got.GetTransitionTime().AsTime().Equal(t0) {
			t.Errorf("%s watch got %v, want sequence %d", name, got, s3)
		}
	}
}

// waitSubscribed waits until the stream's server side has subscribed: the
// headers are sent once the handler runs, and Subscribe precedes any send.
func waitSubscribed(t *testing.T, s healthv1.HealthService_WatchProxyHealthClient) {
	t.Helper()
	if _, err := s.Header(); err != nil && err != io.EOF {
		t.Fatal(err)
	}
}

func waitHub(t *testing.T, f *fixture, seq int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		ch, pos, unsub, err := f.hub.Subscribe(ctx)
		if err != nil {
			t.Fatal(err)
		}
		unsub()
		_ = ch
		if pos >= seq {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("hub never reached sequence %d", seq)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func TestWatchProxyHealth_outOfRange(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s1 := f.transition(t, "u1", true)
	s2 := f.transition(t, "u1", false)
	// Mark them published and old, then prune.
	// One proxy's transitions go out one per sweep, in order.
	for _, want := range []int{1, 1, 0} {
		n, _, err := f.st.PublishPending(ctx, 10, func([]*healthv1.HealthTransition) error { return nil })
		if err != nil || n != want {
			t.Fatalf("PublishPending = %d, %v; want %d", n, err, want)
		}
	}
	n, err := f.st.PruneTransitions(ctx, t0.Add(time.Hour))
	if err != nil || n != 2 {
		t.Fatalf("PruneTransitions = %d, %v; want 2 pruned", n, err)
	}
	s, err := f.client.WatchProxyHealth(ctx, &healthv1.WatchProxyHealthRequest{SinceSequence: s1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); status.Code(err) != codes.OutOfRange {
		t.Errorf("watch from a pruned sequence = %v, want OutOfRange", err)
	}
	// Resuming from the pruned horizon itself is fine.
	s, err = f.client.WatchProxyHealth(ctx, &healthv1.WatchProxyHealthRequest{SinceSequence: s2})
	if err != nil {
		t.Fatal(err)
	}
	waitSubscribed(t, s)
	s3 := f.transition(t, "u1", true)
	if got := recv(t, s); got.GetSequence() != s3 {
		t.Errorf("got %v, want sequence %d", got, s3)
	}
}

func TestProviderHealth(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	if err := f.st.SaveProvider(ctx, providerhealth.BuildHealth(nil, providerhealth.Result{Provider: "kvm-home", Type: "kvm", Supported: true, CheckedAt: t0,
		Targets: []providerhealth.TargetStatus{{Name: "nas1", Address: "nas1:22", Ready: true, Reason: "Reachable", Details: map[string]string{"pool": "default"}}}})); err != nil {
		t.Fatal(err)
	}
	got, err := f.client.GetProviderHealth(ctx, &healthv1.GetProviderHealthRequest{Provider: "kvm-home"})
	if err != nil {
		t.Fatal(err)
	}
	h := got.GetHealth()
	if h.GetReadiness() != healthv1.ProviderReadiness_PROVIDER_READINESS_READY || h.GetTargetsReady() != "1/1" ||
		h.GetTargets()[0].GetDetails()["pool"] != "default" || !h.GetLastCheckTime().AsTime().Equal(t0) {
		t.Errorf("GetProviderHealth = %v", h)
	}
	for _, name := range []string{"pve", "unknown"} {
		if _, err := f.client.GetProviderHealth(ctx, &healthv1.GetProviderHealthRequest{Provider: name}); status.Code(err) != codes.NotFound {
			t.Errorf("GetProviderHealth(%s) = %v, want NotFound", name, err)
		}
	}
	list, err := f.client.ListProviderHealth(ctx, &healthv1.ListProviderHealthRequest{})
	if err != nil {
		t.Fatal(err)
	}
	ps := list.GetProviders()
	if len(ps) != 2 || ps[0].GetProvider() != "pve" || ps[0].GetReadiness() != healthv1.ProviderReadiness_PROVIDER_READINESS_UNSPECIFIED ||
		ps[0].GetType() != "proxmox" || ps[1].GetProvider() != "kvm-home" || ps[1].GetReadiness() != healthv1.ProviderReadiness_PROVIDER_READINESS_READY {
		t.Errorf("ListProviderHealth = %v, want pve (unchecked) then kvm-home, in config order", ps)
	}
}
