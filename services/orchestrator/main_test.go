package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

func providersFile(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "providers.yaml")
	if err := os.WriteFile(p, []byte("providers:\n  - {name: local, type: local}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// The binary starts and serves whether NATS is up or down.
func TestBinaryLifecycle(t *testing.T) {
	t.Parallel()
	for name, natsURL := range map[string]string{"NATS up": natstest.New(t).URL(), "NATS down": natstest.DownURL(t)} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			servicetest.AssertLifecycle(t, ".", "orchestrator", []string{
				"--auth-disabled",
				"--providers-config=" + providersFile(t),
				"--database-url=" + orchtest.Database(t),
				"--nats-url=" + natsURL,
			})
		})
	}
}

// The REST layer over the real binary: bearer tokens required except on
// /healthz and /metrics; validation and status codes as a REST client sees
// them.
func TestRESTWithAuth(t *testing.T) {
	t.Parallel()
	tokens := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(tokens, []byte("ops tok-ops admin\nboard tok-viewer viewer\nfleet tok-crawler crawler\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, addrs := servicetest.Start(t, ".", []string{
		"--auth-token-file=" + tokens,
		"--providers-config=" + providersFile(t),
		"--cloud-init-key-file=" + cloudInitKeyring(t),
		"--database-url=" + orchtest.Database(t),
		"--nats-url=" + natstest.New(t).URL(),
	})
	base := "http://" + addrs.HTTP
	call := func(method, path, token, body string) (int, map[string]any) {
		t.Helper()
		req, err := http.NewRequest(method, base+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		var out map[string]any
		_ = json.Unmarshal(raw, &out)
		return resp.StatusCode, out
	}
	for _, path := range []string{"/healthz", "/metrics"} {
		if code, _ := call("GET", path, "", ""); code != 200 {
			t.Errorf("GET %s without a token = %d, want 200", path, code)
		}
	}
	good := `{"name":"p1","labels":{"pool":"eu"},"spec":{"mode":"PROXY_MODE_MANAGED","provider":"local"}}`
	if code, _ := call("POST", "/v1/proxies", "", good); code != http.StatusUnauthorized {
		t.Errorf("create without a token = %d, want 401", code)
	}
	if code, _ := call("POST", "/v1/proxies", "wrong", good); code != http.StatusUnauthorized {
		t.Errorf("create with a wrong token = %d, want 401", code)
	}
	code, body := call("POST", "/v1/proxies", "tok-ops", good)
	if code != 200 {
		t.Fatalf("create = %d %v", code, body)
	}
	proxy, _ := body["proxy"].(map[string]any)
	status, _ := proxy["status"].(map[string]any)
	spec, _ := proxy["spec"].(map[string]any)
	if proxy["name"] != "p1" || status["phase"] != "PROXY_PHASE_PENDING" || spec["port"] != float64(3128) || body["created"] != true {
		t.Errorf("created proxy = %v", body)
	}
	cases := []struct {
		method, path, body string
		want               int
		wantMsg            string
	}{
		{"POST", "/v1/proxies", `{"name":"Bad_Name","spec":{"mode":"PROXY_MODE_MANAGED","provider":"local"}}`, 400, "name:"},
		{"POST", "/v1/proxies", `{"name":"p2","spec":{"mode":"PROXY_MODE_MANAGED","provider":"local"},"colour":"red"}`, 400, "colour"},
		{"POST", "/v1/proxies", `{"name":"p2",`, 400, ""},
		{"POST", "/v1/proxies", `{"name":"p1","spec":{"mode":"PROXY_MODE_MANAGED","provider":"local","port":8080}}`, 409, "already exists"},
		{"GET", "/v1/proxies/nope", "", 404, "not found"},
		{"PUT", "/v1/proxies/p1", `{"generation":"99","spec":{"mode":"PROXY_MODE_MANAGED","provider":"local"}}`, 400, "generation is 1"},
		{"GET", "/v1/proxies?pageSize=5000", "", 400, "page_size"},
	}
	for _, tc := range cases {
		code, body := call(tc.method, tc.path, "tok-ops", tc.body)
		if code != tc.want || !strings.Contains(toString(body["message"]), tc.wantMsg) {
			t.Errorf("%s %s %s = %d %v; want %d with %q", tc.method, tc.path, tc.body, code, body, tc.want, tc.wantMsg)
		}
	}
	// Reconciles are counted once a worker claimed the proxy, which may
	// not have happened yet.
	var raw []byte
	waittest.ForErr(t, 20*time.Second, "a reconcile counted on /metrics", func() error {
		metrics, err := http.Get(base + "/metrics")
		if err != nil {
			return err
		}
		raw, err = io.ReadAll(metrics.Body)
		metrics.Body.Close()
		if err != nil {
			return err
		}
		if !strings.Contains(string(raw), "egress_orchestrator_reconciles_total") {
			return errors.New("egress_orchestrator_reconciles_total not there yet")
		}
		return nil
	})
	// The proxy is Pending, or Provisioning once a worker claimed it.
	if !strings.Contains(string(raw), `egress_orchestrator_proxies{phase="PROXY_PHASE_PENDING"} 1`) &&
		!strings.Contains(string(raw), `egress_orchestrator_proxies{phase="PROXY_PHASE_PROVISIONING"} 1`) {
		t.Errorf("/metrics does not count the proxy by phase")
	}
	for _, want := range []string{
		`egress_orchestrator_proxies{phase="PROXY_PHASE_READY"} 0`,
		`egress_orchestrator_commands_in_flight`,
		`egress_orchestrator_reconciles_total`,
	} {
		if !strings.Contains(string(raw), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	code, body = call("GET", "/v1/proxies?labels[pool]=eu", "tok-ops", "")
	if list, _ := body["proxies"].([]any); code != 200 || len(list) != 1 {
		t.Errorf("list by label = %d %v", code, body)
	}
	if code, body := call("GET", "/v1/providers", "tok-ops", ""); code != 200 || !strings.Contains(toString(body), "local") {
		t.Errorf("providers = %d %v", code, body)
	}

	// Roles and views over REST, on the real handlers.
	withCloudInit := `{"name":"p3","spec":{"mode":"PROXY_MODE_MANAGED","provider":"local","cloudInit":"#cloud-config\n# rest-s3cret\n"}}`
	if code, body := call("POST", "/v1/proxies", "tok-viewer", withCloudInit); code != http.StatusForbidden ||
		!strings.Contains(toString(body["message"]), "needs the role admin") {
		t.Errorf("create as a viewer = %d %v, want 403 naming admin", code, body)
	}
	if code, body := call("POST", "/v1/proxies", "tok-ops", withCloudInit); code != 200 || strings.Contains(toString(body), "s3cret") {
		t.Errorf("create with cloud-init = %d, echoing it: %v", code, body)
	}
	roleCases := []struct {
		path, token string
		want        int
		secret      bool
	}{
		{"/v1/proxies/p3", "tok-ops", 200, false},
		{"/v1/proxies/p3?view=PROXY_VIEW_BASIC", "tok-ops", 200, false},
		{"/v1/proxies/p3?view=PROXY_VIEW_FULL", "tok-ops", 200, true},
		{"/v1/proxies?view=PROXY_VIEW_FULL", "tok-ops", 200, true},
		{"/v1/proxies/p3", "tok-viewer", 200, false},
		{"/v1/proxies", "tok-viewer", 200, false},
		{"/v1/proxies/p3?view=PROXY_VIEW_FULL", "tok-viewer", 403, false},
		{"/v1/proxies?view=PROXY_VIEW_FULL", "tok-viewer", 403, false},
		{"/v1/proxies/p3", "tok-crawler", 403, false},
		{"/v1/proxies", "tok-crawler", 403, false},
		{"/v1/providers", "tok-crawler", 403, false},
	}
	for _, tc := range roleCases {
		code, body := call("GET", tc.path, tc.token, "")
		if code != tc.want || strings.Contains(toString(body), "rest-s3cret") != tc.secret {
			t.Errorf("GET %s as %s = %d (cloud-init shown: %v), want %d (%v): %v", tc.path, tc.token, code,
				strings.Contains(toString(body), "rest-s3cret"), tc.want, tc.secret, body)
		}
	}
	if code, _ := call("DELETE", "/v1/proxies/p1", "tok-crawler", ""); code != http.StatusForbidden {
		t.Errorf("delete as a crawler = %d, want 403", code)
	}
	if code, _ := call("DELETE", "/v1/proxies/p1", "tok-ops", ""); code != 200 {
		t.Errorf("delete = %d", code)
	}
}

// `orchestrator migrate` brings an empty database to the current schema.
func TestMigrateSubcommand(t *testing.T) {
	t.Parallel()
	empty := pgtest.NewDatabase(t, pgtest.Template{
		Name: "empty", Fingerprint: "none", Migrate: func(context.Context, string) error { return nil },
	})
	bin := proctest.Build(t, ".")
	p := proctest.Start(t, bin, []string{"migrate", "--database-url=" + empty})
	if code := p.Wait(t, 60*time.Second); code != 0 {
		t.Fatalf("migrate exit code %d:\n%s", code, p.Output())
	}
	p.WaitLog(t, time.Second, proctest.Msg("migrations applied"))
	pool, err := postgres.Connect(context.Background(), empty)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var rev int64
	if err := pool.QueryRow(context.Background(), "SELECT value FROM orchestrator.revision").Scan(&rev); err != nil {
		t.Errorf("schema not migrated: %v", err)
	}
}

func toString(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// An orchestrator process killed (SIGKILL) with a Create in flight: a new
// process picks up the result and the proxy converges with one instance.
func TestKilledWithCommandInFlight(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	js := ns.JetStream(t)
	dsn := orchtest.Database(t)
	args := []string{"--auth-disabled", "--providers-config=" + providersFile(t), "--database-url=" + dsn, "--nats-url=" + ns.URL(),
		"--cloud-init-key-file=" + cloudInitKeyring(t)}
	first, addrs := servicetest.Start(t, ".", args)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	names := bus.Names{}
	cons, err := js.CreateOrUpdateConsumer(ctx, names.CommandStream(), jetstream.ConsumerConfig{
		Durable: names.ProvisionerConsumer("local"), FilterSubject: names.CommandSubject("local"), AckPolicy: jetstream.AckExplicitPolicy,
	})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	creates := 0
	received := make(chan *busv1.Command, 16)
	go func() {
		for ctx.Err() == nil {
			m, err := cons.Next(jetstream.FetchMaxWait(time.Second))
			if err != nil {
				continue
			}
			cmd := &busv1.Command{}
			if _, err := bus.Decode(ctx, m, cmd); err == nil {
				// Orphan GC's list commands arrive here too; only creates matter.
				if cmd.GetOperation() == busv1.Operation_OPERATION_CREATE {
					mu.Lock()
					creates++
					mu.Unlock()
					received <- cmd
				}
			}
			_ = m.Ack()
		}
	}()

	conn, err := grpc.NewClient(addrs.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithPerRPCCredentials(auth.BearerToken("x")))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := proxyv1.NewProxyServiceClient(conn).CreateProxy(ctx, &proxyv1.CreateProxyRequest{Name: "p1", Spec: &proxyv1.ProxySpec{
		Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "local",
	}}); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	var cmd *busv1.Command
	select {
	case cmd = <-received:
	case <-ctx.Done():
		t.Fatal("no command reached the provisioner")
	}
	first.Kill(t)

	// The backend finishes while no orchestrator runs.
	res := &busv1.CommandResult{
		CommandId: cmd.GetCommandId(), ProxyUid: cmd.GetProxyUid(), Provider: "local", SpecHash: cmd.GetSpecHash(),
		Operation: cmd.GetOperation(), HandledBy: "test",
		Outcome: &busv1.CommandResult_Create{Create: &provisionerv1.CreateInstanceResponse{Instance: &provisionerv1.Instance{
			ProviderId: "local/" + cmd.GetProxyUid(), State: provisionerv1.InstanceState_INSTANCE_STATE_RUNNING, Ip: "127.0.0.1",
		}}},
	}
	if _, err := bus.Publish(ctx, js, names.ResultSubject("local"), res); err != nil {
		t.Fatal(err)
	}

	second, addrs := servicetest.Start(t, ".", args)
	conn, err = grpc.NewClient(addrs.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := proxyv1.NewProxyServiceClient(conn)
	var last *proxyv1.GetProxyResponse
	deadline, _ := ctx.Deadline()
	err = waittest.Until(time.Until(deadline), func() error {
		got, err := client.GetProxy(ctx, &proxyv1.GetProxyRequest{Name: "p1"})
		if err != nil {
			return err
		}
		last = got
		if got.GetProxy().GetStatus().GetPhase() != proxyv1.ProxyPhase_PROXY_PHASE_RUNNING {
			return errors.New("not Running yet")
		}
		return nil
	})
	if err != nil {
		if c, err := js.Consumer(context.Background(), names.ResultStream(), names.OrchestratorConsumer()); err == nil {
			ci, _ := c.Info(context.Background())
			t.Logf("results consumer: %+v", ci)
		}
		t.Fatalf("p1 did not converge after the restart: %v %v\n%s", last, err, second.Output())
	}
	if got := last.GetProxy().GetStatus().GetProviderId(); got != "local/"+cmd.GetProxyUid() {
		t.Errorf("providerID %q", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if creates != 1 {
		t.Errorf("creates dispatched = %d, want 1", creates)
	}
}
