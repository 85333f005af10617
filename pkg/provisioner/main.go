package provisioner

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/reload"
	"github.com/egress-proxies/egress-proxies/pkg/service"
)

// Spec describes one backend's provisioner binary for Main.
type Spec struct {
	// Options are the service's common settings (name, listen defaults).
	service.Options
	// Type is the provider type the binary serves (proxmox, kvm, gcp, kubernetes,
	// local); a --provider of another type is refused.
	Type string
	// NewBackend builds the backend from its provider's config block. It
	// must not need the backend to be reachable.
	NewBackend func(ctx context.Context, p providers.Provider, log *slog.Logger) (Backend, error)
	// Flags registers the backend's own flags, if any (parsed before
	// NewBackend runs).
	Flags func(*flag.FlagSet)
}

// Flags are the runtime's flags (each also EGRESS_<NAME>).
type Flags struct {
	ProvidersConfig string
	Provider        string
	NATS            bus.Flags
	ReplicaID       string
	MaxConcurrent   int
	AckWait         time.Duration
	DrainTimeout    time.Duration
	// Orchestrator is where Create fetches the proxy's credentials; an
	// empty Addr delivers none (instances serve anyone).
	Orchestrator service.Client
}

// Register adds the flags to fs.
func (f *Flags) Register(fs *flag.FlagSet) {
	host, _ := os.Hostname()
	fs.StringVar(&f.ProvidersConfig, "providers-config", "", "path of the providers YAML file (required)")
	fs.StringVar(&f.Provider, "provider", "", "name of the provider block this process serves (required)")
	f.NATS.Register(fs)
	fs.StringVar(&f.ReplicaID, "replica-id", fmt.Sprintf("%s-%d", host, os.Getpid()), "this replica's name in command results")
	fs.IntVar(&f.MaxConcurrent, "max-concurrent", 8, "commands executed at once by this replica")
	fs.DurationVar(&f.AckWait, "ack-wait", 30*time.Second, "the command consumer's ack wait: how long a replica that died mid-command holds it before redelivery (running commands are heartbeated)")
	fs.DurationVar(&f.DrainTimeout, "drain-timeout", 10*time.Second, "after SIGTERM, how long in-flight commands may finish before they are handed back for redelivery")
	fs.StringVar(&f.Orchestrator.Addr, "orchestrator-addr", "", "gRPC address of the orchestrator, where Create fetches each proxy's credentials (host:port); empty: instances get no credentials and serve anyone")
	f.Orchestrator.RegisterFlags(fs, "orchestrator", "the orchestrator")
}

// Main runs a provisioner binary: the service frame plus the runtime's
// flags, the backend built from its providers block, the gRPC
// ProvisionerService and the NATS worker. It returns the exit code.
func Main(spec Spec, args []string) int {
	var f Flags
	opts := spec.Options
	if opts.Auth == nil {
		// ProvisionerService creates and deletes instances: only callers
		// with the service role may use it.
		opts.Auth = &auth.Config{}
	}
	return service.Main(service.Binary{
		Options: opts,
		Flags: func(fs *flag.FlagSet) {
			f.Register(fs)
			if spec.Flags != nil {
				spec.Flags(fs)
			}
		},
		Setup: func(ctx context.Context, s *service.Service) error { return Setup(ctx, s, spec, f) },
	}, args)
}

// Setup wires the runtime into a built service.
func Setup(ctx context.Context, s *service.Service, spec Spec, f Flags) error {
	if f.ProvidersConfig == "" || f.Provider == "" {
		return errors.New("--providers-config and --provider are required")
	}
	if err := f.NATS.Validate(); err != nil {
		return err
	}
	file, err := providers.Open(f.ProvidersConfig, s.Log, s.Metrics)
	if err != nil {
		return err
	}
	cfg := file.Value()
	p, ok := cfg.Get(f.Provider)
	if !ok {
		return fmt.Errorf("--provider %q is not in %s (it has %v)", f.Provider, f.ProvidersConfig, cfg.Names())
	}
	if p.Type != spec.Type {
		return fmt.Errorf("--provider %q is a %s provider; this binary serves %s", f.Provider, p.Type, spec.Type)
	}
	log := s.Log.With("provider", p.Name)
	backend, err := spec.NewBackend(ctx, p, log)
	if err != nil {
		return fmt.Errorf("provider %s: %w", p.Name, err)
	}
	metrics := NewMetrics(s.Metrics)
	var creds CredentialsSource
	if f.Orchestrator.Addr != "" {
		conn, err := f.Orchestrator.Dial()
		if err != nil {
			return fmt.Errorf("--orchestrator-addr: %w", err)
		}
		s.Go(func(ctx context.Context) error { <-ctx.Done(); return conn.Close() })
		creds = proxyv1.NewProxyServiceClient(conn)
	} else {
		log.Warn("WARNING: no --orchestrator-addr: instances are created without their proxy's credentials and serve anyone who reaches them")
	}
	rt := NewRuntime(RuntimeOptions{Provider: p.Name, Backend: backend, Log: s.Log, Metrics: metrics, Credentials: creds})
	provisionerv1.RegisterProvisionerServiceServer(s.GRPC, &Server{RT: rt})

	names := f.NATS.Names()
	nc, js, err := f.NATS.Connect(ctx, spec.Name+"/"+f.ReplicaID, s.Log, s.Metrics)
	if err != nil {
		return err
	}
	w := &Worker{
		RT: rt, JS: js, Names: names, ReplicaID: f.ReplicaID,
		MaxConcurrent: f.MaxConcurrent, AckWait: f.AckWait, DrainTimeout: f.DrainTimeout,
		Log: s.Log, Metrics: metrics,
	}
	cw := &configWatch{file: file, spec: spec, rt: rt, worker: w, served: p, log: log,
		rejected: providers.RejectedCounter(s.Metrics)}
	s.Go(func(ctx context.Context) error {
		defer nc.Close()
		return cw.run(ctx)
	})
	log.Info("provisioner configured", "type", p.Type, "replica", f.ReplicaID,
		"prefix", names.Prefix, "check", rt.HasCheck())
	return nil
}

// configWatch follows the providers config (reloaded on change): when this
// provider's entry changes, the backend is rebuilt from it (a new entry
// that does not build keeps the backend in effect, with an ERROR and a
// failure counted); when the entry is removed the worker stops taking
// commands (the orchestrator answers ProviderNotConfigured), and it takes
// them again once the entry is back.
type configWatch struct {
	file     *providers.File
	spec     Spec
	rt       *Runtime
	worker   *Worker
	served   providers.Provider
	log      *slog.Logger
	rejected func()
}

func (c *configWatch) run(ctx context.Context) error {
	var wg sync.WaitGroup
	defer wg.Wait()
	stop := func() {}
	start := func() {
		wctx, cancel := context.WithCancel(ctx)
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = c.worker.Run(wctx)
		}()
		stop = func() { cancel(); wg.Wait() }
	}
	start()
	serving := true
	t := time.NewTicker(reload.Every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if !c.file.Refresh() {
			continue
		}
		p, ok := c.file.Value().Get(c.served.Name)
		switch {
		case !ok:
			if serving {
				c.log.Warn("WARNING: this provider was removed from the providers config; commands are no longer taken until it is back",
					"path", c.file.Path())
				stop()
				serving = false
			}
			continue
		case p.Type != c.spec.Type:
			c.log.Error("ERROR: this provider's type changed in the providers config; this binary serves only its own type, the entry before stays in effect",
				"path", c.file.Path(), "field", p.Path+".type", "type", p.Type, "serves", c.spec.Type)
			c.rejected()
			continue
		case !p.Same(c.served):
			b, err := c.spec.NewBackend(ctx, p, c.log)
			if err != nil {
				c.log.Error("ERROR: this provider's new entry in the providers config cannot be used; the entry before stays in effect",
					"path", c.file.Path(), "error", err)
				c.rejected()
			} else {
				c.rt.SetBackend(b)
				c.served = p
				c.log.Info("this provider's entry in the providers config changed; its backend was rebuilt", "path", c.file.Path())
			}
		}
		if !serving {
			c.log.Info("this provider is back in the providers config; commands are taken again", "path", c.file.Path())
			start()
			serving = true
		}
	}
}
