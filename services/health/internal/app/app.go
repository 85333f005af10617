// Package app wires the health service: its flags, and the workers and API
// it registers on the service frame.
package app

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"hash/fnv"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/proxysync"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/health/internal/api"
	"github.com/egress-proxies/egress-proxies/services/health/internal/engine"
	"github.com/egress-proxies/egress-proxies/services/health/internal/fleet"
	"github.com/egress-proxies/egress-proxies/services/health/internal/membership"
	"github.com/egress-proxies/egress-proxies/services/health/internal/probe"
	"github.com/egress-proxies/egress-proxies/services/health/internal/providerhealth"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store"
	"github.com/egress-proxies/egress-proxies/services/health/internal/transitions"
)

// Config is the service's own configuration.
type Config struct {
	DatabaseURL        string
	NATSURL            string
	NATSPrefix         string
	NATSStreamReplicas int
	ProvidersConfig    string

	ProbeTarget   string
	ProbeCAFile   string
	Defaults      engine.Defaults
	MaxConcurrent int

	// Orchestrator is where resyncs list the proxies to probe; an empty
	// Addr means events only.
	Orchestrator   service.Client
	ResyncInterval time.Duration

	Provisioners provisionerFlag
	// ProvisionerClient is how every provisioner is reached (TLS, token);
	// its Addr comes from Provisioners.
	ProvisionerClient     service.Client
	ProviderCheckInterval time.Duration
	ProviderCheckTimeout  time.Duration

	ReplicaID          string
	MembershipTTL      time.Duration
	StateFlushInterval time.Duration
	Retention          time.Duration
	MigrateAtStart     bool
	TraceProbes        bool
}

// provisionerFlag is the repeated --provisioner provider=host:port.
type provisionerFlag map[string]string

func (p *provisionerFlag) String() string {
	var parts []string
	for k, v := range *p {
		parts = append(parts, k+"="+v)
	}
	return strings.Join(parts, ",")
}

func (p *provisionerFlag) Set(v string) error {
	if *p == nil {
		*p = provisionerFlag{}
	}
	// Comma-separated too, so one environment variable can carry all.
	for _, item := range strings.Split(v, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		name, addr, ok := strings.Cut(item, "=")
		if !ok || name == "" || addr == "" {
			return fmt.Errorf("want provider=host:port, got %q", item)
		}
		(*p)[name] = addr
	}
	return nil
}

// RegisterFlags adds the service's flags.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	host, _ := os.Hostname()
	fs.StringVar(&c.DatabaseURL, "database-url", "", "PostgreSQL URL (schema health); required")
	fs.StringVar(&c.NATSURL, "nats-url", nats.DefaultURL, "NATS server URL")
	fs.StringVar(&c.NATSPrefix, "nats-prefix", bus.DefaultPrefix, "prefix of the NATS subjects and streams")
	fs.IntVar(&c.NATSStreamReplicas, "nats-stream-replicas", 1, "JetStream servers that store each stream (3 on a three-server cluster); the same on every service")
	fs.StringVar(&c.ProvidersConfig, "providers-config", "", "providers YAML file (names and types); empty: no providers")
	fs.StringVar(&c.ProbeTarget, "probe-target", "", "URL fetched through every proxy: https:// for a CONNECT tunnel with TLS, http:// for a plain forward. Required: a URL the operator runs, never a third-party site")
	fs.StringVar(&c.ProbeCAFile, "probe-ca-file", "", "PEM file of CAs that verify the probe target (default: system roots)")
	fs.DurationVar(&c.Defaults.Interval, "probe-interval", engine.DefaultDefaults.Interval, "default time between probes of a proxy")
	fs.DurationVar(&c.Defaults.Timeout, "probe-timeout", engine.DefaultDefaults.Timeout, "default limit of one probe; at most --probe-interval")
	fs.IntVar(&c.Defaults.SuccessThreshold, "success-threshold", engine.DefaultDefaults.SuccessThreshold, "default successes in a row before a proxy is healthy")
	fs.IntVar(&c.Defaults.FailureThreshold, "failure-threshold", engine.DefaultDefaults.FailureThreshold, "default failures in a row before a healthy proxy is unhealthy")
	fs.IntVar(&c.MaxConcurrent, "max-concurrent-probes", 4096, "most probes in flight at once")
	fs.StringVar(&c.Orchestrator.Addr, "orchestrator-addr", "",
		"gRPC address of the orchestrator (host:port), whose ListProxies checks the proxies learnt from events; empty: events only")
	c.Orchestrator.RegisterFlags(fs, "orchestrator", "the orchestrator")
	fs.DurationVar(&c.ResyncInterval, "resync-interval", 5*time.Minute, "period of the safety-net resync from the orchestrator; 0 turns it off")
	fs.Var(&c.Provisioners, "provisioner", "provider=host:port of a provider's provisioner gRPC API; repeat, or separate with commas")
	c.ProvisionerClient.RegisterFlags(fs, "provisioner", "the provisioners")
	fs.DurationVar(&c.ProviderCheckInterval, "provider-check-interval", time.Minute, "time between provider backend checks; 0 turns them off, otherwise at least 10s")
	fs.DurationVar(&c.ProviderCheckTimeout, "provider-check-timeout", 0, "limit of one round of provider checks: 15s, or the interval when shorter; at most the interval")
	fs.StringVar(&c.ReplicaID, "replica-id", fmt.Sprintf("%s-%d", host, os.Getpid()), "this replica's name in the replica set")
	fs.DurationVar(&c.MembershipTTL, "membership-ttl", 10*time.Second, "how long a replica that stopped heartbeating keeps its proxies")
	fs.DurationVar(&c.StateFlushInterval, "state-flush-interval", 2*time.Second, "how often changed proxy states are written for the read API")
	fs.DurationVar(&c.Retention, "transition-retention", 7*24*time.Hour, "how long transitions are kept for WatchProxyHealth")
	fs.BoolVar(&c.MigrateAtStart, "migrate", true, "apply the database migrations at start")
	fs.BoolVar(&c.TraceProbes, "trace-health-probes", false, "emit one trace span per probe; off by default: probes run about once a second per proxy and would dominate trace volume")
}

// Validate checks the configuration.
func (c *Config) Validate() error {
	var errs []error
	if c.DatabaseURL == "" {
		errs = append(errs, errors.New("--database-url is required"))
	}
	if _, err := probe.ParseTarget(c.ProbeTarget); err != nil {
		errs = append(errs, err)
	}
	if err := c.Defaults.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := providerhealth.ValidateSchedule(c.ProviderCheckInterval, c.ProviderCheckTimeout); err != nil {
		errs = append(errs, err)
	}
	if c.MembershipTTL < time.Second {
		errs = append(errs, errors.New("--membership-ttl must be at least 1s"))
	}
	if c.StateFlushInterval <= 0 {
		errs = append(errs, errors.New("--state-flush-interval must be positive"))
	}
	if (c.Orchestrator.TokenFile != "" || c.Orchestrator.CAFile != "") && c.Orchestrator.Addr == "" {
		errs = append(errs, errors.New("--orchestrator-token-file and --orchestrator-ca-file need --orchestrator-addr"))
	}
	if c.ResyncInterval < 0 {
		errs = append(errs, errors.New("--resync-interval must not be negative"))
	}
	return errors.Join(errs...)
}

// Migrate applies the migrations (the migrate subcommand).
func (c *Config) Migrate(ctx context.Context, log *slog.Logger) error {
	if c.DatabaseURL == "" {
		return errors.New("--database-url is required")
	}
	return store.Migrate(ctx, c.DatabaseURL, log)
}

// lockKey is the advisory lock of the provider-check singleton.
func lockKey(prefix string) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("egress-health/provider-checks/" + prefix))
	return int64(h.Sum64() >> 1)
}

// Setup builds everything and registers it on s.
func (c *Config) Setup(ctx context.Context, s *service.Service) error {
	if err := c.Validate(); err != nil {
		return err
	}
	log := s.Log
	var provCfg *providers.Config
	if c.ProvidersConfig != "" {
		var err error
		if provCfg, err = providers.LoadFile(c.ProvidersConfig); err != nil {
			return err
		}
	} else {
		provCfg = &providers.Config{}
	}
	for name := range c.Provisioners {
		if _, ok := provCfg.Get(name); !ok {
			return fmt.Errorf("--provisioner %s: no such provider in the providers config", name)
		}
	}
	tlsCfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if c.ProbeCAFile != "" {
		pem, err := os.ReadFile(c.ProbeCAFile)
		if err != nil {
			return fmt.Errorf("--probe-ca-file: %w", err)
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			return fmt.Errorf("--probe-ca-file %s: no PEM certificates", c.ProbeCAFile)
		}
		tlsCfg.RootCAs = roots
	}
	prober, err := probe.New(probe.Options{Target: c.ProbeTarget, TLSConfig: tlsCfg, UserAgent: "egress-health/" + c.ReplicaID})
	if err != nil {
		return err
	}

	if c.MigrateAtStart {
		if err := store.Migrate(ctx, c.DatabaseURL, log); err != nil {
			return err
		}
	}
	pool, err := postgres.Connect(ctx, c.DatabaseURL)
	if err != nil {
		return err
	}
	names := bus.Names{Prefix: c.NATSPrefix}
	nc, js, err := bus.Connect(ctx, bus.ConnectOptions{URL: c.NATSURL, Name: "health " + c.ReplicaID, Names: names, StreamReplicas: c.NATSStreamReplicas, Log: s.Log, Metrics: s.Metrics})
	if err != nil {
		pool.Close()
		return err
	}

	st := store.New(pool)
	metrics := engine.NewMetrics(s.Metrics)
	rec := &transitions.Recorder{Store: st, Prober: c.ReplicaID, Log: log}
	pub := &transitions.Publisher{Store: st, JS: js, Names: names, Log: log}
	hub := &transitions.Hub{Store: st, Log: log}
	rec.Stored = func() { pub.Wake(); hub.Wake() }
	probeFn := prober.Probe
	if c.TraceProbes {
		tracer := otel.Tracer("egress/health")
		probeFn = func(ctx context.Context, addr string) probe.Result {
			ctx, span := tracer.Start(ctx, "health.probe", trace.WithAttributes(attribute.String("proxy.address", addr)))
			defer span.End()
			r := prober.Probe(ctx, addr)
			span.SetAttributes(attribute.String("probe.reason", r.Reason), attribute.Bool("probe.ok", r.OK))
			if !r.OK {
				span.SetStatus(codes.Error, r.Reason)
			}
			return r
		}
	}
	eng := engine.New(engine.Config{
		Probe:         probeFn,
		OnTransition:  rec.Add,
		OnResult:      metrics.Observe,
		OnRemove:      metrics.Forget,
		MaxConcurrent: c.MaxConcurrent,
	})
	rec.State = eng.Get
	mem := &membership.Membership{ID: c.ReplicaID, TTL: c.MembershipTTL, Log: log}
	var gone goneList
	fl := &fleet.Fleet{Engine: eng, Defaults: c.Defaults, Owns: mem.Owns, Gone: gone.add, Log: log,
		Prior: func(uids []string) map[string]fleet.Prior {
			pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			vs, err := st.Verdicts(pctx, uids)
			if err != nil {
				log.Warn("WARNING: reading earlier verdicts failed; the proxies taken over start without one", "proxies", len(uids), "error", err)
				return nil
			}
			out := make(map[string]fleet.Prior, len(vs))
			for uid, v := range vs {
				out[uid] = fleet.Prior{ProviderID: v.ProviderID, Verdict: engine.Verdict{Healthy: v.Healthy, LastTransition: v.LastTransition}}
			}
			return out
		}}
	mem.OnChange = func([]string) { fl.Rebalance() }

	var resync *proxysync.Loop
	var orch *grpc.ClientConn
	if c.Orchestrator.Addr != "" {
		if orch, err = c.Orchestrator.Dial(); err != nil {
			_ = nc.Drain()
			pool.Close()
			return fmt.Errorf("--orchestrator-addr: %w", err)
		}
		lister := proxyv1.NewProxyServiceClient(orch)
		resync = &proxysync.Loop{What: "the probed proxies", Interval: c.ResyncInterval, Log: log, Resync: func(ctx context.Context) error {
			ctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			start := time.Now()
			listed, changed, purged, err := fl.Resync(ctx, lister)
			if err != nil {
				return err
			}
			log.Info("probed proxies resynced from the orchestrator", "proxies", listed, "changed", changed, "purged", purged, "duration", time.Since(start))
			return nil
		}}
		fl.Resumed = func() { resync.Request("proxy event consumer set up again") }
		nc.SetReconnectHandler(func(*nats.Conn) { resync.Request("NATS reconnected") })
	} else {
		log.Warn("WARNING: no orchestrator address configured; the probed proxies are learnt from events alone, and proxies deleted while events were missed (or after a reset of the orchestrator's database) keep being probed")
	}

	var targets []providerhealth.Target
	var apiProviders []api.Provider
	var conns []*grpc.ClientConn
	for _, p := range provCfg.Providers {
		t := providerhealth.Target{Name: p.Name, Type: p.Type}
		if addr, ok := c.Provisioners[p.Name]; ok {
			client := c.ProvisionerClient
			client.Addr = addr
			conn, err := client.Dial()
			if err != nil {
				return fmt.Errorf("--provisioner %s: %w", p.Name, err)
			}
			conns = append(conns, conn)
			t.Checker = providerhealth.NewGRPCChecker(p.Name, addr, conn)
		}
		targets = append(targets, t)
		apiProviders = append(apiProviders, api.Provider{Name: p.Name, Type: p.Type})
	}
	mon := &providerhealth.Monitor{
		Store: st, Targets: targets, Interval: c.ProviderCheckInterval, Timeout: c.ProviderCheckTimeout,
		Log: log, Lock: pool, LockKey: lockKey(names.Prefix), Retry: min(c.ProviderCheckInterval, 10*time.Second),
	}
	s.Metrics.MustRegister(providerhealth.Collector{M: mon})

	// ctx ends at SIGTERM, before the graceful stop that waits for streams.
	srv := &api.Server{Store: st, Hub: hub, Providers: apiProviders, Log: log, Stopping: ctx.Done()}
	healthv1.RegisterHealthServiceServer(s.GRPC, srv)
	s.MountGateway(healthv1.RegisterHealthServiceHandler)

	// Workers; the last one closes the connections once all others ended.
	var wg sync.WaitGroup
	goWorker := func(name string, fn func(context.Context) error) {
		wg.Add(1)
		s.Go(func(ctx context.Context) error {
			defer wg.Done()
			if err := fn(ctx); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			return nil
		})
	}
	goWorker("engine", eng.Run)
	goWorker("recorder", rec.Run)
	goWorker("publisher", pub.Run)
	goWorker("hub", hub.Run)
	goWorker("membership", func(ctx context.Context) error { return mem.Run(ctx, js, names) })
	goWorker("proxy events", func(ctx context.Context) error { return fl.Follow(ctx, js, names) })
	if resync != nil {
		goWorker("proxy resync", func(ctx context.Context) error { resync.Run(ctx); return nil })
	}
	goWorker("state flush", func(ctx context.Context) error {
		return flushStates(ctx, c.StateFlushInterval, st, eng, &gone, c.ReplicaID, log)
	})
	goWorker("provider checks", mon.Run)
	goWorker("retention", func(ctx context.Context) error { return pruneLoop(ctx, st, c.Retention, log) })
	s.Go(func(ctx context.Context) error {
		<-ctx.Done()
		wg.Wait()
		for _, conn := range conns {
			_ = conn.Close()
		}
		if orch != nil {
			_ = orch.Close()
		}
		_ = nc.Drain()
		pool.Close()
		return nil
	})
	log.Info("health configured", "replica", c.ReplicaID, "probe_target", prober.Target(),
		"providers", len(targets), "provisioners", len(c.Provisioners), "provider_check_interval", c.ProviderCheckInterval)
	return nil
}

// goneList holds proxies whose stored health must go; the flusher deletes
// them after its writes, so a write in flight cannot bring one back.
type goneList struct {
	mu   sync.Mutex
	uids []string
}

func (g *goneList) add(uid string) {
	g.mu.Lock()
	g.uids = append(g.uids, uid)
	g.mu.Unlock()
}

func (g *goneList) take() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := g.uids
	g.uids = nil
	return out
}

func flushStates(ctx context.Context, every time.Duration, st *store.Store, eng *engine.Engine, gone *goneList, prober string, log *slog.Logger) error {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if err := st.SaveStates(ctx, eng.TakeDirty(), prober); err != nil && ctx.Err() == nil {
			log.Warn("WARNING: saving proxy states failed; the next flush writes newer ones", "error", err)
		}
		uids := gone.take()
		for i, uid := range uids {
			if err := st.DeleteProxy(ctx, uid); err != nil {
				if ctx.Err() == nil {
					log.Warn("WARNING: removing a gone proxy's health failed; retrying", "error", err)
				}
				for _, u := range uids[i:] {
					gone.add(u)
				}
				break
			}
		}
	}
}

func pruneLoop(ctx context.Context, st *store.Store, retention time.Duration, log *slog.Logger) error {
	t := time.NewTicker(time.Hour)
	defer t.Stop()
	for {
		if n, err := st.PruneTransitions(ctx, time.Now().Add(-retention)); err != nil {
			if ctx.Err() == nil {
				log.Warn("WARNING: pruning old transitions failed", "error", err)
			}
		} else if n > 0 {
			log.Info("pruned old transitions", "count", n)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
