package providerhealth_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/providerhealth"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store/storetest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// fakeProvisioner is a real gRPC ProvisionerService whose CheckBackend a
// test scripts.
type fakeProvisioner struct {
	provisionerv1.UnimplementedProvisionerServiceServer
	mu    sync.Mutex
	check func(ctx context.Context, req *provisionerv1.CheckBackendRequest) (*provisionerv1.CheckBackendResponse, error)
	calls atomic.Int64
}

func (f *fakeProvisioner) CheckBackend(ctx context.Context, req *provisionerv1.CheckBackendRequest) (*provisionerv1.CheckBackendResponse, error) {
	f.calls.Add(1)
	f.mu.Lock()
	check := f.check
	f.mu.Unlock()
	if check == nil {
		return nil, status.Error(codes.Unimplemented, "method CheckBackend not implemented")
	}
	return check(ctx, req)
}

func (f *fakeProvisioner) set(check func(context.Context, *provisionerv1.CheckBackendRequest) (*provisionerv1.CheckBackendResponse, error)) {
	f.mu.Lock()
	f.check = check
	f.mu.Unlock()
}

// startProvisioner serves f on a loopback port and returns a checker
// connected to it.
func startProvisioner(t *testing.T, provider string, f *fakeProvisioner) *providerhealth.GRPCChecker {
	t.Helper()
	srv := grpc.NewServer()
	provisionerv1.RegisterProvisionerServiceServer(srv, f)
	addr := grpctest.Serve(t, srv)
	return providerhealth.NewGRPCChecker(provider, addr, grpctest.Dial(t, addr))
}

func targets(ts ...*provisionerv1.TargetStatus) func(context.Context, *provisionerv1.CheckBackendRequest) (*provisionerv1.CheckBackendResponse, error) {
	return func(context.Context, *provisionerv1.CheckBackendRequest) (*provisionerv1.CheckBackendResponse, error) {
		return &provisionerv1.CheckBackendResponse{Targets: ts}, nil
	}
}

func up(name string) *provisionerv1.TargetStatus {
	return &provisionerv1.TargetStatus{Name: name, Address: name + ":22", Ready: true, Reason: "Reachable",
		Latency: durationpb.New(3 * time.Millisecond), Details: map[string]string{"version": "9.1"}}
}

func down(name, reason string) *provisionerv1.TargetStatus {
	return &provisionerv1.TargetStatus{Name: name, Address: name + ":22", Reason: reason, Message: name + " is down"}
}

// logBuffer captures JSON log lines.
type logBuffer struct{ logtest.Buffer }

func (l *logBuffer) lines(t *testing.T) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(l.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		out = append(out, m)
	}
	return out
}

func newLogger(buf *logBuffer) *slog.Logger {
	return slog.New(slog.NewJSONHandler(buf, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

func newMonitor(t *testing.T, st *store.Store, ts ...providerhealth.Target) (*providerhealth.Monitor, *logBuffer) {
	t.Helper()
	var logs logBuffer
	return &providerhealth.Monitor{Store: st, Targets: func() []providerhealth.Target { return ts }, Interval: time.Minute, Timeout: 5 * time.Second, Log: newLogger(&logs)}, &logs
}

func get(t *testing.T, st *store.Store, name string) *healthv1.ProviderHealth {
	t.Helper()
	all, err := st.Providers(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return all[name]
}

func TestMonitor_checkOnce_storesEveryProvider(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	kvm := &fakeProvisioner{}
	kvm.set(targets(up("nas1"), down("nas2", "Unreachable")))
	pve := &fakeProvisioner{}
	pve.set(func(_ context.Context, req *provisionerv1.CheckBackendRequest) (*provisionerv1.CheckBackendResponse, error) {
		if req.GetProvider() != "pve" {
			return nil, status.Errorf(codes.InvalidArgument, "provider %q", req.GetProvider())
		}
		return &provisionerv1.CheckBackendResponse{Targets: []*provisionerv1.TargetStatus{up("pve1")}}, nil
	})
	m, _ := newMonitor(t, st,
		providerhealth.Target{Name: "kvm-home", Type: "kvm", Checker: startProvisioner(t, "kvm-home", kvm)},
		providerhealth.Target{Name: "pve", Type: "proxmox", Checker: startProvisioner(t, "pve", pve)},
	)
	m.CheckOnce(context.Background())

	k := get(t, st, "kvm-home")
	if k.GetReadiness() != healthv1.ProviderReadiness_PROVIDER_READINESS_NOT_READY || k.GetReason() != providerhealth.ReasonTargetsNotReady ||
		k.GetTargetsReady() != "1/2" || k.GetType() != "kvm" || k.GetLastCheckTime() == nil {
		t.Errorf("kvm-home = %v, want NOT_READY/TargetsNotReady 1/2", k)
	}
	if tg := k.GetTargets(); len(tg) != 2 || tg[0].GetName() != "nas1" || tg[0].GetDetails()["version"] != "9.1" ||
		tg[0].GetLatency().AsDuration() != 3*time.Millisecond || tg[1].GetReason() != "Unreachable" || tg[1].GetMessage() != "nas2 is down" {
		t.Errorf("kvm-home targets = %v", tg)
	}
	p := get(t, st, "pve")
	if p.GetReadiness() != healthv1.ProviderReadiness_PROVIDER_READINESS_READY || p.GetReason() != providerhealth.ReasonAllTargetsReady || p.GetTargetsReady() != "1/1" {
		t.Errorf("pve = %v, want READY", p)
	}
}

func TestMonitor_checkOnce_timeoutBoundsEachRound(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	var hadDeadline atomic.Bool
	hanging := &fakeProvisioner{}
	hanging.set(func(ctx context.Context, _ *provisionerv1.CheckBackendRequest) (*provisionerv1.CheckBackendResponse, error) {
		_, ok := ctx.Deadline()
		hadDeadline.Store(ok)
		<-ctx.Done()
		return nil, status.FromContextError(ctx.Err()).Err()
	})
	fast := &fakeProvisioner{}
	fast.set(targets(up("apiserver")))
	m, _ := newMonitor(t, st,
		providerhealth.Target{Name: "kvm-home", Type: "kvm", Checker: startProvisioner(t, "kvm-home", hanging)},
		providerhealth.Target{Name: "local", Type: "local", Checker: startProvisioner(t, "local", fast)},
	)
	// Long enough for the fast neighbour to answer on a loaded machine:
	// the provisioner's check keeps a margin of the caller's deadline
	// (a tenth, at least 100ms), so 200ms left it only 100ms.
	m.Timeout = 2 * time.Second

	start := time.Now()
	m.CheckOnce(context.Background())
	if took := time.Since(start); took > 20*time.Second {
		t.Fatalf("CheckOnce took %s with a 2s timeout: the hanging provisioner was not bounded", took)
	}
	if !hadDeadline.Load() {
		t.Error("the provisioner got a call without a deadline")
	}
	k := get(t, st, "kvm-home")
	if k.GetReadiness() != healthv1.ProviderReadiness_PROVIDER_READINESS_NOT_READY || len(k.GetTargets()) != 1 ||
		k.GetTargets()[0].GetReason() != "Timeout" || k.GetTargets()[0].GetName() != "provisioner" {
		t.Errorf("kvm-home = %v, want one not-ready provisioner target with reason Timeout", k)
	}
	if l := get(t, st, "local"); l.GetReadiness() != healthv1.ProviderReadiness_PROVIDER_READINESS_READY {
		t.Errorf("local = %v, want READY despite the slow neighbour", l)
	}
}

func TestMonitor_checkOnce_unknownWithoutCheck(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	unimplemented := &fakeProvisioner{} // answers UNIMPLEMENTED
	empty := &fakeProvisioner{}
	empty.set(targets())
	m, _ := newMonitor(t, st,
		providerhealth.Target{Name: "gcp-eu", Type: "gcp", Checker: startProvisioner(t, "gcp-eu", unimplemented)},
		providerhealth.Target{Name: "nowhere", Type: "kvm"}, // no --provisioner for it
		providerhealth.Target{Name: "empty", Type: "kvm", Checker: startProvisioner(t, "empty", empty)},
	)
	m.CheckOnce(context.Background())

	for _, name := range []string{"gcp-eu", "nowhere"} {
		h := get(t, st, name)
		if h.GetReadiness() != healthv1.ProviderReadiness_PROVIDER_READINESS_UNKNOWN || h.GetReason() != providerhealth.ReasonChecksNotImplemented || h.GetTargetsReady() != "" {
			t.Errorf("%s = %v, want UNKNOWN/ChecksNotImplemented", name, h)
		}
	}
	if unimplemented.calls.Load() != 1 {
		t.Errorf("the provisioner was asked %d times, want once", unimplemented.calls.Load())
	}
	if h := get(t, st, "empty"); h.GetReadiness() != healthv1.ProviderReadiness_PROVIDER_READINESS_UNKNOWN || h.GetReason() != providerhealth.ReasonNoTargets ||
		h.GetTargetsReady() != "0/0" || h.GetMessage() != "the provider has nothing to check" {
		t.Errorf("empty = %v, want UNKNOWN/NoTargets 0/0: nothing checked, nothing known", h)
	}
	if h := get(t, st, "nowhere"); !strings.Contains(h.GetMessage(), "--provisioner") {
		t.Errorf("nowhere's message %q does not say no provisioner is configured", h.GetMessage())
	}
	if h := get(t, st, "gcp-eu"); h.GetMessage() != "the gcp provisioner implements no backend check" {
		t.Errorf("gcp-eu's message = %q", h.GetMessage())
	}
}

func TestMonitor_checkOnce_provisionerDown(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	m, _ := newMonitor(t, st, providerhealth.Target{Name: "pve", Type: "proxmox", Checker: providerhealth.NewGRPCChecker("pve", addr, conn)})
	m.Timeout = time.Second
	m.CheckOnce(context.Background())
	h := get(t, st, "pve")
	if h.GetReadiness() != healthv1.ProviderReadiness_PROVIDER_READINESS_NOT_READY || len(h.GetTargets()) != 1 ||
		h.GetTargets()[0].GetAddress() != addr || h.GetTargets()[0].GetReady() {
		t.Errorf("pve = %v, want NOT_READY with the provisioner target at %s", h, addr)
	}
	if r := h.GetTargets()[0].GetReason(); r != "Unreachable" && r != "Timeout" {
		t.Errorf("reason = %s, want Unreachable or Timeout", r)
	}
}

func TestMonitor_transitionTimeKeptUntilFlip(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	f := &fakeProvisioner{}
	m, _ := newMonitor(t, st, providerhealth.Target{Name: "kvm-home", Type: "kvm", Checker: startProvisioner(t, "kvm-home", f)})
	ctx := context.Background()

	f.set(targets(up("nas1"), up("nas2")))
	m.CheckOnce(ctx)
	first := get(t, st, "kvm-home")
	f.set(targets(up("nas1"), down("nas2", "Timeout")))
	m.CheckOnce(ctx)
	second := get(t, st, "kvm-home")

	if !second.GetLastCheckTime().AsTime().After(first.GetLastCheckTime().AsTime()) {
		t.Errorf("lastCheckTime did not move: %s then %s", first.GetLastCheckTime().AsTime(), second.GetLastCheckTime().AsTime())
	}
	if a, b := first.GetTargets()[0].GetLastTransitionTime().AsTime(), second.GetTargets()[0].GetLastTransitionTime().AsTime(); !a.Equal(b) {
		t.Errorf("nas1 stayed ready but its transition time moved: %s -> %s", a, b)
	}
	if a, b := first.GetTargets()[1].GetLastTransitionTime().AsTime(), second.GetTargets()[1].GetLastTransitionTime().AsTime(); !b.After(a) {
		t.Errorf("nas2 flipped but its transition time stayed: %s -> %s", a, b)
	}
	// The provider's own: set when readiness changed (READY -> NOT_READY),
	// kept while it stays NOT_READY, whatever the targets do meanwhile.
	if a, b := first.GetReadinessTransitionTime().AsTime(), second.GetReadinessTransitionTime().AsTime(); !b.After(a) || !b.Equal(second.GetLastCheckTime().AsTime()) {
		t.Errorf("readiness flipped but its transition time went %s -> %s (check at %s)", a, b, second.GetLastCheckTime().AsTime())
	}
	if second.GetMessage() != "nas2: Timeout" {
		t.Errorf("NOT_READY message = %q, want the failing target", second.GetMessage())
	}
	f.set(targets(down("nas1", "Unreachable"), down("nas2", "Timeout")))
	m.CheckOnce(ctx)
	third := get(t, st, "kvm-home")
	if a, b := second.GetReadinessTransitionTime().AsTime(), third.GetReadinessTransitionTime().AsTime(); !a.Equal(b) {
		t.Errorf("readiness stayed NOT_READY but its transition time moved: %s -> %s", a, b)
	}
	if third.GetMessage() != "nas1: Unreachable; nas2: Timeout" {
		t.Errorf("NOT_READY message = %q, want both failing targets", third.GetMessage())
	}
}

func TestBuildHealth_readiness(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 12, 4, 4, 0, 0, 0, time.UTC)
	t1 := t0.Add(time.Minute)
	ready := func(names ...string) []providerhealth.TargetStatus {
		var out []providerhealth.TargetStatus
		for _, n := range names {
			out = append(out, providerhealth.TargetStatus{Name: n, Ready: true, Reason: "Reachable"})
		}
		return out
	}
	readyAt := &healthv1.ProviderHealth{Readiness: healthv1.ProviderReadiness_PROVIDER_READINESS_READY, ReadinessTransitionTime: timestamppb.New(t0)}
	tests := []struct {
		name        string
		prev        *healthv1.ProviderHealth
		result      providerhealth.Result
		want        healthv1.ProviderReadiness
		wantReason  string
		wantMessage string
		wantSince   time.Time
	}{
		{name: "all ready", result: providerhealth.Result{Type: "kvm", Supported: true, Targets: ready("nas1", "nas2")},
			want: healthv1.ProviderReadiness_PROVIDER_READINESS_READY, wantReason: providerhealth.ReasonAllTargetsReady, wantMessage: "2 of 2 targets ready", wantSince: t1},
		{name: "still ready keeps its time", prev: readyAt, result: providerhealth.Result{Type: "kvm", Supported: true, Targets: ready("nas1")},
			want: healthv1.ProviderReadiness_PROVIDER_READINESS_READY, wantReason: providerhealth.ReasonAllTargetsReady, wantMessage: "1 of 1 targets ready", wantSince: t0},
		{name: "a target down names it", prev: readyAt, result: providerhealth.Result{Type: "kvm", Supported: true,
			Targets: append(ready("nas1"), providerhealth.TargetStatus{Name: "nas2", Reason: "Unreachable"})},
			want: healthv1.ProviderReadiness_PROVIDER_READINESS_NOT_READY, wantReason: providerhealth.ReasonTargetsNotReady, wantMessage: "nas2: Unreachable", wantSince: t1},
		{name: "no targets is unknown", prev: readyAt, result: providerhealth.Result{Type: "kvm", Supported: true},
			want: healthv1.ProviderReadiness_PROVIDER_READINESS_UNKNOWN, wantReason: providerhealth.ReasonNoTargets, wantMessage: "the provider has nothing to check", wantSince: t1},
		{name: "no check", result: providerhealth.Result{Type: "gcp"},
			want: healthv1.ProviderReadiness_PROVIDER_READINESS_UNKNOWN, wantReason: providerhealth.ReasonChecksNotImplemented, wantMessage: "the gcp provisioner implements no backend check", wantSince: t1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.result.Provider, tc.result.CheckedAt = "p", t1
			h := providerhealth.BuildHealth(tc.prev, tc.result)
			if h.GetReadiness() != tc.want || h.GetReason() != tc.wantReason || h.GetMessage() != tc.wantMessage {
				t.Errorf("got %s/%s %q, want %s/%s %q", h.GetReadiness(), h.GetReason(), h.GetMessage(), tc.want, tc.wantReason, tc.wantMessage)
			}
			if got := h.GetReadinessTransitionTime().AsTime(); !got.Equal(tc.wantSince) {
				t.Errorf("readiness transition time = %s, want %s", got, tc.wantSince)
			}
		})
	}
}

func TestBuildHealth_messageOfManyFailingTargetsIsBounded(t *testing.T) {
	t.Parallel()
	var ts []providerhealth.TargetStatus
	for i := range 200 {
		ts = append(ts, providerhealth.TargetStatus{Name: fmt.Sprintf("node-%03d", i), Reason: "Unreachable"})
	}
	h := providerhealth.BuildHealth(nil, providerhealth.Result{Provider: "pve", Type: "proxmox", Supported: true, CheckedAt: time.Now(), Targets: ts})
	if n := utf8.RuneCountInString(h.GetMessage()); n != 1024 || !strings.HasPrefix(h.GetMessage(), "node-000: Unreachable; node-001") {
		t.Errorf("message of %d characters %q..., want the first failing targets in at most 1024", n, h.GetMessage()[:40])
	}
}

func TestMonitor_logsOnlyTransitions(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	f := &fakeProvisioner{}
	m, logs := newMonitor(t, st, providerhealth.Target{Name: "kvm-home", Type: "kvm", Checker: startProvisioner(t, "kvm-home", f)})
	rounds := [][]*provisionerv1.TargetStatus{
		{up("nas1")},
		{up("nas1")},
		{down("nas1", "Unreachable")},
		{down("nas1", "Unreachable")},
		{down("nas1", "Timeout")},
		{up("nas1")},
		{up("nas1")},
	}
	for _, r := range rounds {
		f.set(targets(r...))
		m.CheckOnce(context.Background())
	}
	var got [][2]string
	for _, l := range logs.lines(t) {
		msg, _ := l["msg"].(string)
		if strings.Contains(msg, "rovider target") {
			reason, _ := l["reason"].(string)
			got = append(got, [2]string{msg, reason})
		}
	}
	want := [][2]string{
		{"WARNING: provider target not ready", "Unreachable"},
		{"WARNING: provider target not ready", "Timeout"},
		{"Provider target ready", "Reachable"},
	}
	if len(got) != len(want) {
		t.Fatalf("logged %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("line %d = %v, want %v", i, got[i], want[i])
		}
	}
}

func TestMonitor_Run_offCleansUpAndReturns(t *testing.T) {
	t.Parallel()
	_, st := storetest.New(t)
	ctx := context.Background()
	if err := st.SaveProvider(ctx, providerhealth.BuildHealth(nil, providerhealth.Result{Provider: "kvm-home", Type: "kvm", Supported: true, CheckedAt: time.Now()})); err != nil {
		t.Fatal(err)
	}
	f := &fakeProvisioner{}
	f.set(targets(up("nas1")))
	m, _ := newMonitor(t, st, providerhealth.Target{Name: "kvm-home", Type: "kvm", Checker: startProvisioner(t, "kvm-home", f)})
	m.Interval, m.Timeout = 0, 0

	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run() = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return with checking off")
	}
	if f.calls.Load() != 0 {
		t.Error("a check ran with checking off")
	}
	if h := get(t, st, "kvm-home"); h != nil {
		t.Errorf("kvm-home still stored: %v; want no stale record left", h)
	}
}

func TestMonitor_Run_singletonChecksAtOnceAndCleansUp(t *testing.T) {
	t.Parallel()
	dsn, st := storetest.New(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := st.SaveProvider(ctx, providerhealth.BuildHealth(nil, providerhealth.Result{Provider: "retired", Type: "kvm", CheckedAt: time.Now()})); err != nil {
		t.Fatal(err)
	}
	f := &fakeProvisioner{}
	f.set(targets(up("nas1")))
	checker := startProvisioner(t, "kvm-home", f)
	newReplica := func() *providerhealth.Monitor {
		pool, err := postgres.Connect(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		m, _ := newMonitor(t, store.New(pool), providerhealth.Target{Name: "kvm-home", Type: "kvm", Checker: checker})
		m.Interval, m.Lock, m.LockKey, m.Retry = time.Hour, pool, 42, 50*time.Millisecond
		return m
	}
	a, b := newReplica(), newReplica()
	actx, stopA := context.WithCancel(ctx)
	doneA := make(chan error, 1)
	go func() { doneA <- a.Run(actx) }()
	waittest.For(t, 15*time.Second, "the first replica's check", func() bool { return get(t, st, "kvm-home") != nil && len(a.Snapshot()) == 1 })
	if get(t, st, "retired") != nil {
		t.Error("the unconfigured provider's record was kept")
	}

	doneB := make(chan error, 1)
	go func() { doneB <- b.Run(ctx) }()
	// b retries the lock every 50ms and must not get it while a holds it.
	tick := time.NewTicker(10 * time.Millisecond)
	for range 30 {
		<-tick.C
		if len(b.Snapshot()) != 0 || f.calls.Load() != 1 {
			t.Fatalf("a second replica checked while the first holds the lock (calls %d)", f.calls.Load())
		}
	}
	tick.Stop()

	// The first replica stops: the second takes over and checks at once.
	stopA()
	if err := <-doneA; err != nil {
		t.Fatal(err)
	}
	if len(a.Snapshot()) != 0 {
		t.Error("a stopped replica still exports gauges")
	}
	waittest.For(t, 15*time.Second, "the second replica to take over", func() bool { return len(b.Snapshot()) == 1 && f.calls.Load() == 2 })

	reg := prometheus.NewRegistry()
	reg.MustRegister(providerhealth.Collector{M: b})
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP egress_provider_target_up 1 when the provider target passed its last check, else 0.
# TYPE egress_provider_target_up gauge
egress_provider_target_up{provider="kvm-home",target="nas1"} 1
# HELP egress_provider_check_duration_seconds How long the last check of the provider target took.
# TYPE egress_provider_check_duration_seconds gauge
egress_provider_check_duration_seconds{provider="kvm-home",target="nas1"} 0.003
`), "egress_provider_target_up", "egress_provider_check_duration_seconds"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(providerhealth.Collector{M: b}, "egress_provider_check_timestamp_seconds"); n != 1 {
		t.Errorf("%d timestamp series, want 1", n)
	}
	cancel()
	if err := <-doneB; err != nil {
		t.Fatal(err)
	}
}

func TestValidateSchedule(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name              string
		interval, timeout time.Duration
		wantErr           bool
	}{
		{"off", 0, 0, false},
		{"defaults", time.Minute, 15 * time.Second, false},
		{"shortest interval", 10 * time.Second, 10 * time.Second, false},
		{"too frequent", 5 * time.Second, time.Second, true},
		{"negative interval", -time.Minute, time.Second, true},
		{"timeout left to derive, short interval", 12 * time.Second, 0, false},
		{"negative timeout", time.Minute, -time.Second, true},
		{"timeout longer than interval", time.Minute, 2 * time.Minute, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if err := providerhealth.ValidateSchedule(tc.interval, tc.timeout); (err != nil) != tc.wantErr {
				t.Errorf("ValidateSchedule(%s, %s) = %v, want error %v", tc.interval, tc.timeout, err, tc.wantErr)
			}
		})
	}
}

func TestBuildHealth_truncatesLongMessages(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("é", 3000)
	h := providerhealth.BuildHealth(nil, providerhealth.Result{Provider: "kvm", Type: "kvm", Supported: true, CheckedAt: time.Now(),
		Targets: []providerhealth.TargetStatus{{Name: "nas1", Reason: "Unreachable", Message: long}}})
	msg := h.GetTargets()[0].GetMessage()
	if n := utf8.RuneCountInString(msg); n != 1024 {
		t.Errorf("message has %d characters, want 1024", n)
	}
	if !strings.HasSuffix(msg, "…") {
		t.Error("a truncated message does not end with an ellipsis")
	}
}
