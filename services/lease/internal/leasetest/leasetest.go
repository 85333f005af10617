// Package leasetest is the lease service's test harness: a database per
// test, the service running in-process on the real service frame (gRPC,
// REST, auth, metrics), a fake clock, proxy snapshots and one client
// interface over both transports, so that every case runs over gRPC and
// over REST.
package leasetest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/app"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/mirror"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/store"
)

// Database returns a fresh migrated database for the test.
func Database(t testing.TB) string {
	t.Helper()
	return pgtest.NewDatabase(t, pgtest.Template{
		Name:        "lease",
		Fingerprint: pgtest.Fingerprint(store.Migrations()),
		Migrate: func(ctx context.Context, dsn string) error {
			return store.Migrate(ctx, dsn, nil)
		},
	})
}

// Clock is a fake clock that moves only when told.
type Clock struct {
	mu  sync.Mutex
	now time.Time
}

// NewClock starts a clock at a fixed instant.
func NewClock() *Clock {
	return &Clock{now: time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)}
}

// Now is the current fake time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock forward.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// Tokens are the clients of the test token file: client id → token.
var Tokens = map[string]string{"crawler-a": "token-a-0123456789", "crawler-b": "token-b-0123456789"}

// ViewerToken is the token of client "ops", a viewer: it lists every
// client's leases and watches them.
const ViewerToken = "token-ops-0123456789"

// GatewayToken is the token of client "gateway", a crawler and a
// service, as the gateway leases: it leases, watches the changes and
// lists the cooldowns.
const GatewayToken = "token-gateway-0123456789"

// TokenFile writes the token file of Tokens, each client a crawler, of
// ViewerToken and of GatewayToken, and returns its path.
func TokenFile(t testing.TB) string {
	t.Helper()
	var b strings.Builder
	for id, tok := range Tokens {
		fmt.Fprintf(&b, "%s %s crawler\n", id, tok)
	}
	fmt.Fprintf(&b, "ops %s viewer\n", ViewerToken)
	fmt.Fprintf(&b, "gateway %s crawler,service\n", GatewayToken)
	f := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(f, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return f
}

// Env is one running lease service.
type Env struct {
	GRPCAddr string
	HTTPAddr string
	NATS     *natstest.Server
	Parts    *app.Parts
	Clock    *Clock
	Config   app.Config
	conn     *grpc.ClientConn
}

// Options tune Start.
type Options struct {
	// Config adjusts the configuration before start.
	Config func(*app.Config)
	// AuthDisabled runs without tokens.
	AuthDisabled bool
	// Limits are the per-client rate limits; none when zero.
	Limits auth.Limits
	// DatabaseURL reuses a database; empty creates one.
	DatabaseURL string
	// NATS reuses a server; nil starts one.
	NATS *natstest.Server
}

// Start runs the lease service in-process with a fake clock, a token file
// with Tokens, and a long sweep interval (tests sweep explicitly).
func Start(t testing.TB, o Options) *Env {
	t.Helper()
	clock := NewClock()
	nsrv := o.NATS
	if nsrv == nil {
		nsrv = natstest.New(t)
	}
	cfg := app.DefaultConfig()
	cfg.Database.URL = o.DatabaseURL
	if cfg.Database.URL == "" {
		cfg.Database.URL = Database(t)
	}
	cfg.Database.Migrate = false
	cfg.NATS.URL = nsrv.URL()
	cfg.SweepInterval = time.Hour
	cfg.Now = clock.Now
	if o.Config != nil {
		o.Config(&cfg)
	}
	authCfg := &auth.Config{Disabled: o.AuthDisabled}
	if !o.AuthDisabled {
		authCfg.TokenFile = TokenFile(t)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s, err := service.New(ctx, service.Options{
		Name: "lease", GRPCListen: "127.0.0.1:0", HTTPListen: "127.0.0.1:0",
		LogLevel: "error", LogFormat: "json", ShutdownTimeout: 5 * time.Second, Auth: authCfg, Limits: o.Limits,
	}, app.Options()...)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	parts, err := cfg.Setup(ctx, s)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("service stopped with %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("service did not stop in 30s")
		}
	})
	env := &Env{GRPCAddr: s.GRPCAddr(), HTTPAddr: s.HTTPAddr(), NATS: nsrv, Parts: parts, Clock: clock, Config: cfg}
	waittest.For(t, 10*time.Second, "the service is ready", func() bool {
		resp, err := http.Get("http://" + env.HTTPAddr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	env.conn, err = grpc.NewClient(env.GRPCAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { env.conn.Close() })
	return env
}

// Proxy builds a Ready, healthy MANAGED proxy snapshot.
func Proxy(uid, name string, mut ...func(*proxyv1.Proxy)) *proxyv1.Proxy {
	p := &proxyv1.Proxy{
		Uid:    uid,
		Name:   name,
		Labels: map[string]string{"pool": "default"},
		Spec: &proxyv1.ProxySpec{
			Mode:      proxyv1.ProxyMode_PROXY_MODE_MANAGED,
			Provider:  "kvm-lab",
			Placement: &proxyv1.Placement{Region: "eu", Zone: "eu-1"},
		},
		Status: &proxyv1.ProxyStatus{
			Phase:                proxyv1.ProxyPhase_PROXY_PHASE_READY,
			ProviderId:           "vm-" + uid,
			Ip:                   "10.0.0." + fmt.Sprint(len(name)),
			Port:                 3128,
			Healthy:              true,
			HealthTransitionTime: timestamppb.New(time.Date(2026, 3, 1, 11, 0, 0, 0, time.UTC)),
		},
	}
	for _, m := range mut {
		m(p)
	}
	return p
}

// MaxLeases sets spec.lease.max_leases.
func MaxLeases(n uint32) func(*proxyv1.Proxy) {
	return func(p *proxyv1.Proxy) { p.Spec.Lease = &proxyv1.LeaseSpec{MaxLeases: proto.Uint32(n)} }
}

// Result is a call's outcome on either transport.
type Result struct {
	Status *status.Status
	// HTTPCode is the HTTP status over REST; 0 over gRPC.
	HTTPCode int
}

// Code is the gRPC code.
func (r Result) Code() codes.Code { return r.Status.Code() }

// Client calls the lease API as one client over one transport.
type Client interface {
	Name() string
	List(ctx context.Context, req *leasev1.ListProxiesRequest) (*leasev1.ListProxiesResponse, Result)
	Acquire(ctx context.Context, req *leasev1.AcquireLeaseRequest) (*leasev1.AcquireLeaseResponse, Result)
	Renew(ctx context.Context, req *leasev1.RenewLeaseRequest) (*leasev1.RenewLeaseResponse, Result)
	Release(ctx context.Context, req *leasev1.ReleaseLeaseRequest) (*leasev1.ReleaseLeaseResponse, Result)
	Report(ctx context.Context, req *leasev1.ReportOutcomeRequest) (*leasev1.ReportOutcomeResponse, Result)
}

// Transports are the two ways to reach the service.
var Transports = []string{"grpc", "rest"}

// Client returns a client for clientID ("" sends no token) over transport.
func (e *Env) Client(transport, clientID string) Client {
	token := Tokens[clientID]
	if clientID != "" && token == "" {
		token = clientID // an unknown token
	}
	if transport == "rest" {
		return &restClient{base: "http://" + e.HTTPAddr, token: token}
	}
	return &grpcClient{c: leasev1.NewLeaseServiceClient(e.conn), token: token}
}

type grpcClient struct {
	c     leasev1.LeaseServiceClient
	token string
}

func (g *grpcClient) Name() string { return "grpc" }

func (g *grpcClient) opts() []grpc.CallOption {
	if g.token == "" {
		return nil
	}
	return []grpc.CallOption{grpc.PerRPCCredentials(auth.BearerToken(g.token))}
}

func res(err error) Result { return Result{Status: status.Convert(err)} }

func (g *grpcClient) List(ctx context.Context, req *leasev1.ListProxiesRequest) (*leasev1.ListProxiesResponse, Result) {
	r, err := g.c.ListProxies(ctx, req, g.opts()...)
	return r, res(err)
}

func (g *grpcClient) Acquire(ctx context.Context, req *leasev1.AcquireLeaseRequest) (*leasev1.AcquireLeaseResponse, Result) {
	r, err := g.c.AcquireLease(ctx, req, g.opts()...)
	return r, res(err)
}

func (g *grpcClient) Renew(ctx context.Context, req *leasev1.RenewLeaseRequest) (*leasev1.RenewLeaseResponse, Result) {
	r, err := g.c.RenewLease(ctx, req, g.opts()...)
	return r, res(err)
}

func (g *grpcClient) Release(ctx context.Context, req *leasev1.ReleaseLeaseRequest) (*leasev1.ReleaseLeaseResponse, Result) {
	r, err := g.c.ReleaseLease(ctx, req, g.opts()...)
	return r, res(err)
}

func (g *grpcClient) Report(ctx context.Context, req *leasev1.ReportOutcomeRequest) (*leasev1.ReportOutcomeResponse, Result) {
	r, err := g.c.ReportOutcome(ctx, req, g.opts()...)
	return r, res(err)
}

type restClient struct {
	base  string
	token string
}

func (r *restClient) Name() string { return "rest" }

// Raw sends a request with a raw body and returns the response's status
// and body.
func Raw(ctx context.Context, method, url, token string, body []byte) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

func (r *restClient) do(ctx context.Context, method, path string, body proto.Message, out proto.Message) Result {
	var data []byte
	if body != nil {
		var err error
		if data, err = protojson.Marshal(body); err != nil {
			return Result{Status: status.New(codes.Internal, err.Error())}
		}
	}
	code, b, err := Raw(ctx, method, r.base+path, r.token, data)
	if err != nil {
		return Result{Status: status.New(codes.Unavailable, err.Error())}
	}
	if code == http.StatusOK {
		if err := protojson.Unmarshal(b, out); err != nil {
			return Result{Status: status.New(codes.Internal, "decoding response: "+err.Error()), HTTPCode: code}
		}
		return Result{Status: status.New(codes.OK, ""), HTTPCode: code}
	}
	var sp spb.Status
	if err := protojson.Unmarshal(b, &sp); err != nil {
		return Result{Status: status.New(codes.Unknown, fmt.Sprintf("HTTP %d, undecodable body %q: %v", code, b, err)), HTTPCode: code}
	}
	return Result{Status: status.FromProto(&sp), HTTPCode: code}
}

func (r *restClient) List(ctx context.Context, req *leasev1.ListProxiesRequest) (*leasev1.ListProxiesResponse, Result) {
	q := url.Values{}
	sel := req.GetSelector()
	for k, v := range map[string]string{"selector.provider": sel.GetProvider(), "selector.region": sel.GetRegion(), "selector.zone": sel.GetZone()} {
		if v != "" {
			q.Set(k, v)
		}
	}
	for k, v := range sel.GetLabels() {
		q.Set("selector.labels["+k+"]", v)
	}
	if sel.GetPool() != "" {
		q.Set("selector.pool", sel.GetPool())
	}
	if req.GetPageSize() != 0 {
		q.Set("page_size", fmt.Sprint(req.GetPageSize()))
	}
	if req.GetPageToken() != "" {
		q.Set("page_token", req.GetPageToken())
	}
	out := &leasev1.ListProxiesResponse{}
	rs := r.do(ctx, http.MethodGet, "/v1/leasable-proxies?"+q.Encode(), nil, out)
	return out, rs
}

func (r *restClient) Acquire(ctx context.Context, req *leasev1.AcquireLeaseRequest) (*leasev1.AcquireLeaseResponse, Result) {
	out := &leasev1.AcquireLeaseResponse{}
	rs := r.do(ctx, http.MethodPost, "/v1/leases", req, out)
	return out, rs
}

func leasePath(id, verb string) string {
	if id == "" {
		id = "-"
	}
	return "/v1/leases/" + url.PathEscape(id) + ":" + verb
}

func (r *restClient) Renew(ctx context.Context, req *leasev1.RenewLeaseRequest) (*leasev1.RenewLeaseResponse, Result) {
	out := &leasev1.RenewLeaseResponse{}
	body := proto.Clone(req).(*leasev1.RenewLeaseRequest)
	body.LeaseId = ""
	rs := r.do(ctx, http.MethodPost, leasePath(req.GetLeaseId(), "renew"), body, out)
	return out, rs
}

func (r *restClient) Release(ctx context.Context, req *leasev1.ReleaseLeaseRequest) (*leasev1.ReleaseLeaseResponse, Result) {
	out := &leasev1.ReleaseLeaseResponse{}
	rs := r.do(ctx, http.MethodPost, leasePath(req.GetLeaseId(), "release"), &leasev1.ReleaseLeaseRequest{}, out)
	return out, rs
}

func (r *restClient) Report(ctx context.Context, req *leasev1.ReportOutcomeRequest) (*leasev1.ReportOutcomeResponse, Result) {
	out := &leasev1.ReportOutcomeResponse{}
	body := proto.Clone(req).(*leasev1.ReportOutcomeRequest)
	body.LeaseId = ""
	rs := r.do(ctx, http.MethodPost, leasePath(req.GetLeaseId(), "report"), body, out)
	return out, rs
}

// Apply stores a proxy snapshot at revision, as applying its event would.
func (e *Env) Apply(t testing.TB, p *proxyv1.Proxy, revision int64) {
	t.Helper()
	ps, err := mirror.FromProxy(p, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Parts.Store.ApplyProxy(context.Background(), ps, revision); err != nil {
		t.Fatal(err)
	}
}

// PublishProxy publishes a ProxyEvent as the orchestrator does.
func (e *Env) PublishProxy(t testing.TB, typ proxyv1.ChangeType, p *proxyv1.Proxy, revision int64) {
	t.Helper()
	PublishProxy(t, e.NATS, e.Config.NATS.Prefix, typ, p, revision)
}

// PublishProxy publishes a ProxyEvent on nsrv under prefix.
func PublishProxy(t testing.TB, nsrv *natstest.Server, prefix string, typ proxyv1.ChangeType, p *proxyv1.Proxy, revision int64) {
	t.Helper()
	js := nsrv.JetStream(t)
	names := bus.Names{Prefix: prefix}
	ev := &busv1.ProxyEvent{Revision: revision, Type: typ, Proxy: p, ChangeTime: timestamppb.Now()}
	if _, err := bus.Publish(context.Background(), js, names.ProxyEventSubject(p.GetUid()), ev); err != nil {
		t.Fatal(err)
	}
}

// PublishHealth publishes a HealthTransitionEvent as the health service
// does.
func (e *Env) PublishHealth(t testing.TB, tr *healthv1.HealthTransition) {
	t.Helper()
	js := e.NATS.JetStream(t)
	names := bus.Names{Prefix: e.Config.NATS.Prefix}
	if _, err := bus.Publish(context.Background(), js, names.HealthEventSubject(tr.GetProxyUid()), &busv1.HealthTransitionEvent{Transition: tr}); err != nil {
		t.Fatal(err)
	}
}

// Ctx is a context with a test-sized deadline.
func Ctx(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}
