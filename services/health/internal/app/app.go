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
	"github.com/egress-proxies/egress-proxies/services/health/internal/credentials"
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
	Database        postgres.Flags
	NATS            bus.Flags
	ProvidersConfig string

	ProbeTarget        string
	ProbeCAFile        string
	ProbeTLSMaxVersion string
	Defaults           engine.Defaults
	FastInterval       time.Duration
	MaxConcurrent      int

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
	c.Database.Register(fs)
	c.NATS.Register(fs)
	fs.StringVar(&c.ProvidersConfig, "providers-config", "", "providers YAML file (names and types); empty: no providers")
	fs.StringVar(&c.ProbeTarget, "probe-target", "", "URL fetched through every proxy: https:// for a CONNECT tunnel with TLS, http:// for a plain forward. Required: a URL the operator runs, never a third-party site")
	fs.StringVar(&c.ProbeCAFile, "probe-ca-file", "", "PEM file of CAs that verify the probe target (default: system roots)")
	fs.StringVar(&c.ProbeTLSMaxVersion, "probe-tls-max-version", "1.2",
		"highest TLS version a probe offers the target: 1.2 (a resumed handshake costs no key exchange) or 1.3 (for a target that refuses 1.2; more CPU per probe)")
	fs.DurationVar(&c.Defaults.Interval, "probe-interval", engine.DefaultDefaults.Interval, "default time between probes of a proxy")
	fs.DurationVar(&c.Defaults.Timeout, "probe-timeout", engine.DefaultDefaults.Timeout, "default limit of one probe; at most --probe-interval")
	fs.IntVar(&c.Defaults.SuccessThreshold, "success-threshold", engine.DefaultDefaults.SuccessThreshold, "default successes in a row before a proxy is healthy")
	fs.IntVar(&c.Defaults.FailureThreshold, "failure-threshold", engine.DefaultDefaults.FailureThreshold, "default failures in a row before a healthy proxy is unhealthy")
	fs.DurationVar(&c.FastInterval, "probe-fast-interval", 250*time.Millisecond,
		"time between probes of a proxy whose verdict is unsettled (none yet, or its last probe disagrees with it), at most its interval; 0: every proxy at its interval")
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
	fs.DurationVar(&c.MembershipTTL, "membership-ttl", 0,
		"how long a replica that stopped heartbeating keeps its proxies; 0: --probe-interval, at least 1s (the same on every replica)")
	fs.DurationVar(&c.StateFlushInterval, "state-flush-interval", 2*time.Second, "how often changed proxy states are written for the read API")
	fs.DurationVar(&c.Retention, "transition-retention", 7*24*time.Hour, "how long transitions are kept for WatchProxyHealth")
	fs.BoolVar(&c.TraceProbes, "trace-health-probes", false, "emit one trace span per probe; off by default: probes run about once a second per proxy and would dominate trace volume")
}

// Validate checks the configuration.
func (c *Config) Validate() error {
	errs := []error{c.Database.Validate(), c.NATS.Validate()}
	if _, err := probe.ParseTarget(c.ProbeTarget); err != nil {
		errs = append(errs, err)
	}
	if err := c.Defaults.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := providerhealth.ValidateSchedule(c.ProviderCheckInterval, c.ProviderCheckTimeout); err != nil {
		errs = append(errs, err)
	}
	if c.MembershipTTL != 0 && c.MembershipTTL < time.Second {
		errs = append(errs, errors.New("--membership-ttl must be 0 (from --probe-interval) or at least 1s"))
	}
	if c.FastInterval != 0 && c.FastInterval < engine.MinInterval {
		errs = append(errs, fmt.Errorf("--probe-fast-interval must be 0 (off) or at least %s, got %s", engine.MinInterval, c.FastInterval))
	}
	if _, err := tlsVersion(c.ProbeTLSMaxVersion); err != nil {
		errs = append(errs, err)
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

// membershipTTL is --membership-ttl, or the probe interval (at least 1s):
// a dead replica's proxies are then taken over within two intervals.
func (c *Config) membershipTTL() time.Duration {
	if c.MembershipTTL != 0 {
		return c.MembershipTTL
	}
	return max(c.Defaults.Interval, time.Second)
}

func tlsVersion(v string) (uint16, error) {
	switch v {
	case "1.2":
		return tls.VersionTLS12, nil
	case "1.3":
		return tls.VersionTLS13, nil
	}
	return 0, fmt.Errorf("--probe-tls-max-version must be 1.2 or 1.3, got %q", v)
}

// Migrate applies the migrations (the migrate subcommand).
func (c *Config) Migrate(ctx context.Context, log *slog.Logger) error {
	return c.Database.RunMigrations(ctx, store.Migrate, log)
}

// Setup builds everything and registers it on s.
func (c *Config) Setup(ctx context.Context, s *service.Service) error {
	if err := c.Validate(); err != nil {
		return err
	}
	log := s.Log
	var provs providers.Source = providers.Static(&providers.Config{})
	if c.ProvidersConfig != "" {
		f, err := providers.Open(c.ProvidersConfig, log, s.Metrics)
		if err != nil {
			return err
		}
		provs = f
	}
	for name := range c.Provisioners {
		if _, ok := provs.Current().Get(name); !ok {
			return fmt.Errorf("--provisioner %s: no such provider in the providers config", name)
		}
	}
	maxVersion, _ := tlsVersion(c.ProbeTLSMaxVersion) // checked by Validate
	tlsCfg := &tls.Config{MinVersion: tls.VersionTLS12, MaxVersion: maxVersion}
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

	pool, err := c.Database.Open(ctx, store.Migrate, log)
	if err != nil {
		return err
	}
	names := c.NATS.Names()
	nc, js, err := c.NATS.Connect(ctx, "health "+c.ReplicaID, s.Log, s.Metrics)
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
	creds := &credentials.Cache{}
	probeOne := func(ctx context.Context, s engine.Spec) probe.Result {
		auth, err := creds.For(ctx, s.UID, s.CredentialsTime)
		if err != nil {
			return probe.Result{Reason: probe.ReasonCredentialsUnavailable, Message: err.Error()}
		}
		return prober.ProbeAuth(ctx, s.Address, auth)
	}
	probeFn := probeOne
	if c.TraceProbes {
		tracer := otel.Tracer("egress/health")
		probeFn = func(ctx context.Context, s engine.Spec) probe.Result {
			ctx, span := tracer.Start(ctx, "health.probe", trace.WithAttributes(attribute.String("proxy.address", s.Address)))
			defer span.End()
			r := probeOne(ctx, s)
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
		OnRemove:      func(s engine.Spec) { metrics.Forget(s); creds.Forget(s.UID) },
		MaxConcurrent: c.MaxConcurrent,
		FastInterval:  c.FastInterval,
	})
	rec.State = eng.Get
	mem := &membership.Membership{ID: c.ReplicaID, TTL: c.membershipTTL(), Log: log}
	var gone goneList
	fl := &fleet.Fleet{Engine: eng, Defaults: c.Defaults, Self: c.ReplicaID, Gone: gone.add, Log: log,
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
				out[uid] = fleet.Prior{ProviderID: v.ProviderID, CredentialsTime: v.CredentialsTime,
					Verdict: engine.Verdict{Healthy: v.Healthy, LastTransition: v.LastTransition}}
			}
			return out
		}}
	mem.OnChange = fl.Rebalance

	var resync *proxysync.Loop
	var orch *grpc.ClientConn
	if c.Orchestrator.Addr != "" {
		if orch, err = c.Orchestrator.Dial(); err != nil {
			_ = nc.Drain()
			pool.Close()
			return fmt.Errorf("--orchestrator-addr: %w", err)
		}
		lister := proxyv1.NewProxyServiceClient(orch)
		creds.SetSource(lister)
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

	// A --provisioner names a provider's address for good; the providers
	// checked and listed are those of the config in effect (reloaded on
	// change), so a provider added later is listed (and checked, given a
	// --provisioner) and one removed is no longer.
	checkers := map[string]providerhealth.Checker{}
	var conns []*grpc.ClientConn
	for name, addr := range c.Provisioners {
		client := c.ProvisionerClient
		client.Addr = addr
		conn, err := client.Dial()
		if err != nil {
			for _, conn := range conns {
				_ = conn.Close()
			}
			return fmt.Errorf("--provisioner %s: %w", name, err)
		}
		conns = append(conns, conn)
		checkers[name] = providerhealth.NewGRPCChecker(name, addr, conn)
	}
	targets := func() []providerhealth.Target {
		cfg := provs.Current()
		out := make([]providerhealth.Target, 0, len(cfg.Providers))
		for _, p := range cfg.Providers {
			out = append(out, providerhealth.Target{Name: p.Name, Type: p.Type, Checker: checkers[p.Name]})
		}
		return out
	}
	apiProviders := func() []api.Provider {
		cfg := provs.Current()
		out := make([]api.Provider, 0, len(cfg.Providers))
		for _, p := range cfg.Providers {
			out = append(out, api.Provider{Name: p.Name, Type: p.Type})
		}
		return out
	}
	mon := &providerhealth.Monitor{
		Store: st, Targets: targets, Interval: c.ProviderCheckInterval, Timeout: c.ProviderCheckTimeout,
		Log: log, Lock: pool, LockKey: postgres.LockKey("health", "provider-checks"), Retry: min(c.ProviderCheckInterval, 10*time.Second),
	}
	s.Metrics.MustRegister(providerhealth.Collector{M: mon})

	// ctx ends at SIGTERM, before the graceful stop that waits for streams.
	srv := &api.Server{Store: st, Hub: hub, Providers: apiProviders, Log: log, Stopping: ctx.Done()}
	healthv1.RegisterHealthServiceServer(s.GRPC, srv)
	s.MountREST(healthv1.RegisterHealthServiceHandler)

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
		"providers", len(targets()), "provisioners", len(c.Provisioners), "provider_check_interval", c.ProviderCheckInterval)
	return nil
}

// goneList holds proxies whose stored health must go, each with the
// revision of the snapshot that said so; the flusher deletes them after its
// writes, so a write in flight cannot bring one back.
type goneList struct {
	mu    sync.Mutex
	proxy []goneProxy
}

type goneProxy struct {
	uid      string
	revision int64
}

func (g *goneList) add(uid string, revision int64) {
	g.mu.Lock()
	g.proxy = append(g.proxy, goneProxy{uid, revision})
	g.mu.Unlock()
}

func (g *goneList) take() []goneProxy {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := g.proxy
	g.proxy = nil
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
		flushOnce(ctx, st, eng, gone, prober, log)
	}
}

// flushOnce writes the states that changed, then forgets the gone proxies'
// health as of the snapshot that made each go: a proxy probeable again
// since (a Pending proxy that turned Running and got its verdict within
// one flush interval) keeps the state written for it.
func flushOnce(ctx context.Context, st *store.Store, eng *engine.Engine, gone *goneList, prober string, log *slog.Logger) {
	if err := st.SaveStates(ctx, eng.TakeDirty(), prober); err != nil && ctx.Err() == nil {
		log.Warn("WARNING: saving proxy states failed; the next flush writes newer ones", "error", err)
	}
	proxies := gone.take()
	for i, p := range proxies {
		if err := st.DeleteProxy(ctx, p.uid, p.revision); err != nil {
			if ctx.Err() == nil {
				log.Warn("WARNING: removing a gone proxy's health failed; retrying", "error", err)
			}
			for _, q := range proxies[i:] {
				gone.add(q.uid, q.revision)
			}
			return
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
