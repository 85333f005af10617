package main

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/proxytest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store/storetest"
)

// env is what a process-level test runs the service against: a database,
// NATS, a real TLS probe target and its CA file.
type env struct {
	dsn    string
	nats   *natstest.Server
	js     jetstream.JetStream
	names  bus.Names
	target *httptest.Server
	caFile string
	dir    string
}

func newEnv(t testing.TB) *env {
	t.Helper()
	dsn, _ := storetest.New(t)
	ns := natstest.New(t)
	js := ns.JetStream(t)
	names := bus.Names{Prefix: "e2e"}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := bus.EnsureStreams(ctx, js, names); err != nil {
		t.Fatal(err)
	}
	target := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") }))
	// Probes cut short (a killed replica) end handshakes midway; that is
	// expected noise.
	target.Config.ErrorLog = log.New(io.Discard, "", 0)
	target.StartTLS()
	t.Cleanup(target.Close)
	dir := t.TempDir()
	caFile := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: target.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	return &env{dsn: dsn, nats: ns, js: js, names: names, target: target, caFile: caFile, dir: dir}
}

func (e *env) args(replica string, extra ...string) []string {
	return append([]string{
		"--database-url=" + e.dsn,
		"--nats-url=" + e.nats.URL(),
		"--nats-prefix=" + e.names.Prefix,
		"--probe-target=" + e.target.URL + "/healthz",
		"--probe-ca-file=" + e.caFile,
		// Roomy for a loaded CI machine running three race-enabled
		// processes; the tests wait on outcomes, not on these timings.
		"--probe-interval=500ms",
		"--probe-timeout=500ms",
		"--success-threshold=2",
		"--failure-threshold=2",
		"--state-flush-interval=100ms",
		"--membership-ttl=2s",
		"--replica-id=" + replica,
		"--auth-disabled",
		"--log-level=debug",
	}, extra...)
}

var revision struct {
	sync.Mutex
	n int64
}

func (e *env) publish(t *testing.T, typ proxyv1.ChangeType, p *proxyv1.Proxy) {
	t.Helper()
	revision.Lock()
	revision.n++
	rev := revision.n
	revision.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := bus.Publish(ctx, e.js, e.names.ProxyEventSubject(p.GetUid()), &busv1.ProxyEvent{Revision: rev, Type: typ, Proxy: p}); err != nil {
		t.Fatal(err)
	}
}

func hostPort(t testing.TB, addr string) (string, uint32) {
	t.Helper()
	h, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return h, uint32(n)
}

func external(t testing.TB, uid, name, addr string) *proxyv1.Proxy {
	h, p := hostPort(t, addr)
	return &proxyv1.Proxy{Uid: uid, Name: name,
		Spec:   &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: h, Port: p}},
		Status: &proxyv1.ProxyStatus{Phase: proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, Ip: h, Port: p}}
}

func managed(t *testing.T, uid, name, providerID, addr string) *proxyv1.Proxy {
	h, p := hostPort(t, addr)
	return &proxyv1.Proxy{Uid: uid, Name: name,
		Spec:   &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "local-1", Port: p},
		Status: &proxyv1.ProxyStatus{Phase: proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, Ip: h, Port: p, ProviderId: providerID}}
}

// healthEvents collects every HealthTransitionEvent published.
type healthEvents struct {
	mu  sync.Mutex
	evs []*busv1.HealthTransitionEvent
}

func (e *env) followHealth(t *testing.T) *healthEvents {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cons, err := e.js.OrderedConsumer(ctx, e.names.HealthEventStream(), jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	he := &healthEvents{}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		var ev busv1.HealthTransitionEvent
		if _, err := bus.Decode(ctx, m, &ev); err != nil {
			t.Errorf("undecodable health event: %v", err)
			return
		}
		he.mu.Lock()
		he.evs = append(he.evs, &ev)
		he.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Stop(); cancel() })
	return he
}

// last returns the latest event of a proxy, if any.
func (h *healthEvents) last(uid string) *busv1.HealthTransitionEvent {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i := len(h.evs) - 1; i >= 0; i-- {
		if h.evs[i].GetTransition().GetProxyUid() == uid {
			return h.evs[i]
		}
	}
	return nil
}

func (h *healthEvents) all() []*busv1.HealthTransitionEvent {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]*busv1.HealthTransitionEvent(nil), h.evs...)
}

func getJSON(t *testing.T, url string, into any) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if into != nil && resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(body, into); err != nil {
			t.Fatalf("%s: %v\n%s", url, err, body)
		}
	}
	return resp.StatusCode
}

func getText(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return string(body)
}

type checkingProvisioner struct {
	provisionerv1.UnimplementedProvisionerServiceServer
}

func (checkingProvisioner) CheckBackend(context.Context, *provisionerv1.CheckBackendRequest) (*provisionerv1.CheckBackendResponse, error) {
	return &provisionerv1.CheckBackendResponse{Targets: []*provisionerv1.TargetStatus{
		{Name: "host1", Address: "127.0.0.1:22", Ready: true, Reason: "Reachable", Latency: durationpb.New(2 * time.Millisecond)},
	}}, nil
}

// TestFlow runs the binary against real NATS, PostgreSQL, squid, a Go
// proxy and a TLS target: proxies learnt from ProxyEvents are probed, their
// transitions stored, published and served over REST; a proxy that starts
// refusing flips; a deleted one is pruned with its metric series; the
// provider check reaches a provisioner over gRPC.
func TestFlow(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	sq := proxytest.StartSquid(t, proxytest.SquidOptions{})
	good := proxytest.StartProxy(t, proxytest.Behaviour{})
	refusing := proxytest.StartProxy(t, proxytest.Behaviour{Status: http.StatusForbidden})

	gs := grpc.NewServer()
	provisionerv1.RegisterProvisionerServiceServer(gs, checkingProvisioner{})
	provAddr := grpctest.Serve(t, gs)
	provCfg := filepath.Join(e.dir, "providers.yaml")
	if err := os.WriteFile(provCfg, []byte("providers:\n  - name: local-1\n    type: local\n  - name: gcp-eu\n    type: gcp\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	events := e.followHealth(t)
	p, addrs := servicetest.Start(t, ".", e.args("replica-a",
		"--providers-config="+provCfg, "--provisioner=local-1="+provAddr, "--provider-check-interval=10s"))
	base := "http://" + addrs.HTTP

	e.publish(t, proxyv1.ChangeType_CHANGE_TYPE_CREATED, external(t, "uid-squid", "via-squid", sq.Addr()))
	e.publish(t, proxyv1.ChangeType_CHANGE_TYPE_CREATED, managed(t, "uid-go", "via-go", "local/vm-1", good.Addr()))
	e.publish(t, proxyv1.ChangeType_CHANGE_TYPE_CREATED, external(t, "uid-bad", "refusing", refusing.Addr()))
	// Not running yet: never probed.
	pendingProxy := managed(t, "uid-pending", "pending", "", good.Addr())
	pendingProxy.Status.Phase = proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING
	e.publish(t, proxyv1.ChangeType_CHANGE_TYPE_CREATED, pendingProxy)

	verdict := func(uid string, healthy bool) func() bool {
		return func() bool {
			ev := events.last(uid)
			return ev != nil && ev.GetTransition().GetHealthy() == healthy
		}
	}
	waittest.For(t, 20*time.Second, "squid-backed proxy healthy", verdict("uid-squid", true))
	waittest.For(t, 20*time.Second, "Go proxy healthy", verdict("uid-go", true))
	waittest.For(t, 20*time.Second, "refusing proxy unhealthy", verdict("uid-bad", false))
	if tr := events.last("uid-go").GetTransition(); tr.GetProviderId() != "local/vm-1" || tr.GetProxyName() != "via-go" || tr.GetReason() != "ProbeSucceeded" {
		t.Errorf("via-go transition = %v", tr)
	}
	if tr := events.last("uid-bad").GetTransition(); tr.GetReason() != "ConnectRefused" || !strings.Contains(tr.GetMessage(), "403") {
		t.Errorf("refusing transition = %v", tr)
	}

	// REST: one proxy, then the list.
	var one struct {
		Health struct {
			ProxyName    string `json:"proxyName"`
			Healthy      bool   `json:"healthy"`
			VerdictKnown bool   `json:"verdictKnown"`
			Prober       string `json:"prober"`
			Address      string `json:"address"`
		} `json:"health"`
	}
	waittest.For(t, 10*time.Second, "GET /v1/health/proxies/via-squid healthy", func() bool {
		return getJSON(t, base+"/v1/health/proxies/via-squid", &one) == http.StatusOK && one.Health.Healthy
	})
	if !one.Health.VerdictKnown || one.Health.Prober != "replica-a" || one.Health.Address != sq.Addr() {
		t.Errorf("GET via-squid = %+v", one.Health)
	}
	var list struct {
		Proxies []struct {
			ProxyName string `json:"proxyName"`
		} `json:"proxies"`
	}
	waittest.For(t, 10*time.Second, "three proxies listed", func() bool {
		return getJSON(t, base+"/v1/health/proxies", &list) == http.StatusOK && len(list.Proxies) == 3
	})
	if got := []string{list.Proxies[0].ProxyName, list.Proxies[1].ProxyName, list.Proxies[2].ProxyName}; strings.Join(got, ",") != "refusing,via-go,via-squid" {
		t.Errorf("listed %v, want name order", got)
	}
	if code := getJSON(t, base+"/v1/health/proxies/pending", nil); code != http.StatusNotFound {
		t.Errorf("GET a provisioning proxy = %d, want 404", code)
	}

	// The watch over REST: newline-delimited JSON, resuming after the
	// first transition.
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	req, _ := http.NewRequestWithContext(wctx, http.MethodGet, base+"/v1/health/proxies:watch?since_sequence=1", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var line struct {
		Result struct {
			Transition struct {
				Sequence  string `json:"sequence"`
				ProxyName string `json:"proxyName"`
			} `json:"transition"`
		} `json:"result"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&line); err != nil || line.Result.Transition.Sequence != "2" || line.Result.Transition.ProxyName == "" {
		t.Errorf("first watched transition = %+v (%v), want sequence 2", line, err)
	}
	wcancel()
	_ = resp.Body.Close()

	// The Go proxy starts refusing: after the failure threshold it flips.
	good.SetBehaviour(proxytest.Behaviour{Status: http.StatusBadGateway})
	waittest.For(t, 20*time.Second, "Go proxy unhealthy after it breaks", verdict("uid-go", false))
	if tr := events.last("uid-go").GetTransition(); tr.GetReason() != "BadStatus" {
		t.Errorf("flip reason = %s, want BadStatus", tr.GetReason())
	}

	// Sequences strictly increase across all proxies.
	var prev int64
	for _, ev := range events.all() {
		if s := ev.GetTransition().GetSequence(); s <= prev {
			t.Errorf("sequence %d after %d", s, prev)
		} else {
			prev = s
		}
	}

	// Metrics observe every probe, per proxy.
	metrics := getText(t, base+"/metrics")
	for _, want := range []string{
		`egress_health_probe_duration_seconds_count{proxy="refusing"}`,
		`egress_health_probe_failures_total{proxy="refusing"}`,
		`egress_provider_target_up{provider="local-1",target="host1"} 1`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	// Provider health over REST: the checked one, and the one without a
	// provisioner as ChecksNotImplemented.
	var providers struct {
		Providers []struct {
			Provider     string `json:"provider"`
			Readiness    string `json:"readiness"`
			Reason       string `json:"reason"`
			TargetsReady string `json:"targetsReady"`
		} `json:"providers"`
	}
	if code := getJSON(t, base+"/v1/health/providers", &providers); code != http.StatusOK || len(providers.Providers) != 2 {
		t.Fatalf("GET /v1/health/providers = %d %+v", code, providers)
	}
	if p := providers.Providers[0]; p.Provider != "local-1" || p.Readiness != "PROVIDER_READINESS_READY" || p.TargetsReady != "1/1" {
		t.Errorf("local-1 = %+v", p)
	}
	if p := providers.Providers[1]; p.Provider != "gcp-eu" || p.Readiness != "PROVIDER_READINESS_UNKNOWN" || p.Reason != "ChecksNotImplemented" {
		t.Errorf("gcp-eu = %+v", p)
	}

	// Deleted: pruned from probing, the API and the metrics.
	e.publish(t, proxyv1.ChangeType_CHANGE_TYPE_DELETED, external(t, "uid-bad", "refusing", refusing.Addr()))
	waittest.For(t, 10*time.Second, "the deleted proxy gone from the API and /metrics", func() bool {
		return getJSON(t, base+"/v1/health/proxies/refusing", nil) == http.StatusNotFound &&
			!strings.Contains(getText(t, base+"/metrics"), `proxy="refusing"`)
	})
	before := refusing.Requests()
	waittest.For(t, 10*time.Second, "still running", func() bool { return good.Requests() > 0 && events.last("uid-squid") != nil })
	// No probe of the deleted proxy after it was pruned: give the engine a
	// few intervals by waiting for the other proxies' probes.
	base0 := good.Requests()
	waittest.For(t, 10*time.Second, "five more probes of via-go", func() bool { return good.Requests() >= base0+5 })
	if after := refusing.Requests(); after > before+1 {
		t.Errorf("the deleted proxy was probed %d more times", after-before)
	}

	// A watch open at SIGTERM ends with the service instead of holding the
	// graceful stop for its whole timeout.
	conn, err := grpc.NewClient(addrs.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	watch, err := healthv1.NewHealthServiceClient(conn).WatchProxyHealth(context.Background(), &healthv1.WatchProxyHealthRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := watch.Header(); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	p.Signal(t, syscall.SIGTERM)
	if _, err := watch.Recv(); status.Code(err) != codes.Unavailable {
		t.Errorf("watch at shutdown ended with %v, want Unavailable", err)
	}
	if code := p.Wait(t, 20*time.Second); code != 0 {
		t.Errorf("exit code %d", code)
	}
	if took := time.Since(stopped); took > 10*time.Second {
		t.Errorf("shutdown with an open watch took %s", took)
	}
}
