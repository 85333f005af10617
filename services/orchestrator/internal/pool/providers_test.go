package pool

import (
	"context"
	"log/slog"
	"maps"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
)

// scriptedHealth answers ListProviderHealth with what the test set last.
type scriptedHealth struct {
	healthv1.UnimplementedHealthServiceServer
	mu   sync.Mutex
	resp *healthv1.ListProviderHealthResponse
	err  error
}

func (s *scriptedHealth) set(resp *healthv1.ListProviderHealthResponse, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.resp, s.err = resp, err
}

func (s *scriptedHealth) ListProviderHealth(context.Context, *healthv1.ListProviderHealthRequest) (*healthv1.ListProviderHealthResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.resp, s.err
}

func providers(b healthv1.ProviderReadiness) *healthv1.ListProviderHealthResponse {
	return &healthv1.ListProviderHealthResponse{Providers: []*healthv1.ProviderHealth{
		{Provider: "a", Readiness: healthv1.ProviderReadiness_PROVIDER_READINESS_READY, Reason: "AllTargetsReady"},
		{Provider: "b", Readiness: b, Reason: map[bool]string{true: "TargetsNotReady", false: "AllTargetsReady"}[b == healthv1.ProviderReadiness_PROVIDER_READINESS_NOT_READY],
			Targets: []*healthv1.ProviderTarget{{Name: "pve1", Ready: false, Reason: "Unreachable"}, {Name: "pve2", Ready: true, Reason: "Reachable"}}},
		{Provider: "c", Readiness: healthv1.ProviderReadiness_PROVIDER_READINESS_UNKNOWN, Reason: "ChecksNotImplemented"},
	}}
}

// Verdicts over gRPC: NOT_READY providers only, with why; a failed poll
// keeps them for StaleAfter and warns once; past it they are unknown (not
// NOT_READY), with one more warning; a good poll brings them back.
func TestProviderHealthPolls(t *testing.T) {
	t.Parallel()
	srv := &scriptedHealth{}
	gs := grpctest.NewServer(t)
	healthv1.RegisterHealthServiceServer(gs, srv)
	conn := grpctest.Dial(t, grpctest.Serve(t, gs))
	logs := &logtest.Buffer{}
	now := t0
	changed := 0
	h := &ProviderHealth{
		Health: healthv1.NewHealthServiceClient(conn), StaleAfter: time.Minute,
		Log: slog.New(slog.NewTextHandler(logs, nil)), Changed: func() { changed++ },
		PollFailures: NewMetrics(nil).ProviderHealthFails,
		now:          func() time.Time { return now },
	}
	ctx := context.Background()
	poll := func() { h.Poll(ctx, 5*time.Second) }
	wantNotReady := func(step string, want map[string]string) {
		t.Helper()
		if got := h.NotReady(); !maps.Equal(got, want) {
			t.Fatalf("%s: NotReady = %v, want %v", step, got, want)
		}
	}

	if got := h.NotReady(); got != nil {
		t.Fatalf("before any poll: %v, want nil", got)
	}
	srv.set(providers(healthv1.ProviderReadiness_PROVIDER_READINESS_NOT_READY), nil)
	poll()
	down := map[string]string{"b": "TargetsNotReady: pve1 Unreachable"}
	wantNotReady("b NOT_READY", down)
	if changed != 1 {
		t.Fatalf("changed %d times, want 1", changed)
	}
	poll()
	if changed != 1 {
		t.Fatalf("the same verdicts again: changed %d times, want 1", changed)
	}

	srv.set(nil, status.Error(codes.Unavailable, "health service down"))
	for range 3 {
		now = now.Add(15 * time.Second)
		poll()
		wantNotReady("poll failing within StaleAfter", down)
	}
	if n := strings.Count(logs.String(), "WARNING: reading the providers' health failed"); n != 1 {
		t.Fatalf("%d failure warnings in one spell, want 1:\n%s", n, logs)
	}
	if n := testutil.ToFloat64(h.PollFailures); n != 3 {
		t.Fatalf("poll failures counted %v, want 3", n)
	}
	now = now.Add(20 * time.Second) // 65s after the last good poll
	wantNotReady("past StaleAfter", nil)
	poll()
	poll()
	if n := strings.Count(logs.String(), "WARNING: the providers' health is unknown"); n != 1 {
		t.Fatalf("%d unknown warnings, want 1:\n%s", n, logs)
	}
	if changed != 2 {
		t.Fatalf("dropping the verdicts: changed %d times, want 2", changed)
	}

	srv.set(providers(healthv1.ProviderReadiness_PROVIDER_READINESS_READY), nil)
	poll()
	wantNotReady("b READY", nil)
	if !strings.Contains(logs.String(), "reading the providers' health works again") {
		t.Errorf("no recovery line:\n%s", logs)
	}
	srv.set(nil, status.Error(codes.Unavailable, "down again"))
	poll()
	if n := strings.Count(logs.String(), "WARNING: reading the providers' health failed"); n != 2 {
		t.Errorf("a new spell warns again: %d warnings, want 2", n)
	}
}
