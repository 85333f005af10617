package orchtest

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/durationpb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/api"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/atrest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/dispatch"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/gc"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/pool"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// Providers is the providers config of every harness: two local ones,
// "fake" and "other".
const Providers = "providers:\n  - {name: fake, type: local}\n  - {name: other, type: local}\n"

// Harness is one orchestrator database and NATS JetStream server, the API
// on them (in-process, and over gRPC with the contract's rules checked as
// the service serves it), and any number of replicas started on them.
type Harness struct {
	t testing.TB

	DSN   string
	NATS  *natstest.Server
	JS    jetstream.JetStream
	Names bus.Names
	// Logs holds every replica's log.
	Logs *logtest.Buffer
	// Providers is the config the API and the replicas read (a test may
	// remove one, as a restart with a new file would).
	Providers *providers.Config
	Keys      *atrest.Keyring
	Store     *store.Store
	API       *api.Server
	Client    proxyv1.ProxyServiceClient
	Pools     proxyv1.ProxyPoolServiceClient

	// What replicas started from now on run with: the lifecycle's
	// schedule (FastTiming unless changed), the outbox's refresh interval
	// (0: the default) and the lease demand their pool controllers read
	// (nil: none).
	Timing       lifecycle.Timing
	EventRefresh time.Duration
	Demand       *pool.Book

	// GC is the first replica's orphan collector, for calling Sweep.
	GC *gc.Collector
}

// FastTiming is the lifecycle schedule of the harness: deadlines of
// seconds and polls of tens of milliseconds, resync once an hour (so a
// running proxy is left alone unless a test makes it due).
// Installation is the installation identity of the harness's replicas.
const Installation = "orchtest"

func FastTiming() lifecycle.Timing {
	return lifecycle.Timing{
		CreateDeadline: 3 * time.Second, GetDeadline: 3 * time.Second, DeleteDeadline: 3 * time.Second,
		ProvisioningPoll: 50 * time.Millisecond, Resync: time.Hour, DeletionPoll: 50 * time.Millisecond,
		TransientBase: 20 * time.Millisecond, TransientMax: 200 * time.Millisecond,
		QuotaBase: 100 * time.Millisecond, QuotaMax: time.Second, UnconfiguredRetry: 100 * time.Millisecond,
	}
}

// New starts a harness for t: database, NATS with the streams, the API.
// Everything stops when t ends.
func New(t testing.TB) *Harness {
	t.Helper()
	ctx := context.Background()
	provs, err := providers.Parse([]byte(Providers))
	if err != nil {
		t.Fatal(err)
	}
	srv := natstest.New(t)
	h := &Harness{
		t: t, DSN: Database(t), NATS: srv, JS: srv.JetStream(t), Names: bus.Names{Prefix: "t"},
		Logs: &logtest.Buffer{}, Providers: provs, Timing: FastTiming(),
	}
	if err := bus.EnsureStreams(ctx, h.JS, h.Names); err != nil {
		t.Fatal(err)
	}
	pg, err := postgres.Connect(ctx, h.DSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	h.Keys = Keyring(t)
	h.Store = store.New(pg, store.WithKeyring(h.Keys))
	h.API = &api.Server{Store: h.Store, Providers: providers.Static(provs), Changes: store.NewSignal(), WatchPoll: 50 * time.Millisecond,
		FirstCommands: &firstCommands{h: h}}
	gs := grpctest.NewServer(t)
	proxyv1.RegisterProxyServiceServer(gs, h.API)
	proxyv1.RegisterProxyPoolServiceServer(gs, &api.PoolServer{Server: h.API})
	conn := grpctest.Dial(t, grpctest.Serve(t, gs))
	h.Client = proxyv1.NewProxyServiceClient(conn)
	h.Pools = proxyv1.NewProxyPoolServiceClient(conn)
	apiCtx, stopAPI := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = h.API.Run(apiCtx) }()
	t.Cleanup(func() { stopAPI(); <-done })
	return h
}

// StartReplica runs one orchestrator replica's loops — the database
// listener, claims, results, health, outbox and the pool controller (plus
// the demand consumer with a Demand book) — until the returned stop is
// called or the test ends.
func (h *Harness) StartReplica() (stop func()) {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pg, err := postgres.Connect(ctx, h.DSN)
	if err != nil {
		h.t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(h.Logs, nil))
	work, changes := store.NewSignal(), store.NewSignal()
	st := store.New(pg, store.WithKeyring(h.Keys))
	collector := &gc.Collector{
		Store: st, JS: h.JS, Names: h.Names, Installation: Installation, Providers: h.Providers.Names, Grace: time.Minute,
		Deadline: 5 * time.Second, Log: log, Metrics: gc.NewMetrics(prometheus.NewRegistry()),
	}
	if h.GC == nil {
		h.GC = collector
	}
	d := &dispatch.Dispatcher{
		Store: st, JS: h.JS, Names: h.Names, Log: log, Work: work, Changes: changes,
		Machine: &lifecycle.Machine{Timing: h.Timing, Configured: h.configured, Log: log, Installation: Installation},
		Metrics: dispatch.NewMetrics(prometheus.NewRegistry()), ClaimBatch: 32, Poll: 100 * time.Millisecond,
		EventRefresh: h.EventRefresh,
		Handlers:     map[busv1.CommandPurpose]dispatch.ResultHandler{busv1.CommandPurpose_COMMAND_PURPOSE_ORPHAN_GC: collector},
	}
	ctrl := &pool.Controller{
		Store: st, Changes: changes, Log: log, Metrics: pool.NewMetrics(nil),
		Resync: 200 * time.Millisecond, MinInterval: 20 * time.Millisecond,
	}
	loops := []func(context.Context) error{
		func(ctx context.Context) error { return store.Listen(ctx, pg, work, changes, log) },
		d.RunClaims, d.RunResults, d.RunHealth, d.RunOutbox, ctrl.Run,
	}
	if h.Demand != nil {
		ctrl.Demand = h.Demand.Get
		loops = append(loops, func(ctx context.Context) error { return pool.ConsumeDemand(ctx, h.JS, h.Names, h.Demand, log) })
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
			pg.Close()
		})
	}
	h.t.Cleanup(stop)
	return stop
}

// firstCommands decides and publishes the harness API's first commands
// with h's Timing as it is at the first create (tests change it after New).
type firstCommands struct {
	h    *Harness
	once sync.Once
	d    *dispatch.Dispatcher
}

func (f *firstCommands) dispatcher() *dispatch.Dispatcher {
	f.once.Do(func() {
		log := slog.New(slog.NewTextHandler(f.h.Logs, nil))
		f.d = &dispatch.Dispatcher{
			Store: f.h.Store, JS: f.h.JS, Names: f.h.Names, Log: log,
			Machine: &lifecycle.Machine{Timing: f.h.Timing, Configured: f.h.configured, Log: log, Installation: Installation},
			Metrics: dispatch.NewMetrics(prometheus.NewRegistry()),
		}
	})
	return f.d
}

func (f *firstCommands) DecideNew(p *lifecycle.Proxy, now time.Time) *busv1.Command {
	return f.dispatcher().DecideNew(p, now)
}

func (f *firstCommands) PublishNew(ctx context.Context, start time.Time, cmds []dispatch.NewCommand) {
	f.dispatcher().PublishNew(ctx, start, cmds)
}

func (h *Harness) configured(name string) bool {
	_, ok := h.Providers.Get(name)
	return ok
}

// Controller is a pool controller on the harness's store that no replica
// runs, for calling Sync and SweepDrained directly; it reads the
// harness's Demand.
func (h *Harness) Controller() *pool.Controller {
	c := &pool.Controller{Store: h.Store, Changes: store.NewSignal(), Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Metrics: pool.NewMetrics(nil)}
	if h.Demand != nil {
		c.Demand = h.Demand.Get
	}
	return c
}

// Keyring is a cloud-init keyring of one fresh random key.
func Keyring(t testing.TB) *atrest.Keyring {
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

// Managed is a CreateProxy request for a MANAGED proxy of provider fake.
func Managed(name string) *proxyv1.CreateProxyRequest {
	return &proxyv1.CreateProxyRequest{Name: name, Spec: &proxyv1.ProxySpec{
		Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "fake",
		Placement: &proxyv1.Placement{Zone: "z1", MachineType: "small", Image: "debian"},
	}}
}

// Create creates a proxy through the API, failing the test on an error.
func (h *Harness) Create(req *proxyv1.CreateProxyRequest) *proxyv1.Proxy {
	h.t.Helper()
	resp, err := h.API.CreateProxy(context.Background(), req)
	if err != nil {
		h.t.Fatalf("CreateProxy(%s): %v", req.GetName(), err)
	}
	return resp.GetProxy()
}

// PoolSpec is a pool of replicas proxies spread evenly over fake and
// other, with a one-second drain timeout.
func PoolSpec(replicas int32) *proxyv1.ProxyPoolSpec {
	return &proxyv1.ProxyPoolSpec{
		Template: &proxyv1.ProxyTemplate{
			Labels: map[string]string{"team": "crawl"},
			Spec: &proxyv1.ProxySpec{
				Mode:      proxyv1.ProxyMode_PROXY_MODE_MANAGED,
				Placement: &proxyv1.Placement{Zone: "z1", MachineType: "small", Image: "debian"},
			},
		},
		Replicas:     replicas,
		Spread:       []*proxyv1.SpreadTarget{{Provider: "fake", Weight: 1}, {Provider: "other", Weight: 1}},
		DrainTimeout: durationpb.New(time.Second),
	}
}
