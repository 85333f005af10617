// Package app wires the gateway: its flags, the lease service client, the
// HTTP proxy and SOCKS5 listeners and the admin API on the service frame.
package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	gatewayv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/gateway/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/access"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/admin"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/metrics"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/proxy"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/rules"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/session"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/socks"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/tunnel"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/upstream"
)

// Config is the gateway's own configuration.
type Config struct {
	// Lease reaches the lease service with the gateway's own token (roles
	// crawler, to lease, and service, to watch the lease changes and list
	// the cooldowns): every lease the gateway takes is the gateway's.
	Lease service.Client
	// ProxyListen and SocksListen are the crawler-facing listeners.
	ProxyListen string
	SocksListen string
	// ProxyAuth checks the crawlers' tokens (the same token file as
	// every service's --auth-token-file, which guards the admin API).
	ProxyAuth *auth.Config

	RulesFile string

	LeaseTTL          time.Duration
	SessionLifetime   time.Duration
	SessionMaxAge     time.Duration
	LeaseCallTimeout  time.Duration
	Retries           int
	DialTimeout       time.Duration
	HandshakeTimeout  time.Duration
	ResponseTimeout   time.Duration
	UpstreamIdle      time.Duration
	MaxIdlePerProxy   int
	ReadHeaderTimeout time.Duration
	ClientIdleTimeout time.Duration
	MaxHeaderBytes    int
	TunnelIdleTimeout time.Duration
	TunnelMaxLifetime time.Duration
	MaxTunnels        int
	MaxClientTunnels  int
	AuthFailures      int
	// Reservoir turns on the leases held ahead for requests without a
	// session; ReservoirHeadroom, ReservoirIdle and ConfirmInterval shape
	// it (docs/gateway.md, Scaling).
	Reservoir         bool
	ReservoirHeadroom int
	ReservoirIdle     time.Duration
	ConfirmInterval   time.Duration
}

// DefaultConfig is the configuration with every default.
func DefaultConfig() *Config {
	return &Config{
		Lease:             service.Client{Addr: "127.0.0.1:8110"},
		ProxyListen:       "127.0.0.1:8080",
		SocksListen:       "127.0.0.1:1080",
		LeaseTTL:          time.Minute,
		SessionLifetime:   10 * time.Minute,
		SessionMaxAge:     time.Hour,
		LeaseCallTimeout:  5 * time.Second,
		Retries:           2,
		DialTimeout:       5 * time.Second,
		HandshakeTimeout:  10 * time.Second,
		ResponseTimeout:   60 * time.Second,
		UpstreamIdle:      90 * time.Second,
		MaxIdlePerProxy:   64,
		ReadHeaderTimeout: 10 * time.Second,
		ClientIdleTimeout: 2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		TunnelIdleTimeout: 5 * time.Minute,
		TunnelMaxLifetime: time.Hour,
		MaxTunnels:        10000,
		MaxClientTunnels:  1000,
		AuthFailures:      30,
		Reservoir:         true,
		ReservoirHeadroom: 2,
		ReservoirIdle:     3 * time.Second,
		ConfirmInterval:   time.Second,
	}
}

// RegisterFlags adds the gateway's flags.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Lease.Addr, "lease-addr", c.Lease.Addr, "gRPC address of the lease service")
	c.Lease.RegisterFlags(fs, "lease", "the lease service")
	fs.StringVar(&c.ProxyListen, "proxy-listen", c.ProxyListen, "listen address of the HTTP proxy (absolute-URI requests and CONNECT)")
	fs.StringVar(&c.SocksListen, "socks-listen", c.SocksListen, "listen address of the SOCKS5 proxy; empty: none")
	fs.StringVar(&c.RulesFile, "rules-file", c.RulesFile, "YAML file of ban rules that classify plain-HTTP answers (docs/gateway.md); empty: no rules")
	fs.DurationVar(&c.LeaseTTL, "lease-ttl", c.LeaseTTL, "TTL of the lease of a request or tunnel; a tunnel renews it at a third of it, so a killed gateway's leases end within it")
	fs.DurationVar(&c.SessionLifetime, "session-lifetime", c.SessionLifetime, "how long a session lives after its last request when its username sets no lifetime")
	fs.DurationVar(&c.SessionMaxAge, "session-max-age", c.SessionMaxAge, "a session's lease that old is ended at the session's next request, which starts anew on any proxy; 0: never")
	fs.DurationVar(&c.LeaseCallTimeout, "lease-call-timeout", c.LeaseCallTimeout, "bound on each call to the lease service")
	fs.IntVar(&c.Retries, "retries", c.Retries, "how many more proxies a request or tunnel tries when its proxy cannot be reached, refuses the CONNECT, or (idempotent requests) is caught by a ban rule")
	fs.DurationVar(&c.DialTimeout, "upstream-dial-timeout", c.DialTimeout, "bound on connecting to a proxy")
	fs.DurationVar(&c.HandshakeTimeout, "upstream-handshake-timeout", c.HandshakeTimeout, "bound on a proxy's answer to CONNECT")
	fs.DurationVar(&c.ResponseTimeout, "upstream-response-timeout", c.ResponseTimeout, "bound on the wait for a forwarded request's response headers")
	fs.DurationVar(&c.UpstreamIdle, "upstream-idle-timeout", c.UpstreamIdle, "how long a kept-alive connection to a proxy waits for its next request")
	fs.IntVar(&c.MaxIdlePerProxy, "upstream-max-idle", c.MaxIdlePerProxy, "kept-alive connections per proxy")
	fs.DurationVar(&c.ReadHeaderTimeout, "read-header-timeout", c.ReadHeaderTimeout, "bound on reading a request's headers (HTTP) or the SOCKS5 handshake; slower clients are disconnected")
	fs.DurationVar(&c.ClientIdleTimeout, "client-idle-timeout", c.ClientIdleTimeout, "how long a client's kept-alive connection waits for its next request")
	fs.IntVar(&c.MaxHeaderBytes, "max-header-bytes", c.MaxHeaderBytes, "largest request header block (431 beyond it)")
	fs.DurationVar(&c.TunnelIdleTimeout, "tunnel-idle-timeout", c.TunnelIdleTimeout, "a tunnel with no byte either way for this long is closed; 0: never")
	fs.DurationVar(&c.TunnelMaxLifetime, "tunnel-max-lifetime", c.TunnelMaxLifetime, "a tunnel this old is closed; 0: never")
	fs.IntVar(&c.MaxTunnels, "max-tunnels", c.MaxTunnels, "tunnels open at once in all (503 beyond); 0: no limit")
	fs.IntVar(&c.MaxClientTunnels, "max-client-tunnels", c.MaxClientTunnels, "tunnels open at once per client (429 beyond); 0: no limit")
	fs.BoolVar(&c.Reservoir, "lease-reservoir", c.Reservoir, "hold leases ahead per selector for requests and tunnels without a session and cache each session's lease, used while the fleet view (WatchLeases) is in place; false: every request and tunnel asks the lease service")
	fs.IntVar(&c.ReservoirHeadroom, "lease-reservoir-headroom", c.ReservoirHeadroom, "leases a selector's reservoir holds beyond its recent peak of concurrent use")
	fs.DurationVar(&c.ReservoirIdle, "lease-reservoir-idle", c.ReservoirIdle, "how long a reservoir lease beyond the recent peak stays idle before it is released")
	fs.DurationVar(&c.ConfirmInterval, "lease-confirm-interval", c.ConfirmInterval, "how often each reservoir lease is renewed; one not confirmed within twice it is not used, so a proxy that became unleasable is used at most about this long after the lease service knows")
	fs.IntVar(&c.AuthFailures, "auth-failures-per-minute", c.AuthFailures, "failed credentials a source address may send per minute before its every attempt is refused (429) for a while")
}

func (c *Config) check() error {
	switch {
	case c.Lease.Addr == "":
		return errors.New("--lease-addr is required")
	case c.ProxyListen == "":
		return errors.New("--proxy-listen is required")
	case c.LeaseTTL < 5*time.Second:
		return errors.New("--lease-ttl must be at least 5s (the lease service's shortest)")
	case c.SessionLifetime < 10*time.Second || c.SessionLifetime > time.Hour:
		return errors.New("--session-lifetime must lie between 10s and 1h")
	case c.Retries < 0 || c.Retries > 10:
		return errors.New("--retries must lie between 0 and 10")
	case c.MaxHeaderBytes < 1024:
		return errors.New("--max-header-bytes must be at least 1024")
	case c.MaxTunnels < 0 || c.MaxClientTunnels < 0:
		return errors.New("--max-tunnels and --max-client-tunnels must not be negative")
	case c.Reservoir && (c.ConfirmInterval < 100*time.Millisecond || c.ConfirmInterval > c.LeaseTTL/3):
		return errors.New("--lease-confirm-interval must lie between 100ms and a third of --lease-ttl")
	case c.Reservoir && (c.ReservoirHeadroom < 0 || c.ReservoirIdle <= 0):
		return errors.New("--lease-reservoir-headroom must not be negative and --lease-reservoir-idle must be positive")
	case c.ReadHeaderTimeout <= 0 || c.LeaseCallTimeout <= 0 || c.DialTimeout <= 0 || c.HandshakeTimeout <= 0:
		return errors.New("--read-header-timeout, --lease-call-timeout, --upstream-dial-timeout and --upstream-handshake-timeout must be positive")
	}
	return nil
}

// Gateway is the running gateway's parts, for the admin API and tests.
type Gateway struct {
	Core      *tunnel.Core
	ProxyAddr string
	SocksAddr string
}

// Setup builds the gateway on s: authn checks the crawlers' tokens.
func (c *Config) Setup(ctx context.Context, s *service.Service, authn *auth.Authenticator) (*Gateway, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	set := &rules.Set{}
	if c.RulesFile != "" {
		var err error
		if set, err = rules.LoadFile(c.RulesFile); err != nil {
			return nil, err
		}
		s.Log.Info("ban rules loaded", "rules", len(set.Rules), "file", c.RulesFile)
	}
	conn, err := c.Lease.Dial()
	if err != nil {
		return nil, fmt.Errorf("--lease-addr: %w", err)
	}
	m := metrics.New(s.Metrics)
	dialer := &upstream.Dialer{
		DialTimeout: c.DialTimeout, HandshakeTimeout: c.HandshakeTimeout, ResponseHeaderTimeout: c.ResponseTimeout,
		IdleConnTimeout: c.UpstreamIdle, MaxIdlePerProxy: c.MaxIdlePerProxy,
	}
	leaseClient := leasev1.NewLeaseServiceClient(conn)
	leaser := &upstream.Leaser{
		Client: leaseClient, TTL: c.LeaseTTL, SessionLifetime: c.SessionLifetime,
		SessionMaxAge: c.SessionMaxAge, CallTimeout: c.LeaseCallTimeout, Log: s.Log, Calls: m.LeaseCalls,
	}
	// The reservoir releases its idle leases at shutdown, before the
	// connection closes.
	drained := make(chan struct{})
	if c.Reservoir {
		fleet := upstream.NewFleet(leaseClient, c.LeaseCallTimeout, s.Log)
		res := &upstream.Reservoir{
			Leaser: leaser, Fleet: fleet, Headroom: c.ReservoirHeadroom, IdleTime: c.ReservoirIdle,
			ConfirmInterval: c.ConfirmInterval, Results: m.LeaseCache, Size: m.ReservoirLeases,
		}
		fleet.Ended = res.Ended
		leaser.Reservoir = res
		s.Go(func(ctx context.Context) error { fleet.Run(ctx); return nil })
		s.Go(func(ctx context.Context) error { defer close(drained); res.Run(ctx); return nil })
	} else {
		close(drained)
	}
	core := &tunnel.Core{
		Leaser: leaser,
		Dialer: dialer, Sessions: session.NewRegistry(), Metrics: m,
		Limits:  access.NewLimits(c.MaxTunnels, c.MaxClientTunnels),
		Retries: c.Retries, IdleTimeout: c.TunnelIdleTimeout, MaxLifetime: c.TunnelMaxLifetime, Log: s.Log,
	}
	checker := access.NewChecker(authn, c.AuthFailures)

	var lc net.ListenConfig
	proxyLis, err := lc.Listen(ctx, "tcp", c.ProxyListen)
	if err != nil {
		return nil, fmt.Errorf("--proxy-listen: %w", err)
	}
	g := &Gateway{Core: core, ProxyAddr: proxyLis.Addr().String()}
	handler := &proxy.Handler{Core: core, Access: checker, Rules: set, Log: s.Log}
	srv := &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: c.ReadHeaderTimeout,
		IdleTimeout:       c.ClientIdleTimeout,
		MaxHeaderBytes:    c.MaxHeaderBytes,
		ErrorLog:          nil,
	}
	var socksLis net.Listener
	if c.SocksListen != "" {
		if socksLis, err = lc.Listen(ctx, "tcp", c.SocksListen); err != nil {
			_ = proxyLis.Close()
			return nil, fmt.Errorf("--socks-listen: %w", err)
		}
		g.SocksAddr = socksLis.Addr().String()
	}
	s.Log.Info("proxy listeners", "http", g.ProxyAddr, "socks5", g.SocksAddr)
	var serving atomic.Bool
	s.Go(func(ctx context.Context) error {
		serving.Store(true)
		defer serving.Store(false)
		return proxy.Serve(ctx, srv, proxyLis, m.Refusals)
	})
	gatewayv1.RegisterGatewayServiceServer(s.GRPC, &admin.Server{Core: core, ProxyAddr: g.ProxyAddr, SocksAddr: g.SocksAddr, Ready: serving.Load})
	s.MountREST(gatewayv1.RegisterGatewayServiceHandler)
	if socksLis != nil {
		ss := &socks.Server{Core: core, Access: checker, HandshakeTimeout: c.ReadHeaderTimeout, Log: s.Log}
		s.Go(func(ctx context.Context) error { return ss.Serve(ctx, socksLis) })
	}
	s.Go(func(ctx context.Context) error {
		<-ctx.Done()
		dialer.Close()
		<-drained
		return conn.Close()
	})
	return g, nil
}
