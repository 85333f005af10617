package main

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	collectortracev1 "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

// span is one exported span as the receiver got it.
type span struct {
	service, name             string
	traceID, spanID, parentID string
}

// otlpReceiver is an OTLP/gRPC trace collector on a loopback port: the
// services under test export their spans to it.
type otlpReceiver struct {
	collectortracev1.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans []span
}

func startReceiver(t *testing.T) (*otlpReceiver, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &otlpReceiver{}
	srv := grpc.NewServer()
	collectortracev1.RegisterTraceServiceServer(srv, r)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	return r, lis.Addr().String()
}

func (r *otlpReceiver) Export(_ context.Context, req *collectortracev1.ExportTraceServiceRequest) (*collectortracev1.ExportTraceServiceResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		var service string
		for _, a := range rs.GetResource().GetAttributes() {
			if a.GetKey() == "service.name" {
				service = a.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				r.spans = append(r.spans, span{service: service, name: s.GetName(), traceID: hex.EncodeToString(s.GetTraceId()),
					spanID: hex.EncodeToString(s.GetSpanId()), parentID: hex.EncodeToString(s.GetParentSpanId())})
			}
		}
	}
	return &collectortracev1.ExportTraceServiceResponse{}, nil
}

// find returns the spans named name whose parent is parent ("" = any).
func (r *otlpReceiver) find(name string, parent *span) []span {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []span
	for _, s := range r.spans {
		if s.name == name && (parent == nil || s.traceID == parent.traceID && s.parentID == parent.spanID) {
			out = append(out, s)
		}
	}
	return out
}

func (r *otlpReceiver) dump() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var b strings.Builder
	for _, s := range r.spans {
		fmt.Fprintf(&b, "  %s %s trace %s span %s parent %s\n", s.service, s.name, s.traceID, s.spanID, s.parentID)
	}
	return b.String()
}

// killProcessesUnder kills every process whose command line names dir
// (the local provisioner's proxies).
func killProcessesUnder(dir string) {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || !strings.Contains(string(cmdline), dir+"/") {
			continue
		}
		var pid int
		if _, err := fmt.Sscan(e.Name(), &pid); err == nil {
			if p, err := os.FindProcess(pid); err == nil {
				_ = p.Kill()
			}
		}
	}
}

// One trace runs from the CreateProxy call through the reconcile claim,
// the NATS command, the provisioner's operation and the result's apply,
// across the real orchestrator and provisioner-local processes exporting
// over OTLP; orphan GC's sweeps are traced the same way.
func TestOneTracePerProxyAcrossProcesses(t *testing.T) {
	t.Parallel()
	recv, addr := startReceiver(t)
	env := []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + addr,
		"OTEL_EXPORTER_OTLP_PROTOCOL=grpc",
		"OTEL_EXPORTER_OTLP_INSECURE=true",
		"OTEL_BSP_SCHEDULE_DELAY=100",
	}
	nats := natstest.New(t)
	dir := t.TempDir()
	stateDir := filepath.Join(dir, "local")
	t.Cleanup(func() { killProcessesUnder(stateDir) })
	network := fmt.Sprintf("127.%d.%d.0/24", 200+time.Now().Nanosecond()%50, time.Now().Nanosecond()/50%250)
	providers := filepath.Join(dir, "providers.yaml")
	if err := os.WriteFile(providers, []byte(fmt.Sprintf(
		"providers:\n  - name: local\n    type: local\n    local: {stateDir: %q, network: %q, proxy: builtin}\n", stateDir, network)), 0o600); err != nil {
		t.Fatal(err)
	}
	// Through the environment: builds whose provisioners take no
	// credentials ignore it, the others need it.
	servicetest.Start(t, "../provisioner-local", []string{"--nats-url=" + nats.URL(), "--providers-config=" + providers,
		"--provider=local", "--replica-id=traced-1", "--ack-wait=5s"}, append(env, "EGRESS_AUTH_DISABLED=true")...)
	_, orch := servicetest.Start(t, ".", []string{"--auth-disabled", "--providers-config=" + providers,
		"--database-url=" + orchtest.Database(t), "--nats-url=" + nats.URL(), "--gc-interval=1s", "--gc-grace=1h",
		"--cloud-init-key-file=" + cloudInitKeyring(t),
		"--provisioning-poll=200ms"}, env...)

	conn, err := grpc.NewClient(orch.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := proxyv1.NewProxyServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := client.CreateProxy(ctx, &proxyv1.CreateProxyRequest{Name: "traced",
		Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "local"}}); err != nil {
		t.Fatal(err)
	}
	waittest.ForErr(t, 60*time.Second, "traced Running", func() error {
		resp, err := client.GetProxy(ctx, &proxyv1.GetProxyRequest{Name: "traced"})
		if err != nil {
			return err
		}
		if st := resp.GetProxy().GetStatus(); st.GetPhase() != proxyv1.ProxyPhase_PROXY_PHASE_RUNNING {
			return fmt.Errorf("status %v", st)
		}
		return nil
	})

	// Each link, parent to child, as soon as the batch exporters sent it.
	one := func(name string, parent *span, service string) span {
		t.Helper()
		var found span
		err := waittest.Until(30*time.Second, func() error {
			for _, s := range recv.find(name, parent) {
				if s.service == service {
					found = s
					return nil
				}
			}
			return errors.New("not received")
		})
		if err != nil {
			under := "any parent"
			if parent != nil {
				under = parent.name + " " + parent.spanID
			}
			t.Fatalf("no %s span of %s under %s; received:\n%s", name, service, under, recv.dump())
		}
		return found
	}
	api := one("egress.proxy.v1.ProxyService/CreateProxy", nil, "orchestrator")
	claim := one("reconcile.claim", &api, "orchestrator")
	command := one("provisioner.command", &claim, "provisioner-local")
	one("provisioner.create", &command, "provisioner-local")
	one("reconcile.apply_result", &command, "orchestrator")

	sweep := one("gc.sweep", nil, "orchestrator")
	list := one("provisioner.command", &sweep, "provisioner-local")
	one("provisioner.list", &list, "provisioner-local")
	one("gc.handle_list", &list, "orchestrator")
}
