// Package app wires the lease service: its flags, the database, NATS, the
// proxy mirror's syncer, the expiry sweep, the API and its REST layer, onto the common
// service frame.
package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"google.golang.org/grpc"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/api"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/demand"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/metrics"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/mirror"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/store"
)

// Config is everything the lease service is configured with beyond the
// common service options.
type Config struct {
	Database postgres.Flags
	NATS     bus.Flags
	// Orchestrator is where full resyncs list every proxy for the mirror; an empty Addr
	// means events only.
	Orchestrator   service.Client
	ResyncInterval time.Duration
	// InitialResyncTimeout bounds the resync before serving; 0 skips it.
	InitialResyncTimeout time.Duration
	SweepInterval        time.Duration
	RefreshInterval      time.Duration
	// DemandInterval is how often the pools' lease demand is published
	// for the orchestrator; 0 turns it off.
	DemandInterval   time.Duration
	CommitRounds     int
	Retention        time.Duration
	DefaultMaxLeases int
	API              api.Config

	// Now replaces the clock, for tests.
	Now func() time.Time
}

// DefaultConfig is the configuration the flags default to.
func DefaultConfig() Config {
	return Config{
		Database:             postgres.DefaultFlags(),
		NATS:                 bus.DefaultFlags(),
		ResyncInterval:       5 * time.Minute,
		InitialResyncTimeout: 10 * time.Second,
		SweepInterval:        time.Second,
		RefreshInterval:      time.Second,
		DemandInterval:       5 * time.Second,
		CommitRounds:         1,
		Retention:            time.Hour,
		DefaultMaxLeases:     1,
		API:                  api.DefaultConfig(),
	}
}

// RegisterFlags adds the lease service's flags to fs; each can also be set
// through EGRESS_<NAME>.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.Database.Register(fs)
	c.NATS.Register(fs)
	fs.DurationVar(&c.DemandInterval, "demand-interval", c.DemandInterval, "how often the lease demand on each proxy pool is published for the orchestrator's autoscaling and draining; 0 turns it off")
	fs.StringVar(&c.Orchestrator.Addr, "orchestrator-addr", c.Orchestrator.Addr,
		"gRPC address of the orchestrator, for full resyncs of the proxy mirror (host:port); empty: events only")
	c.Orchestrator.RegisterFlags(fs, "orchestrator", "the orchestrator")
	fs.DurationVar(&c.ResyncInterval, "resync-interval", c.ResyncInterval, "period of the safety-net full resync; 0 turns it off")
	fs.DurationVar(&c.InitialResyncTimeout, "initial-resync-timeout", c.InitialResyncTimeout,
		"how long the start waits for the first resync from the orchestrator before serving anyway; 0: do not wait")
	fs.DurationVar(&c.SweepInterval, "sweep-interval", c.SweepInterval, "how often expired leases are ended and freed")
	fs.DurationVar(&c.RefreshInterval, "mirror-refresh-interval", c.RefreshInterval,
		"how often this replica re-reads the proxy mirror (other replicas' leases and cooldowns) for choosing proxies; the database confirms every choice")
	fs.IntVar(&c.CommitRounds, "commit-rounds", c.CommitRounds,
		"how many transactions of queued acquires, reports and releases this replica keeps in flight at once")
	fs.DurationVar(&c.Retention, "lease-retention", c.Retention, "how long ended leases are kept so that late reports count")
	fs.IntVar(&c.DefaultMaxLeases, "default-max-leases", c.DefaultMaxLeases,
		"capacity of a proxy whose spec.lease.max_leases is unset; 0 means unlimited. Use the same value on every replica")
	fs.DurationVar(&c.API.MinTTL, "min-ttl", c.API.MinTTL, "shortest lease TTL a client may ask for")
	fs.DurationVar(&c.API.DefaultTTL, "default-ttl", c.API.DefaultTTL, "lease TTL when the client sets none")
	fs.DurationVar(&c.API.MaxTTL, "max-ttl", c.API.MaxTTL, "longest lease TTL a client may ask for")
	fs.DurationVar(&c.API.MaxCooldown, "max-cooldown", c.API.MaxCooldown, "longest cooldown a report may ask for")
	if c.API.Cooldowns == nil {
		c.API.Cooldowns = api.DefaultCooldowns()
	}
	for o, name := range map[leasev1.Outcome]string{
		leasev1.Outcome_OUTCOME_BLOCKED: "blocked", leasev1.Outcome_OUTCOME_BANNED: "banned",
		leasev1.Outcome_OUTCOME_CAPTCHA: "captcha", leasev1.Outcome_OUTCOME_TIMEOUT: "timeout",
		leasev1.Outcome_OUTCOME_ERROR: "error",
	} {
		fs.Var(cooldownFlag{c.API.Cooldowns, o}, "cooldown-"+name,
			fmt.Sprintf("default cooldown after a %s report: a duration, with \",global\" or \",target\" for its scope (default %s)",
				name, cooldownFlag{c.API.Cooldowns, o}.String()))
	}
}

type cooldownFlag struct {
	m map[leasev1.Outcome]api.CooldownDefault
	o leasev1.Outcome
}

func (f cooldownFlag) String() string {
	if f.m == nil {
		return ""
	}
	d := f.m[f.o]
	scope := "target"
	if d.Global {
		scope = "global"
	}
	return d.Duration.String() + "," + scope
}

func (f cooldownFlag) Set(v string) error {
	dur, scope, _ := strings.Cut(v, ",")
	d, err := time.ParseDuration(dur)
	if err != nil || d < 0 {
		return fmt.Errorf("want a duration such as 5m, optionally followed by ,target or ,global")
	}
	c := f.m[f.o]
	c.Duration = d
	switch scope {
	case "":
	case "target":
		c.Global = false
	case "global":
		c.Global = true
	default:
		return fmt.Errorf("scope %q: want target or global", scope)
	}
	f.m[f.o] = c
	return nil
}

func (c *Config) validate() error {
	if err := c.Database.Validate(); err != nil {
		return err
	}
	if err := c.NATS.Validate(); err != nil {
		return err
	}
	switch {
	case c.DefaultMaxLeases < 0:
		return errors.New("--default-max-leases must be 0 (unlimited) or more")
	case c.API.MinTTL <= 0 || c.API.MinTTL > c.API.MaxTTL:
		return errors.New("--min-ttl must be positive and at most --max-ttl")
	case c.API.DefaultTTL < c.API.MinTTL || c.API.DefaultTTL > c.API.MaxTTL:
		return errors.New("--default-ttl must lie between --min-ttl and --max-ttl")
	case c.SweepInterval <= 0:
		return errors.New("--sweep-interval must be positive")
	case c.CommitRounds < 1:
		return errors.New("--commit-rounds must be at least 1")
	case c.RefreshInterval <= 0:
		return errors.New("--mirror-refresh-interval must be positive")
	case (c.Orchestrator.TokenFile != "" || c.Orchestrator.CAFile != "") && c.Orchestrator.Addr == "":
		return errors.New("--orchestrator-token-file and --orchestrator-ca-file need --orchestrator-addr")
	}
	return nil
}

// Migrate applies the migrations, for `lease migrate`.
func (c *Config) Migrate(ctx context.Context, log *slog.Logger) error {
	return c.Database.RunMigrations(ctx, store.Migrate, log)
}

// Parts are the running pieces, for tests.
type Parts struct {
	Store  *store.Store
	Syncer *mirror.Syncer
}

// Setup connects the dependencies and registers the API and workers on s.
func (c *Config) Setup(ctx context.Context, s *service.Service) (*Parts, error) {
	if err := c.validate(); err != nil {
		return nil, err
	}
	db, err := c.Database.Open(ctx, store.Migrate, s.Log)
	if err != nil {
		return nil, err
	}
	var met *metrics.Metrics // set before st.Run starts committing rounds
	var feed *api.Feed       // set before st.Run starts committing rounds
	st := store.New(db, store.Config{
		DefaultMaxLeases: c.DefaultMaxLeases, Retention: c.Retention, RefreshInterval: c.RefreshInterval, Rounds: c.CommitRounds, Now: c.Now,
		OnRound:  func(ops int, d time.Duration) { met.ObserveRound(ops, d) },
		OnChange: func(cs []store.Change) { feed.Publish(cs) },
	})
	met = metrics.New(s.Metrics, st, s.Log)

	names := c.NATS.Names()
	nc, js, err := c.NATS.Connect(ctx, "lease", s.Log, s.Metrics)
	if err != nil {
		db.Close()
		return nil, err
	}

	var lister mirror.Lister
	var orch *grpc.ClientConn
	if c.Orchestrator.Addr != "" {
		orch, err = c.Orchestrator.Dial()
		if err != nil {
			nc.Close()
			db.Close()
			return nil, fmt.Errorf("--orchestrator-addr: %w", err)
		}
		lister = proxyv1.NewProxyServiceClient(orch)
	}
	creds := api.NewCredentialsCache()
	syncer := mirror.New(st, js, mirror.Config{Names: names, Lister: lister, ResyncInterval: c.ResyncInterval, Changed: creds.Forget}, met, s.Log)
	if lister != nil && c.InitialResyncTimeout > 0 {
		// Learn every proxy before serving, so the first acquires do
		// not see a partial mirror; an unreachable orchestrator only delays
		// the start, and the syncer keeps retrying in the background.
		rctx, cancel := context.WithTimeout(ctx, c.InitialResyncTimeout)
		err := syncer.Resync(rctx)
		cancel()
		if err != nil {
			s.Log.Warn("WARNING: the initial resync from the orchestrator failed; serving with the proxies the event streams hold and retrying in the background", "error", err)
		}
	}
	feed = api.NewFeed(nc, names.LeaseChangesSubject(), s.Log)
	if err := feed.Start(); err != nil {
		nc.Close()
		db.Close()
		return nil, fmt.Errorf("subscribing to lease changes: %w", err)
	}
	nc.SetReconnectHandler(func(*nats.Conn) { syncer.RequestResync("NATS reconnected") })
	nc.SetDisconnectErrHandler(func(_ *nats.Conn, err error) {
		// Whatever was published meanwhile is lost to the watchers.
		feed.Broken("NATS disconnected")
		if err != nil {
			s.Log.Warn("WARNING: disconnected from NATS; proxy changes are not seen until it reconnects", "error", err)
		}
	})

	srv := api.New(st, c.API, met, s.Log)
	srv.Feed = feed
	if orch != nil {
		srv.Credentials, srv.CredentialsCache = proxyv1.NewProxyServiceClient(orch), creds
	} else {
		s.Log.Warn("WARNING: no --orchestrator-addr: lease answers carry no proxy credentials, so crawlers cannot use proxies that demand them")
	}
	leasev1.RegisterLeaseServiceServer(s.GRPC, srv)
	s.MountREST(leasev1.RegisterLeaseServiceHandler)

	s.Go(st.Run)
	s.Go(syncer.Run)
	if c.DemandInterval > 0 {
		pub := &demand.Publisher{Store: st, JS: js, Names: names, Interval: c.DemandInterval, Log: s.Log,
			Published: demand.NewPublished(s.Metrics)}
		s.Go(pub.Run)
	}
	s.Go(func(ctx context.Context) error {
		sweep(ctx, st, c.SweepInterval, met, s.Log)
		return nil
	})
	s.Go(func(ctx context.Context) error {
		<-ctx.Done()
		nc.Close()
		if orch != nil {
			_ = orch.Close()
		}
		db.Close()
		return nil
	})
	return &Parts{Store: st, Syncer: syncer}, nil
}

func sweep(ctx context.Context, st *store.Store, every time.Duration, met *metrics.Metrics, log *slog.Logger) {
	t := time.NewTicker(every)
	defer t.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		res, err := st.Sweep(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if !failing {
				log.Warn("WARNING: the expiry sweep failed; expired leases keep their capacity until it succeeds", "error", err)
			}
			failing = true
			continue
		}
		if failing {
			log.Info("the expiry sweep works again")
		}
		failing = false
		met.Expired.Add(float64(res.Expired))

		if res.Expired > 0 {
			log.Debug("expired leases freed", "leases", res.Expired, "purged", res.Purged, "cooldowns_ended", res.Cooldowns, "tombstones_removed", res.Tombstones, "changes_purged", res.Changes)
		}
	}
}

// streamWorkers is how many goroutines serve gRPC calls before the server
// starts one per call. Lease calls wait for their round, so hundreds are in
// flight at once; a goroutine reused keeps the stack it grew, where a new
// one per call grows (copies) its stack every time.
const streamWorkers = 256

// flowWindow is the server's fixed HTTP/2 flow-control window, per stream
// and per connection. Setting it turns off gRPC's bandwidth estimation,
// which pings the client about once per round trip on every busy
// connection: with lease-load at 3,000 loops/s, fixed windows on both
// sides cut the service's and the clients' reads and writes from ~24,000
// to ~13,700 per second. Lease messages are small; 1 MiB never binds.
const flowWindow = 1 << 20

// Options are the service options the lease service needs.
func Options() []service.Option {
	return []service.Option{
		service.WithRESTOptions(api.RESTOptions()...),
		service.WithServerOptions(grpc.NumStreamWorkers(streamWorkers),
			grpc.InitialWindowSize(flowWindow), grpc.InitialConnWindowSize(flowWindow)),
	}
}
