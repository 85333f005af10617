// Package service is the common frame of every binary in the suite: flags
// and EGRESS_* environment variables, the slog logger, OpenTelemetry, a gRPC
// server with grpc.health.v1, and an HTTP server carrying the REST layer,
// Prometheus /metrics, /healthz and /readyz. Run serves until the context
// ends (SIGTERM or SIGINT in Main), then stops accepting work, lets
// in-flight calls finish within the shutdown timeout and returns. Every
// request is checked against its contract's rules (pkg/validate) before a
// handler sees it, and every REST error has one shape (pkg/rest).
package service

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"github.com/peterbourgon/ff/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc/filters"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	identityv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/identity/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/rest"
	"github.com/egress-proxies/egress-proxies/pkg/telemetry"
	"github.com/egress-proxies/egress-proxies/pkg/validate"
)

// Options are the settings every service has.
type Options struct {
	// Name of the service: the log and trace service name, the metrics
	// namespace prefix is always "egress".
	Name string
	// GRPCListen is the gRPC listen address.
	GRPCListen string
	// HTTPListen is the HTTP listen address (REST layer, /metrics,
	// /healthz, /readyz).
	HTTPListen string
	// LogLevel is debug, info, warn or error.
	LogLevel string
	// LogFormat is json or text.
	LogFormat string
	// ShutdownTimeout bounds the graceful part of a shutdown.
	ShutdownTimeout time.Duration
	// Auth, when set, makes every API call (all but gRPC health and
	// reflection) require a bearer token; its flags are registered too.
	Auth *auth.Config
	// TLSCertFile and TLSKeyFile, when both set, serve gRPC and HTTP over
	// TLS with that certificate (PEM; the chain in the cert file).
	TLSCertFile string
	TLSKeyFile  string
	// RESTCAFile and RESTServerName verify this service's own gRPC
	// port when the REST layer dials it over TLS, as every client of the
	// suite verifies a server. Empty: the certificate of TLSCertFile is the
	// only trusted one, and the first name it carries is the server name.
	RESTCAFile     string
	RESTServerName string
	// MaxRequestBytes bounds one request: a REST body (checked while it is
	// read, before the REST layer decodes it) and a received gRPC message.
	MaxRequestBytes int
	// Limits are the per-client rate limits; registered with Auth.
	Limits auth.Limits
	// Reflection serves gRPC server reflection (off by default: it lists
	// every method to anyone who can reach the port).
	Reflection bool
}

// DefaultMaxRequestBytes is the default of --max-request-bytes: far above
// the largest valid request (a proxy with 64 KiB of cloud-init and its
// labels), far below what could hurt a replica.
const DefaultMaxRequestBytes = 1 << 20

// RegisterFlags adds the common flags to fs, with the current values of o as
// defaults.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.GRPCListen, "grpc-listen", o.GRPCListen, "gRPC listen address")
	fs.StringVar(&o.HTTPListen, "http-listen", o.HTTPListen, "HTTP listen address: REST layer, /metrics, /healthz, /readyz")
	fs.StringVar(&o.LogLevel, "log-level", orDefault(o.LogLevel, "info"), "log level: debug, info, warn or error")
	fs.StringVar(&o.LogFormat, "log-format", orDefault(o.LogFormat, "json"), "log format: json or text")
	fs.DurationVar(&o.ShutdownTimeout, "shutdown-timeout", orDefault(o.ShutdownTimeout, 20*time.Second),
		"how long in-flight work may take to finish after SIGTERM")
	fs.StringVar(&o.TLSCertFile, "tls-cert-file", o.TLSCertFile, "serve gRPC and HTTP over TLS with this PEM certificate (chain); needs --tls-key-file")
	fs.StringVar(&o.TLSKeyFile, "tls-key-file", o.TLSKeyFile, "the PEM private key of --tls-cert-file")
	fs.StringVar(&o.RESTCAFile, "rest-ca-file", o.RESTCAFile,
		"PEM CA file that verifies this service's gRPC certificate when its REST layer dials it (default: trust exactly the certificate of --tls-cert-file)")
	fs.StringVar(&o.RESTServerName, "rest-server-name", o.RESTServerName,
		"name this service's gRPC certificate must carry for its REST layer (default: the first DNS name, else IP address, of --tls-cert-file's certificate)")
	fs.IntVar(&o.MaxRequestBytes, "max-request-bytes", orDefault(o.MaxRequestBytes, DefaultMaxRequestBytes),
		"largest request accepted: a REST body (413 beyond it, never read further) and a gRPC message (RESOURCE_EXHAUSTED)")
	fs.BoolVar(&o.Reflection, "grpc-reflection", o.Reflection, "serve gRPC server reflection (exempt from authentication; lists every method)")
	if o.Auth != nil {
		o.Auth.RegisterFlags(fs)
		if o.Limits == (auth.Limits{}) {
			o.Limits = auth.DefaultLimits()
		}
		o.Limits.RegisterFlags(fs)
	}
}

// Parse parses args into fs; every flag can also be set through an
// EGRESS_<FLAG_NAME> environment variable (dashes become underscores). A
// flag or variable of a renamed flag is refused with its new name:
// unknown variables are otherwise ignored, and an operator's setting
// would silently stop counting.
func Parse(fs *flag.FlagSet, args []string) error {
	if err := checkRenamed(fs, args); err != nil {
		fmt.Fprintln(fs.Output(), err)
		return err
	}
	return ff.Parse(fs, args, ff.WithEnvVarPrefix("EGRESS"))
}

// renamedFlags maps the old name of a renamed flag to its new one.
var renamedFlags = map[string]string{
	"auto-migrate":          "migrate",
	"gateway-ca-file":       "rest-ca-file",
	"gateway-server-name":   "rest-server-name",
	"pool-refresh-interval": "mirror-refresh-interval",
}

func envName(flagName string) string {
	return "EGRESS_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

func checkRenamed(fs *flag.FlagSet, args []string) error {
	for old, now := range renamedFlags {
		if fs.Lookup(now) == nil || fs.Lookup(old) != nil {
			continue
		}
		if _, set := os.LookupEnv(envName(old)); set {
			return fmt.Errorf("%s is no longer read: the flag is --%s now (%s)", envName(old), now, envName(now))
		}
		for _, a := range args {
			if a == "--" {
				break
			}
			name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
			if strings.HasPrefix(a, "-") && name == old {
				return fmt.Errorf("--%s was renamed: use --%s (%s)", old, now, envName(now))
			}
		}
	}
	return nil
}

func orDefault[T comparable](v, def T) T {
	var zero T
	if v == zero {
		return def
	}
	return v
}

// Service is one running binary: its servers, logger and metrics registry.
// Build it with New, register APIs and workers, then Run it.
type Service struct {
	Name    string
	Log     *slog.Logger
	Metrics *prometheus.Registry
	// GRPC is the gRPC server; register API implementations on it before
	// Run.
	GRPC *grpc.Server
	// HTTP is the HTTP mux; /metrics, /healthz and /readyz are registered,
	// and MountREST serves the REST layer under /.
	HTTP *http.ServeMux

	opts         Options
	health       *health.Server
	grpcLis      net.Listener
	httpLis      net.Listener
	restHandlers []func(context.Context, *runtime.ServeMux, *grpc.ClientConn) error
	gwOpts       []runtime.ServeMuxOption
	workers      []func(context.Context) error
	ready        atomic.Bool
	tracing      func(context.Context) error
	grpcOpts     []grpc.ServerOption
	grpcMet      *grpcprom.ServerMetrics
	cert         *tls.Certificate
	selfTLS      *tls.Config // how the REST layer dials the gRPC port; nil: plaintext
	authn        *auth.Authenticator
}

// Option adjusts a Service being built.
type Option func(*Service)

// WithServerOptions adds gRPC server options (interceptors such as auth).
func WithServerOptions(opts ...grpc.ServerOption) Option {
	return func(s *Service) { s.grpcOpts = append(s.grpcOpts, opts...) }
}

// WithRESTOptions adds grpc-gateway mux options (an error handler, say).
func WithRESTOptions(opts ...runtime.ServeMuxOption) Option {
	return func(s *Service) { s.gwOpts = append(s.gwOpts, opts...) }
}

// New builds a service and opens its listeners, so the bound addresses are
// known (and logged) before Run.
func New(ctx context.Context, opts Options, options ...Option) (*Service, error) {
	log, err := NewLogger(opts.LogLevel, opts.LogFormat, opts.Name)
	if err != nil {
		return nil, err
	}
	s := &Service{
		Name:    opts.Name,
		Log:     log,
		Metrics: prometheus.NewRegistry(),
		HTTP:    http.NewServeMux(),
		opts:    opts,
		health:  health.NewServer(),
	}
	for _, o := range options {
		o(s)
	}
	s.tracing, err = telemetry.Setup(ctx, opts.Name)
	if err != nil {
		return nil, fmt.Errorf("telemetry: %w", err)
	}

	s.Metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	grpcMetrics := grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram(
		grpcprom.WithHistogramBuckets([]float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}),
	))
	s.Metrics.MustRegister(grpcMetrics)
	s.grpcMet = grpcMetrics
	recoverPanic := recovery.WithRecoveryHandlerContext(func(ctx context.Context, p any) error {
		log.ErrorContext(ctx, "panic in gRPC handler", "panic", fmt.Sprint(p))
		return status.Error(codes.Internal, "internal error")
	})
	serverOpts := append(telemetry.ServerOptions(otelgrpc.WithFilter(filters.Not(filters.HealthCheck()))),
		grpc.ChainUnaryInterceptor(grpcMetrics.UnaryServerInterceptor(), recovery.UnaryServerInterceptor(recoverPanic)),
		grpc.ChainStreamInterceptor(grpcMetrics.StreamServerInterceptor(), recovery.StreamServerInterceptor(recoverPanic)),
	)
	switch {
	case opts.TLSCertFile != "" && opts.TLSKeyFile != "":
		cert, err := tls.LoadX509KeyPair(opts.TLSCertFile, opts.TLSKeyFile)
		if err != nil {
			return nil, fmt.Errorf("--tls-cert-file/--tls-key-file: %w", err)
		}
		s.cert = &cert
		serverOpts = append(serverOpts, grpc.Creds(credentials.NewTLS(&tls.Config{
			Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12,
		})))
		if s.selfTLS, err = restTLS(cert, opts.RESTCAFile, opts.RESTServerName); err != nil {
			return nil, err
		}
	case opts.TLSCertFile != "" || opts.TLSKeyFile != "":
		return nil, errors.New("--tls-cert-file and --tls-key-file go together")
	case opts.RESTCAFile != "" || opts.RESTServerName != "":
		return nil, errors.New("--rest-ca-file and --rest-server-name verify the service's own TLS certificate: they need --tls-cert-file and --tls-key-file")
	}
	if opts.Auth != nil {
		authn, err := auth.New(*opts.Auth, log)
		if err != nil {
			return nil, err
		}
		if err := authn.SetLimits(opts.Limits); err != nil {
			return nil, err
		}
		s.authn = authn
		serverOpts = append(serverOpts, authn.ServerOptions()...)
	}
	if opts.MaxRequestBytes < 0 {
		return nil, errors.New("--max-request-bytes must not be negative")
	}
	s.opts.MaxRequestBytes = orDefault(opts.MaxRequestBytes, DefaultMaxRequestBytes)
	serverOpts = append(serverOpts, grpc.MaxRecvMsgSize(s.opts.MaxRequestBytes))
	// Validation after authentication: an anonymous caller learns nothing,
	// not even which of its fields are wrong.
	validator, err := validate.New()
	if err != nil {
		return nil, err
	}
	serverOpts = append(serverOpts, validator.ServerOptions()...)
	s.GRPC = grpc.NewServer(append(serverOpts, s.grpcOpts...)...)
	healthpb.RegisterHealthServer(s.GRPC, s.health)
	// Every service tells a caller who it is (the console's sign-in).
	identityv1.RegisterIdentityServiceServer(s.GRPC, identityServer{disabled: s.authn == nil || s.authn.Disabled()})
	if opts.Reflection {
		reflection.Register(s.GRPC)
	}

	s.HTTP.Handle("GET /metrics", promhttp.HandlerFor(s.Metrics, promhttp.HandlerOpts{Registry: s.Metrics}))
	s.HTTP.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	s.HTTP.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !s.ready.Load() {
			http.Error(w, "not ready", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})

	var lc net.ListenConfig
	if s.grpcLis, err = lc.Listen(ctx, "tcp", opts.GRPCListen); err != nil {
		return nil, fmt.Errorf("gRPC listener: %w", err)
	}
	if s.httpLis, err = lc.Listen(ctx, "tcp", opts.HTTPListen); err != nil {
		_ = s.grpcLis.Close()
		return nil, fmt.Errorf("HTTP listener: %w", err)
	}
	return s, nil
}

// GRPCAddr is the bound gRPC address.
func (s *Service) GRPCAddr() string { return s.grpcLis.Addr().String() }

// ServesTLS reports whether the service serves gRPC and HTTP over TLS.
func (s *Service) ServesTLS() bool { return s.cert != nil }

// HTTPAddr is the bound HTTP address.
func (s *Service) HTTPAddr() string { return s.httpLis.Addr().String() }

// MountREST serves a REST layer registration (a generated
// Register<Service>Handler) under /, proxying to this service's own gRPC
// server so that interceptors and streaming behave the same for both.
func (s *Service) MountREST(register func(context.Context, *runtime.ServeMux, *grpc.ClientConn) error) {
	s.restHandlers = append(s.restHandlers, register)
}

// Go adds a background worker that runs for the life of the service. A
// worker returning an error stops the service.
func (s *Service) Go(worker func(context.Context) error) {
	s.workers = append(s.workers, worker)
}

// Run serves until ctx ends or a worker fails, then shuts down gracefully:
// health turns NOT_SERVING, the servers stop accepting, in-flight calls get
// the shutdown timeout to finish, workers are cancelled and awaited.
func (s *Service) Run(ctx context.Context) error {
	defer func() {
		tctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := s.tracing(tctx); err != nil {
			s.Log.Warn("flushing traces failed", "error", err)
		}
	}()

	if s.authn != nil {
		if err := auth.CheckCovered(s.GRPC.GetServiceInfo()); err != nil {
			s.Log.Error("refusing to serve", "error", err)
			return err
		}
	}
	// The REST layer sends what it decoded from a body of at most
	// MaxRequestBytes; its JSON is larger than the message.
	self := insecure.NewCredentials()
	if s.selfTLS != nil {
		self = credentials.NewTLS(s.selfTLS)
	}
	conn, err := grpc.NewClient(s.GRPCAddr(), append(telemetry.DialOptions(), grpc.WithTransportCredentials(self))...)
	if err != nil {
		return fmt.Errorf("REST layer connection: %w", err)
	}
	defer conn.Close()
	if len(s.restHandlers) > 0 {
		mux := rest.NewServeMux(s.gwOpts...)
		// A service with a REST layer answers GetIdentity there too.
		for _, register := range append(s.restHandlers, identityv1.RegisterIdentityServiceHandler) {
			if err := register(ctx, mux, conn); err != nil {
				return fmt.Errorf("registering REST handlers: %w", err)
			}
		}
		s.HTTP.Handle("/", s.guardREST(mux))
	}
	httpSrv := &http.Server{
		Handler:           otelhttp.NewHandler(s.HTTP, s.Name, otelhttp.WithFilter(notProbeOrScrape)),
		ReadHeaderTimeout: 10 * time.Second,
	}

	workCtx, stopWork := context.WithCancel(context.Background())
	defer stopWork()
	g, gctx := errgroup.WithContext(workCtx)
	g.Go(func() error {
		if err := s.GRPC.Serve(s.grpcLis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			return fmt.Errorf("gRPC server: %w", err)
		}
		return nil
	})
	g.Go(func() error {
		lis := s.httpLis
		if s.cert != nil {
			lis = tls.NewListener(lis, &tls.Config{Certificates: []tls.Certificate{*s.cert}, MinVersion: tls.VersionTLS12})
		}
		if err := httpSrv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("HTTP server: %w", err)
		}
		return nil
	})
	for _, w := range s.workers {
		g.Go(func() error { return w(gctx) })
	}

	s.grpcMet.InitializeMetrics(s.GRPC)
	// A REST layer that cannot reach the gRPC port (a CA or server name that
	// does not verify the certificate) would answer every REST call 503:
	// refuse to run instead, saying why.
	var startErr error
	if len(s.restHandlers) > 0 {
		startErr = s.checkREST(gctx, conn)
	}
	if startErr == nil {
		s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
		s.ready.Store(true)
		s.Log.Info("serving", "grpc", s.GRPCAddr(), "http", s.HTTPAddr())
		select {
		case <-ctx.Done():
			s.Log.Info("shutting down", "reason", context.Cause(ctx))
		case <-gctx.Done():
		}
	}
	s.ready.Store(false)
	s.health.Shutdown()

	graceCtx, cancel := context.WithTimeout(context.Background(), s.opts.ShutdownTimeout)
	defer cancel()
	stopped := make(chan struct{})
	go func() {
		s.GRPC.GracefulStop()
		close(stopped)
	}()
	if err := httpSrv.Shutdown(graceCtx); err != nil {
		_ = httpSrv.Close()
	}
	select {
	case <-stopped:
	case <-graceCtx.Done():
		s.Log.Warn("in-flight gRPC calls did not finish in time; closing them", "timeout", s.opts.ShutdownTimeout)
		s.GRPC.Stop()
	}
	stopWork()
	err = errors.Join(startErr, g.Wait())
	if err != nil {
		s.Log.Error("stopped with an error", "error", err)
		return err
	}
	s.Log.Info("stopped")
	return nil
}

// restTLS is how the REST layer dials this service's own TLS gRPC
// port: verified like every client of the suite, with a CA file and a
// server name. By default it trusts exactly the service's own certificate
// and expects the first name that certificate carries (the REST layer dials
// the bound address, which the certificate need not name).
func restTLS(cert tls.Certificate, caFile, serverName string) (*tls.Config, error) {
	leaf := cert.Leaf
	if leaf == nil {
		var err error
		if leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return nil, fmt.Errorf("--tls-cert-file: %w", err)
		}
	}
	if serverName == "" {
		switch {
		case len(leaf.DNSNames) > 0:
			serverName = leaf.DNSNames[0]
		case len(leaf.IPAddresses) > 0:
			serverName = leaf.IPAddresses[0].String()
		default:
			return nil, errors.New("--tls-cert-file: the certificate carries no DNS name or IP address for the REST layer to verify; set --rest-server-name")
		}
	}
	c := Client{CAFile: caFile, ServerName: serverName, TLS: true}
	cfg, err := c.TLSConfig()
	if err != nil {
		return nil, fmt.Errorf("--rest-ca-file: %w", err)
	}
	if caFile == "" {
		cfg.RootCAs = x509.NewCertPool()
		cfg.RootCAs.AddCert(leaf)
	}
	return cfg, nil
}

// checkREST makes one call through the REST layer's connection (gRPC
// health, exempt from authentication): it fails at once when TLS does not
// verify.
func (s *Service) checkREST(ctx context.Context, conn *grpc.ClientConn) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		err = fmt.Errorf("the REST layer cannot reach this service's gRPC port %s: %s", s.GRPCAddr(), status.Convert(err).Message())
		if s.selfTLS != nil {
			err = fmt.Errorf("%w (it verifies the certificate with --rest-ca-file %q, default the service's own certificate, and --rest-server-name %q)",
				err, s.opts.RESTCAFile, s.selfTLS.ServerName)
		}
		s.Log.Error("refusing to serve", "error", err)
		return err
	}
	return nil
}

func notProbeOrScrape(r *http.Request) bool {
	switch r.URL.Path {
	case "/metrics", "/healthz", "/readyz":
		return false
	}
	return true
}

// Binary describes one service binary for Main.
type Binary struct {
	// Options holds the common settings; the listen addresses set here are
	// the defaults of the flags.
	Options
	// Flags registers the service's own flags, if any.
	Flags func(*flag.FlagSet)
	// Setup registers APIs and workers on the built service, if any.
	Setup func(context.Context, *Service) error
	// ServiceOptions adjust the service being built.
	ServiceOptions []Option
	// Migrate, when set, is what `<binary> migrate [flags]` runs: apply the
	// service's database migrations and exit.
	Migrate func(context.Context, *slog.Logger) error
}

// Main is a binary's whole life: it parses flags (and EGRESS_* variables)
// from args, builds the service, lets Setup register APIs and workers, and
// runs it until SIGTERM or SIGINT. With a first argument "migrate" it runs
// Migrate instead and exits. It returns the process exit code.
func Main(b Binary, args []string) int {
	opts := b.Options
	migrate := len(args) > 0 && args[0] == "migrate" && b.Migrate != nil
	if migrate {
		args = args[1:]
	}
	fs := flag.NewFlagSet(opts.Name, flag.ContinueOnError)
	opts.RegisterFlags(fs)
	if b.Flags != nil {
		b.Flags(fs)
	}
	if err := Parse(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if migrate {
		log, err := NewLogger(opts.LogLevel, opts.LogFormat, opts.Name)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", opts.Name, err)
			return 2
		}
		if err := b.Migrate(ctx, log); err != nil {
			log.Error("migration failed", "error", err)
			return 1
		}
		log.Info("migrations applied")
		return 0
	}
	s, err := New(ctx, opts, b.ServiceOptions...)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", opts.Name, err)
		return 1
	}
	if b.Setup != nil {
		if err := b.Setup(ctx, s); err != nil {
			s.Log.Error("setup failed", "error", err)
			return 1
		}
	}
	if err := s.Run(ctx); err != nil {
		return 1
	}
	return 0
}
