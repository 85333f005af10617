package dispatch_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/api"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/atrest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/dispatch"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/gc"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
	poolctl "github.com/egress-proxies/egress-proxies/services/orchestrator/internal/pool"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/reconcile"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// harness is one orchestrator database and NATS server with any number of
// orchestrator replicas running on them in-process.
type harness struct {
	t    testing.TB
	dsn  string
	nats *natstest.Server
	js   jetstream.JetStream
	logs *logtest.Buffer // every replica's log
	// eventRefresh is the replicas' Dispatcher.EventRefresh (0: default).
	eventRefresh time.Duration
	// timing is the replicas' reconcile timing (nil: fastTiming).
	timing *reconcile.Timing
	names  bus.Names
	provs  *providers.Config
	api    *api.Server
	// client reaches api over gRPC as the service serves it: the
	// contract's rules checked before the handler.
	client proxyv1.ProxyServiceClient
	// pools reaches the ProxyPoolService the same way.
	pools proxyv1.ProxyPoolServiceClient
	// demand is what the replicas' pool controllers read as lease demand
	// (nil: none).
	demand *poolctl.Book
	keys   *atrest.Keyring
	store  *store.Store
	gc     *gc.Collector
}

var testProviders = "providers:\n  - {name: fake, type: local}\n  - {name: other, type: local}\n"

func fastTiming() reconcile.Timing {
	return reconcile.Timing{
		CreateDeadline: 3 * time.Second, GetDeadline: 3 * time.Second, DeleteDeadline: 3 * time.Second,
		ProvisioningPoll: 50 * time.Millisecond, Resync: time.Hour, DeletionPoll: 50 * time.Millisecond,
		TransientBase: 20 * time.Millisecond, TransientMax: 200 * time.Millisecond,
		QuotaBase: 100 * time.Millisecond, QuotaMax: time.Second, UnconfiguredRetry: 100 * time.Millisecond,
	}
}

func newHarness(t testing.TB) *harness {
	t.Helper()
	ctx := context.Background()
	provs, err := providers.Parse([]byte(testProviders))
	if err != nil {
		t.Fatal(err)
	}
	srv := natstest.New(t)
	h := &harness{t: t, dsn: orchtest.Database(t), nats: srv, js: srv.JetStream(t), logs: &logtest.Buffer{}, names: bus.Names{Prefix: "t"}, provs: provs}
	if err := bus.EnsureStreams(ctx, h.js, h.names); err != nil {
		t.Fatal(err)
	}
	pool, err := postgres.Connect(ctx, h.dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	h.keys = testKeyring(t)
	h.store = store.New(pool, store.WithKeyring(h.keys))
	h.api = &api.Server{Store: h.store, Providers: provs, Changes: store.NewSignal(), WatchPoll: 50 * time.Millisecond}
	gs := grpctest.NewServer(t)
	proxyv1.RegisterProxyServiceServer(gs, h.api)
	proxyv1.RegisterProxyPoolServiceServer(gs, &api.PoolServer{Server: h.api})
	conn := grpctest.Dial(t, grpctest.Serve(t, gs))
	h.client = proxyv1.NewProxyServiceClient(conn)
	h.pools = proxyv1.NewProxyPoolServiceClient(conn)
	apiCtx, stopAPI := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = h.api.Run(apiCtx) }()
	t.Cleanup(func() { stopAPI(); <-done })
	return h
}

// startReplica runs one orchestrator replica's loops until the returned
// stop is called (or the test ends).
func (h *harness) startReplica() (stop func()) {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pool, err := postgres.Connect(ctx, h.dsn)
	if err != nil {
		h.t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(h.logs, nil))
	timing := fastTiming()
	if h.timing != nil {
		timing = *h.timing
	}
	work, changes := store.NewSignal(), store.NewSignal()
	st := store.New(pool, store.WithKeyring(h.keys))
	d := &dispatch.Dispatcher{
		Store: st, JS: h.js, Names: h.names, Log: log, Work: work, Changes: changes,
		Engine:  &reconcile.Engine{Timing: timing, Configured: func(n string) bool { _, ok := h.provs.Get(n); return ok }, Log: log},
		Metrics: dispatch.NewMetrics(prometheus.NewRegistry()), ClaimBatch: 32, Poll: 100 * time.Millisecond,
		EventRefresh: h.eventRefresh,
	}
	d.GC = &gc.Collector{
		Store: st, JS: h.js, Names: h.names, Providers: h.provs.Names, Grace: time.Minute,
		Deadline: 5 * time.Second, Log: log, Metrics: gc.NewMetrics(prometheus.NewRegistry()),
	}
	if h.gc == nil {
		h.gc = d.GC
	}
	ctrl := &poolctl.Controller{
		Store: st, Changes: changes, Log: log, Metrics: poolctl.NewMetrics(nil),
		Resync: 200 * time.Millisecond, MinInterval: 20 * time.Millisecond,
	}
	loops := []func(context.Context) error{
		func(ctx context.Context) error { return store.Listen(ctx, pool, work, changes, log) },
		d.RunClaims, d.RunResults, d.RunHealth, d.RunOutbox, ctrl.Run,
	}
	if h.demand != nil {
		ctrl.Demand = h.demand.Get
		loops = append(loops, func(ctx context.Context) error { return poolctl.ConsumeDemand(ctx, h.js, h.names, h.demand, log) })
	}
	var wg sync.WaitGroup
	for _, loop := range loops {
		wg.Add(1)
		go func() { defer wg.Done(); _ = loop(ctx) }()
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			wg.Wait()
			pool.Close()
		})
	}
	h.t.Cleanup(stop)
	return stop
}

// script answers one command; nil means "don't answer" (a lost command).
type script func(cmd *busv1.Command) *busv1.CommandResult

// fakeProvisioner consumes a provider's real command stream like a
// provisioner replica and answers with script, counting what it received.
type fakeProvisioner struct {
	mu       sync.Mutex
	received []*busv1.Command
	script   script
}

func (h *harness) startProvisioner(provider string, s script) *fakeProvisioner {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	h.t.Cleanup(cancel)
	cons, err := h.js.CreateOrUpdateConsumer(ctx, h.names.CommandStream(), jetstream.ConsumerConfig{
		Durable: h.names.ProvisionerConsumer(provider), FilterSubject: h.names.CommandSubject(provider),
		AckPolicy: jetstream.AckExplicitPolicy,
	})
	if err != nil {
		h.t.Fatal(err)
	}
	f := &fakeProvisioner{script: s}
	done := make(chan struct{})
	// Stop before the NATS server does (cleanups run last-in first-out),
	// so a fetch in progress ends normally.
	h.t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			batch, err := cons.Fetch(64, jetstream.FetchMaxWait(100*time.Millisecond))
			if err != nil {
				continue
			}
			for m := range batch.Messages() {
				cmd := &busv1.Command{}
				if _, err := bus.Decode(ctx, m, cmd); err != nil {
					_ = m.Term()
					continue
				}
				f.mu.Lock()
				f.received = append(f.received, cmd)
				sc := f.script
				f.mu.Unlock()
				if res := sc(cmd); res != nil {
					res.CommandId, res.ProxyUid, res.Provider = cmd.GetCommandId(), cmd.GetProxyUid(), cmd.GetProvider()
					res.SpecHash, res.Operation, res.Purpose = cmd.GetSpecHash(), cmd.GetOperation(), cmd.GetPurpose()
					if _, err := bus.Publish(ctx, h.js, h.names.ResultSubject(provider), res); err != nil && ctx.Err() == nil {
						h.t.Errorf("publishing a result: %v", err)
					}
				}
				_ = m.Ack()
			}
		}
	}()
	return f
}

func (f *fakeProvisioner) setScript(s script) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.script = s
}

// count returns how many commands of op were received for uid ("" = any).
func (f *fakeProvisioner) count(op busv1.Operation, uid string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, c := range f.received {
		if c.GetOperation() == op && (uid == "" || c.GetProxyUid() == uid) {
			n++
		}
	}
	return n
}

// cloudBackend is a scripted backend with instances that exist until
// deleted: Create is idempotent per UID, Get answers NotFound once gone.
type cloudBackend struct {
	mu        sync.Mutex
	instances map[string]string // uid -> spec hash of the live instance
	created   map[string]int
}

func newCloud() *cloudBackend {
	return &cloudBackend{instances: map[string]string{}, created: map[string]int{}}
}

func (c *cloudBackend) answer(cmd *busv1.Command) *busv1.CommandResult {
	c.mu.Lock()
	defer c.mu.Unlock()
	uid := cmd.GetProxyUid()
	inst := &provisionerv1.Instance{ProviderId: "vm/" + uid, ProxyUid: uid, State: provisionerv1.InstanceState_INSTANCE_STATE_RUNNING, Ip: "10.0.0.1"}
	switch cmd.GetOperation() {
	case busv1.Operation_OPERATION_CREATE:
		if _, ok := c.instances[uid]; !ok {
			c.created[uid]++
		}
		c.instances[uid] = cmd.GetSpecHash()
		return &busv1.CommandResult{Outcome: &busv1.CommandResult_Create{Create: &provisionerv1.CreateInstanceResponse{Instance: inst}}}
	case busv1.Operation_OPERATION_GET:
		if _, ok := c.instances[uid]; !ok {
			return failure(errclass.NotFound, "instance gone")
		}
		return &busv1.CommandResult{Outcome: &busv1.CommandResult_Get{Get: &provisionerv1.GetInstanceResponse{Instance: inst}}}
	case busv1.Operation_OPERATION_DELETE:
		_, existed := c.instances[uid]
		delete(c.instances, uid)
		return &busv1.CommandResult{Outcome: &busv1.CommandResult_Delete{Delete: &provisionerv1.DeleteInstanceResponse{Deleted: existed}}}
	}
	return failure(errclass.Permanent, "unexpected operation")
}

func (c *cloudBackend) live(uid string) (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	h, ok := c.instances[uid]
	return h, ok
}

func failure(class errclass.Class, msg string) *busv1.CommandResult {
	return &busv1.CommandResult{Outcome: &busv1.CommandResult_Error{Error: errclass.ToCommandError(errclass.New(class, "%s", msg))}}
}

func managed(name string) *proxyv1.CreateProxyRequest {
	return &proxyv1.CreateProxyRequest{Name: name, Spec: &proxyv1.ProxySpec{
		Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "fake",
		Placement: &proxyv1.Placement{Zone: "z1", MachineType: "small", Image: "debian"},
	}}
}

func (h *harness) create(req *proxyv1.CreateProxyRequest) *proxyv1.Proxy {
	h.t.Helper()
	resp, err := h.api.CreateProxy(context.Background(), req)
	if err != nil {
		h.t.Fatalf("CreateProxy(%s): %v", req.GetName(), err)
	}
	return resp.GetProxy()
}

// waitFor polls the proxy until cond holds, failing after 20s.
func (h *harness) waitFor(name string, what string, cond func(*store.Row) bool) *store.Row {
	h.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		r, err := h.store.Get(context.Background(), name)
		if err == nil && cond(r) {
			return r
		}
		if err != nil && err != store.ErrNotFound {
			h.t.Fatal(err)
		}
		if time.Now().After(deadline) {
			if r == nil {
				h.t.Fatalf("%s: not %s within 20s: %v", name, what, err)
			}
			h.t.Fatalf("%s: not %s within 20s; last: %+v", name, what, *r)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (h *harness) waitGone(name string) {
	h.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, err := h.store.Get(context.Background(), name)
		if err == store.ErrNotFound {
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("%s still exists after 20s", name)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func phase(p proxyv1.ProxyPhase) func(*store.Row) bool {
	return func(r *store.Row) bool { return r.Phase == p }
}

func (h *harness) publishHealth(uid, providerID string, seq int64, healthy bool) {
	h.t.Helper()
	ev := &busv1.HealthTransitionEvent{Transition: &healthv1.HealthTransition{
		Sequence: seq, ProxyUid: uid, ProviderId: providerID, Healthy: healthy, TransitionTime: timestamppb.Now(),
	}}
	if _, err := bus.Publish(context.Background(), h.js, h.names.HealthEventSubject(uid), ev); err != nil {
		h.t.Fatal(err)
	}
}

// testKeyring is a cloud-init keyring of one fresh random key.
func testKeyring(t testing.TB) *atrest.Keyring {
	t.Helper()
	key := make([]byte, atrest.KeySize)
	if _, err := rand.Read(key); err != nil {
		t.Fatal(err)
	}
	k, err := atrest.Parse([]byte("active: test\nkeys:\n  test: " + base64.StdEncoding.EncodeToString(key) + "\n"))
	if err != nil {
		t.Fatal(err)
	}
	return k
}
