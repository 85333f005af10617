// Package app wires the orchestrator: configuration, the store, NATS, the
// API and the background loops.
package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/installation"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/reload"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/api"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/atrest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/dispatch"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/gc"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	poolctl "github.com/egress-proxies/egress-proxies/services/orchestrator/internal/pool"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// Config is the orchestrator's own configuration.
type Config struct {
	Database        postgres.Flags
	NATS            bus.Flags
	ProvidersConfig string
	WatchRetention  time.Duration
	ClaimBatch      int
	Timing          lifecycle.Timing
	GCInterval      time.Duration
	GCGrace         time.Duration
	// CloudInitKeyFile is the keyring that encrypts cloud-init at rest;
	// without it proxies with cloud-init are refused.
	CloudInitKeyFile string
	// PoolResync is how often the pool controller looks at every pool
	// without a change.
	PoolResync time.Duration
	// Health is how the health service is reached for the providers'
	// backend health; an empty address turns it off (every provider
	// counts as healthy for the pools).
	Health service.Client
	// ProviderHealthInterval is how often the providers' health is read;
	// ProviderHealthStale how long the last verdicts hold while reading
	// fails.
	ProviderHealthInterval time.Duration
	ProviderHealthStale    time.Duration
	// InstallationID names this installation in every provisioner request
	// and so in every instance's mark; empty: derived from the database
	// (installationID).
	InstallationID string
}

// DefaultConfig has the production defaults.
func DefaultConfig() *Config {
	return &Config{
		Database:       postgres.DefaultFlags(),
		NATS:           bus.DefaultFlags(),
		WatchRetention: time.Hour,
		ClaimBatch:     64,
		Timing:         lifecycle.DefaultTiming(),
		GCInterval:     10 * time.Minute,
		GCGrace:        15 * time.Minute,
		PoolResync:     5 * time.Second,

		ProviderHealthInterval: poolctl.DefaultProviderHealthInterval,
		ProviderHealthStale:    poolctl.DefaultProviderHealthStale,
	}
}

// RegisterFlags adds the orchestrator's flags.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.Database.Register(fs)
	c.NATS.Register(fs)
	fs.StringVar(&c.ProvidersConfig, "providers-config", c.ProvidersConfig, "providers YAML file (required)")
	fs.DurationVar(&c.WatchRetention, "watch-retention", c.WatchRetention, "how long the change log keeps changes: WatchProxies resumes from any revision this recent")
	fs.IntVar(&c.ClaimBatch, "claim-batch", c.ClaimBatch, "proxies one reconcile claim takes")
	fs.DurationVar(&c.Timing.CreateDeadline, "create-deadline", c.Timing.CreateDeadline, "a Create command unanswered this long is issued again")
	fs.DurationVar(&c.Timing.GetDeadline, "get-deadline", c.Timing.GetDeadline, "a Get command unanswered this long is issued again")
	fs.DurationVar(&c.Timing.DeleteDeadline, "delete-deadline", c.Timing.DeleteDeadline, "a Delete command unanswered this long is issued again")
	fs.DurationVar(&c.Timing.Resync, "resync-interval", c.Timing.Resync, "how often a running instance is read to notice it vanished")
	fs.DurationVar(&c.Timing.ProvisioningPoll, "provisioning-poll", c.Timing.ProvisioningPoll, "how often an instance without an address is read")
	fs.DurationVar(&c.GCInterval, "gc-interval", c.GCInterval, "how often orphan GC lists every provider's instances; 0 turns it off")
	fs.DurationVar(&c.GCGrace, "gc-grace", c.GCGrace, "orphan GC never deletes an instance younger than this")
	fs.DurationVar(&c.Timing.StoppedGrace, "stopped-grace", c.Timing.StoppedGrace, "an instance stopped this long is replaced; 0 never replaces it")
	fs.DurationVar(&c.Timing.DeletionPoll, "deletion-poll", c.Timing.DeletionPoll, "how often a deleted instance is read until it is gone")
	fs.DurationVar(&c.PoolResync, "pool-resync", c.PoolResync, "how often the pool controller syncs every pool without a change")
	fs.StringVar(&c.Health.Addr, "health-addr", c.Health.Addr,
		"gRPC address of the health service (host:port), whose ListProviderHealth tells the pools which providers are NOT_READY; empty: every provider counts as healthy")
	c.Health.RegisterFlags(fs, "health", "the health service")
	fs.DurationVar(&c.ProviderHealthInterval, "provider-health-interval", c.ProviderHealthInterval, "how often the providers' health is read from the health service")
	fs.DurationVar(&c.ProviderHealthStale, "provider-health-stale-after", c.ProviderHealthStale,
		"how long the last providers' health holds while reading it fails; then every provider counts as healthy again")
	fs.StringVar(&c.InstallationID, "installation-id", c.InstallationID,
		"this installation's identity, written into every instance's mark so that installations sharing a backend leave each other's instances alone "+
			"(lowercase letters, digits and dashes, at most 32); empty: derived from the database's system identifier and name")
	fs.StringVar(&c.CloudInitKeyFile, "cloud-init-key-file", c.CloudInitKeyFile,
		"keyring (YAML: active key id and base64 AES-256 keys) that encrypts cloud-init in PostgreSQL; without it proxies with cloud-init are refused")
}

// openStore wraps pool with the cloud-init keyring, refuses to go on when
// stored cloud-init cannot be read with it, and seals with the active key
// whatever is not sealed with it yet (plaintext from before encryption at
// rest, values sealed with a retired key). The keyring file, when there is
// one, is returned to be watched (watchKeyring).
func (c *Config) openStore(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) (*store.Store, *reload.File[*atrest.Keyring], error) {
	var opts []store.Option
	var keys *reload.File[*atrest.Keyring]
	if c.CloudInitKeyFile != "" {
		var err error
		keys, err = reload.Open(c.CloudInitKeyFile, "the cloud-init keyring", atrest.Parse, log)
		if err != nil {
			return nil, nil, err
		}
		opts = append(opts, store.WithKeyringFrom(keys.Value))
		log.Info("cloud-init is encrypted at rest", "activeKey", keys.Value().Active(), "keys", keys.Value().IDs())
	} else {
		log.Warn("WARNING: no --cloud-init-key-file: proxies with cloud-init are refused (FAILED_PRECONDITION)")
	}
	st := store.New(pool, opts...)
	if err := st.CheckCloudInitKeys(ctx); err != nil {
		return nil, nil, err
	}
	if keys != nil {
		n, err := st.ReencryptCloudInit(ctx, reencryptBatch)
		if err != nil {
			return nil, nil, err
		}
		if n > 0 {
			log.Info("re-encrypted stored cloud-init with the active key", "proxies", n)
		}
	}
	return st, keys, nil
}

// installationID is --installation-id, or else the identity derived from
// the database this orchestrator keeps its state in: its cluster's system
// identifier and its name, so that two databases on one server are two
// installations and every replica of one agrees without being told.
func (c *Config) installationID(ctx context.Context, pool *pgxpool.Pool) (string, error) {
	if c.InstallationID != "" {
		return c.InstallationID, nil
	}
	var sysID int64
	var db string
	if err := pool.QueryRow(ctx, "SELECT system_identifier, current_database() FROM pg_control_system()").Scan(&sysID, &db); err != nil {
		return "", fmt.Errorf("deriving the installation id from the database (set --installation-id to name it instead): %w", err)
	}
	return installation.Derive(uint64(sysID), db), nil
}

// Migrate applies the migrations (the `migrate` subcommand).
func (c *Config) Migrate(ctx context.Context, log *slog.Logger) error {
	return c.Database.RunMigrations(ctx, store.Migrate, log)
}

// Setup builds everything and registers it on the service.
func (c *Config) Setup(ctx context.Context, s *service.Service) error {
	if c.ProvidersConfig == "" {
		return errors.New("--providers-config is required")
	}
	if err := errors.Join(c.Database.Validate(), c.NATS.Validate()); err != nil {
		return err
	}
	if c.InstallationID != "" {
		if err := installation.Valid(c.InstallationID); err != nil {
			return fmt.Errorf("--installation-id: %w", err)
		}
	}
	if c.Health.Addr != "" && (c.ProviderHealthInterval <= 0 || c.ProviderHealthStale < c.ProviderHealthInterval) {
		return fmt.Errorf("--provider-health-interval must be positive and --provider-health-stale-after at least as long, got %s and %s",
			c.ProviderHealthInterval, c.ProviderHealthStale)
	}
	provs, err := providers.Open(c.ProvidersConfig, s.Log, s.Metrics)
	if err != nil {
		return err
	}
	pool, err := c.Database.Open(ctx, store.Migrate, s.Log)
	if err != nil {
		return err
	}
	inst, err := c.installationID(ctx, pool)
	if err != nil {
		pool.Close()
		return err
	}
	names := c.NATS.Names()
	nc, js, err := c.NATS.Connect(ctx, "orchestrator", s.Log, s.Metrics)
	if err != nil {
		pool.Close()
		return err
	}

	st, keys, err := c.openStore(ctx, pool, s.Log)
	if err != nil {
		nc.Close()
		pool.Close()
		return err
	}
	work, changes := store.NewSignal(), store.NewSignal()
	configured := func(name string) bool { _, ok := provs.Current().Get(name); return ok }
	d := &dispatch.Dispatcher{
		Store:      st,
		Machine:    &lifecycle.Machine{Timing: c.Timing, Configured: configured, Log: s.Log, Installation: inst},
		JS:         js,
		Names:      names,
		Log:        s.Log,
		Work:       work,
		Changes:    changes,
		Metrics:    dispatch.NewMetrics(s.Metrics),
		ClaimBatch: c.ClaimBatch,
	}
	collector := &gc.Collector{
		Store: st, JS: js, Names: names, Installation: inst, Providers: func() []string { return provs.Current().Names() }, Interval: c.GCInterval, Grace: c.GCGrace,
		Deadline: c.Timing.GetDeadline, Log: s.Log, Metrics: gc.NewMetrics(s.Metrics),
	}
	d.Handlers = map[busv1.CommandPurpose]dispatch.ResultHandler{busv1.CommandPurpose_COMMAND_PURPOSE_ORPHAN_GC: collector}
	srv := &api.Server{Store: st, Providers: provs, Changes: changes, Log: s.Log.With("component", "api"), FirstCommands: d}
	proxyv1.RegisterProxyServiceServer(s.GRPC, srv)
	s.Go(srv.Run)
	s.MountREST(proxyv1.RegisterProxyServiceHandler)
	proxyv1.RegisterProxyPoolServiceServer(s.GRPC, &api.PoolServer{Server: srv})
	s.MountREST(proxyv1.RegisterProxyPoolServiceHandler)
	book := poolctl.NewBook()
	ctrl := &poolctl.Controller{
		Store: st, Changes: changes, Log: s.Log.With("component", "pools"), Metrics: poolctl.NewMetrics(s.Metrics),
		Resync: c.PoolResync, Demand: book.Get,
	}
	var provHealth *poolctl.ProviderHealth
	if c.Health.Addr != "" {
		conn, err := c.Health.Dial()
		if err != nil {
			nc.Close()
			pool.Close()
			return fmt.Errorf("--health-addr: %w", err)
		}
		provHealth = &poolctl.ProviderHealth{
			Health:   healthv1.NewHealthServiceClient(conn),
			Interval: c.ProviderHealthInterval, StaleAfter: c.ProviderHealthStale,
			Log: s.Log.With("component", "pools"), Changed: changes.Notify,
			PollFailures: ctrl.Metrics.ProviderHealthFails,
		}
		ctrl.ProviderNotReady = provHealth.NotReady
		s.Go(func(ctx context.Context) error {
			defer conn.Close()
			return provHealth.Run(ctx)
		})
		s.Log.Info("pools follow the providers' health", "healthAddr", c.Health.Addr, "every", c.ProviderHealthInterval)
	} else {
		s.Log.Info("no --health-addr: pools do not know the providers' health and spread over every provider")
	}
	s.Metrics.MustRegister(newStateCollector(st))

	s.Go(func(ctx context.Context) error { return store.Listen(ctx, pool, work, changes, s.Log) })
	s.Go(d.RunClaims)
	s.Go(d.RunResults)
	s.Go(d.RunHealth)
	s.Go(d.RunOutbox)
	s.Go(collector.Run)
	s.Go(func(ctx context.Context) error {
		if provHealth != nil {
			// At most one interval: the first sync knows which providers
			// are NOT_READY rather than creating proxies there.
			provHealth.Poll(ctx, c.ProviderHealthInterval)
		}
		return ctrl.Run(ctx)
	})
	s.Go(func(ctx context.Context) error { return poolctl.ConsumeDemand(ctx, js, names, book, s.Log) })
	s.Go(func(ctx context.Context) error { return prune(ctx, st, c.WatchRetention, s.Log) })
	if keys != nil {
		s.Go(func(ctx context.Context) error { return watchKeyring(ctx, keys, st, s.Log) })
	}
	s.Go(func(ctx context.Context) error {
		<-ctx.Done()
		nc.Close()
		pool.Close()
		return nil
	})
	s.Log.Info("orchestrator configured", "installation", inst, "providers", provs.Value().Names(), "natsPrefix", names.Prefix,
		"watchRetention", c.WatchRetention)
	return nil
}

func prune(ctx context.Context, st *store.Store, retention time.Duration, log *slog.Logger) error {
	t := time.NewTicker(time.Minute)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if _, err := st.PrunePoolChanges(ctx, retention); err != nil {
				log.Warn("pruning the pools' change log failed", "error", err)
			}
			if n, err := st.PruneChanges(ctx, retention); err != nil {
				log.Warn("pruning the change log failed", "error", err)
			} else if n > 0 {
				log.Debug("change log pruned", "changes", n)
			}
		}
	}
}

// stateCollector reads proxies by phase and commands in flight at scrape
// time, so the series never drift from the store.
type stateCollector struct {
	st       *store.Store
	phases   *prometheus.Desc
	inFlight *prometheus.Desc
	open     *prometheus.Desc
}

func newStateCollector(st *store.Store) *stateCollector {
	return &stateCollector{
		st:       st,
		phases:   prometheus.NewDesc("egress_orchestrator_proxies", "Proxies by phase.", []string{"phase"}, nil),
		inFlight: prometheus.NewDesc("egress_orchestrator_commands_in_flight", "Proxies with a provisioner command in flight.", nil, nil),
		open: prometheus.NewDesc("egress_proxies_without_credentials",
			"MANAGED proxies that serve anyone who reaches them: their spec says credentials NONE, or they predate credentials and were not replaced since.", nil, nil),
	}
}

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.phases
	ch <- c.inFlight
	ch <- c.open
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	counts := map[proxyv1.ProxyPhase]float64{}
	rows, err := c.st.Pool().Query(ctx, "SELECT phase, count(*) FROM orchestrator.proxies GROUP BY phase")
	if err == nil {
		for rows.Next() {
			var phase int16
			var n int64
			if rows.Scan(&phase, &n) == nil {
				counts[proxyv1.ProxyPhase(phase)] = float64(n)
			}
		}
		rows.Close()
	}
	for v, name := range proxyv1.ProxyPhase_name {
		if v == 0 {
			continue
		}
		ch <- prometheus.MustNewConstMetric(c.phases, prometheus.GaugeValue, counts[proxyv1.ProxyPhase(v)], name)
	}
	var inFlight int64
	_ = c.st.Pool().QueryRow(ctx, "SELECT count(*) FROM orchestrator.proxies WHERE command_id IS NOT NULL").Scan(&inFlight)
	ch <- prometheus.MustNewConstMetric(c.inFlight, prometheus.GaugeValue, float64(inFlight))
	var open int64
	_ = c.st.Pool().QueryRow(ctx, "SELECT count(*) FROM orchestrator.proxies WHERE mode = $1 AND credentials_key = ''",
		int16(proxyv1.ProxyMode_PROXY_MODE_MANAGED)).Scan(&open)
	ch <- prometheus.MustNewConstMetric(c.open, prometheus.GaugeValue, float64(open))
}
