package provisioner

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/nats-io/nats.go"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
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
	ProvidersConfig    string
	Provider           string
	NATSURL            string
	NATSPrefix         string
	NATSStreamReplicas int
	ReplicaID          string
	MaxConcurrent      int
	AckWait            time.Duration
	DrainTimeout       time.Duration
}

// Register adds the flags to fs.
func (f *Flags) Register(fs *flag.FlagSet) {
	host, _ := os.Hostname()
	fs.StringVar(&f.ProvidersConfig, "providers-config", "", "path of the providers YAML file (required)")
	fs.StringVar(&f.Provider, "provider", "", "name of the provider block this process serves (required)")
	fs.StringVar(&f.NATSURL, "nats-url", nats.DefaultURL, "NATS server URL")
	fs.StringVar(&f.NATSPrefix, "nats-prefix", bus.DefaultPrefix, "prefix of every NATS subject and stream")
	fs.IntVar(&f.NATSStreamReplicas, "nats-stream-replicas", 1, "JetStream servers that store each stream (3 on a three-server cluster); the same on every service")
	fs.StringVar(&f.ReplicaID, "replica-id", fmt.Sprintf("%s-%d", host, os.Getpid()), "this replica's name in command results")
	fs.IntVar(&f.MaxConcurrent, "max-concurrent", 8, "commands executed at once by this replica")
	fs.DurationVar(&f.AckWait, "ack-wait", 30*time.Second, "the command consumer's ack wait: how long a replica that died mid-command holds it before redelivery (running commands are heartbeated)")
	fs.DurationVar(&f.DrainTimeout, "drain-timeout", 10*time.Second, "after SIGTERM, how long in-flight commands may finish before they are handed back for redelivery")
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
	cfg, err := providers.LoadFile(f.ProvidersConfig)
	if err != nil {
		return err
	}
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
	rt := NewRuntime(RuntimeOptions{Provider: p.Name, Backend: backend, Log: s.Log, Metrics: metrics})
	provisionerv1.RegisterProvisionerServiceServer(s.GRPC, &Server{RT: rt})

	names := bus.Names{Prefix: f.NATSPrefix}
	nc, js, err := bus.Connect(ctx, bus.ConnectOptions{URL: f.NATSURL, Name: spec.Name + "/" + f.ReplicaID, Names: names, StreamReplicas: f.NATSStreamReplicas, Log: s.Log, Metrics: s.Metrics})
	if err != nil {
		return err
	}
	w := &Worker{
		RT: rt, JS: js, Names: names, ReplicaID: f.ReplicaID,
		MaxConcurrent: f.MaxConcurrent, AckWait: f.AckWait, DrainTimeout: f.DrainTimeout,
		Log: s.Log, Metrics: metrics,
	}
	s.Go(func(ctx context.Context) error {
		defer nc.Close()
		return w.Run(ctx)
	})
	log.Info("provisioner configured", "type", p.Type, "replica", f.ReplicaID, "nats", f.NATSURL,
		"prefix", names.Prefix, "check", rt.HasCheck())
	return nil
}
