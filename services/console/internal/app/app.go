// Package app wires the console: its flags, the connections to the
// services it shows, and the web server on the service frame's HTTP port.
package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/console/internal/web"
)

// Config is the console's own configuration.
type Config struct {
	// Orchestrator, Lease and Health are the APIs the console shows; the
	// user's token goes with every call, so their token files are unused.
	Orchestrator, Lease, Health service.Client

	SessionKeyFile string
	SessionTTL     time.Duration
	// SecureCookies: "auto" (Secure when this process serves TLS),
	// "true" (behind a TLS-terminating Ingress) or "false".
	SecureCookies string

	GatewayMetricsURL string
	GatewayRequests   string
	GatewayBytes      string
}

// RegisterFlags adds the console's flags.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	addr := func(cl *service.Client, prefix, what, def string) {
		cl.Addr = def
		fs.StringVar(&cl.Addr, prefix+"-addr", cl.Addr, "gRPC address of "+what)
		fs.StringVar(&cl.CAFile, prefix+"-ca-file", cl.CAFile, "PEM CA file that verifies "+what+"'s TLS certificate; setting it dials "+what+" over TLS")
		fs.StringVar(&cl.ServerName, prefix+"-server-name", cl.ServerName, "name "+what+"'s TLS certificate must carry (default: the host of its address)")
	}
	addr(&c.Orchestrator, "orchestrator", "the orchestrator", "127.0.0.1:8100")
	addr(&c.Lease, "lease", "the lease service", "127.0.0.1:8110")
	addr(&c.Health, "health", "the health service", "127.0.0.1:8120")
	fs.StringVar(&c.SessionKeyFile, "session-key-file", "",
		"file of base64 32-byte keys, one a line, that seal the session cookie (the first seals, all open); every replica needs the same file. Empty: a random key per process (sessions end at restart and are not shared between replicas)")
	fs.DurationVar(&c.SessionTTL, "session-ttl", 12*time.Hour, "how long a sign-in lasts")
	fs.StringVar(&c.SecureCookies, "secure-cookies", "auto", "mark the session cookie Secure: auto (when --tls-cert-file is set), true (behind a TLS-terminating proxy or Ingress) or false")
	fs.StringVar(&c.GatewayMetricsURL, "gateway-metrics-url", "",
		"the gateway's Prometheus endpoint (http://host:port/metrics); the overview shows its request and byte rates. Empty: no gateway figures")
	fs.StringVar(&c.GatewayRequests, "gateway-requests-metric", "egress_gateway_requests_total", "the gateway's counter of requests, summed over its series")
	fs.StringVar(&c.GatewayBytes, "gateway-bytes-metric", "egress_gateway_bytes_total", "the gateway's counter of bytes relayed, summed over its series")
}

// Setup connects to the services and serves the console on s's HTTP port.
func (c *Config) Setup(_ context.Context, s *service.Service, tlsServing bool) error {
	secure := tlsServing
	switch c.SecureCookies {
	case "auto":
	case "true":
		secure = true
	case "false":
		secure = false
	default:
		return fmt.Errorf("--secure-cookies %q: want auto, true or false", c.SecureCookies)
	}
	var keys [][]byte
	if c.SessionKeyFile != "" {
		var err error
		if keys, err = web.ReadSessionKeys(c.SessionKeyFile); err != nil {
			return err
		}
	} else {
		s.Log.Warn("WARNING: no --session-key-file; sessions are sealed with a random key: they end when this process restarts and work on this replica only")
		keys = [][]byte{web.RandomSessionKey()}
	}
	for _, cl := range []*service.Client{&c.Orchestrator, &c.Lease, &c.Health} {
		if cl.Addr == "" {
			return errors.New("--orchestrator-addr, --lease-addr and --health-addr are required")
		}
	}
	orch, err := c.Orchestrator.Dial()
	if err != nil {
		return fmt.Errorf("--orchestrator-addr: %w", err)
	}
	lease, err := c.Lease.Dial()
	if err != nil {
		return fmt.Errorf("--lease-addr: %w", err)
	}
	health, err := c.Health.Dial()
	if err != nil {
		return fmt.Errorf("--health-addr: %w", err)
	}
	cfg := web.Config{SessionKeys: keys, SessionTTL: c.SessionTTL, SecureCookies: secure}
	if c.GatewayMetricsURL != "" {
		cfg.Gateway = &web.GatewayMetrics{URL: c.GatewayMetricsURL, Requests: c.GatewayRequests, Bytes: c.GatewayBytes,
			Client: &http.Client{Timeout: 5 * time.Second}}
	}
	srv, err := web.New(web.NewBackends(orch, lease, health), cfg, s.Log)
	if err != nil {
		return err
	}
	s.HTTP.Handle("/", srv)
	s.Go(func(ctx context.Context) error {
		<-ctx.Done()
		_ = orch.Close()
		_ = lease.Close()
		_ = health.Close()
		return nil
	})
	return nil
}
