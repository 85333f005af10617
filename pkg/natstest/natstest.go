// Package natstest gives each test its own NATS server with JetStream: the
// real nats-server, embedded in the test process, on a random loopback port
// below the ephemeral range (so that a restart gets it back), with its
// store in the test's temporary directory. Streams, consumers and
// subjects of one test can never be seen by another.
package natstest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// Server is one test's NATS server.
type Server struct {
	srv  *server.Server
	opts *server.Options
}

// New starts a server for the test and shuts it down when the test ends.
func New(t testing.TB) *Server {
	t.Helper()
	opts := &server.Options{
		ServerName: "natstest",
		Host:       "127.0.0.1",
		Port:       restartablePort(t),
		JetStream:  true,
		StoreDir:   t.TempDir(),
		NoLog:      true,
		NoSigs:     true,
	}
	s := &Server{opts: opts}
	s.Start(t)
	t.Cleanup(s.Stop)
	return s
}

// restartablePort is a free loopback port below the kernel's ephemeral
// range, which restarts keep. A port of that range, free while the server
// is stopped, can be taken meanwhile as the local port of any outgoing
// connection on the machine, and the restart then cannot listen on it.
func restartablePort(t testing.TB) int {
	t.Helper()
	low := 32768
	if raw, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(raw)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil {
				low = n
			}
		}
	}
	const from = 10000
	if low <= from+1000 {
		t.Fatalf("natstest: the ephemeral port range starts at %d, leaving no port below it", low)
	}
	for range 100 {
		port := from + rand.IntN(low-from)
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		_ = l.Close()
		return port
	}
	t.Fatalf("natstest: no free port between %d and %d", from, low)
	return 0
}

// Start starts the server again after Stop, on the same port with the same
// JetStream store.
func (s *Server) Start(t testing.TB) {
	t.Helper()
	srv, err := server.NewServer(s.opts)
	if err != nil {
		t.Fatalf("natstest: %v", err)
	}
	go srv.Start()
	// Generous: a loaded machine (the whole suite's packages at once) can
	// take seconds to recover a JetStream store on restart.
	if !srv.ReadyForConnections(30 * time.Second) {
		srv.Shutdown()
		t.Fatalf("natstest: server on port %d did not become ready in 30s", s.opts.Port)
	}
	s.srv = srv
}

// Stop shuts the server down, dropping every client connection, as an
// outage would; clients keep trying to reconnect.
func (s *Server) Stop() {
	s.srv.Shutdown()
	s.srv.WaitForShutdown()
}

// Restart stops the server and starts it again: clients reconnect,
// streams and their messages are kept.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.Stop()
	s.Start(t)
}

// URL is the client URL of the server.
func (s *Server) URL() string { return s.srv.ClientURL() }

// Connect returns a client connection closed when the test ends.
func (s *Server) Connect(t testing.TB) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(s.URL(), nats.Name(t.Name()))
	if err != nil {
		t.Fatalf("natstest: connect: %v", err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// JetStream returns a JetStream context on a new connection.
func (s *Server) JetStream(t testing.TB) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(s.Connect(t))
	if err != nil {
		t.Fatalf("natstest: jetstream: %v", err)
	}
	return js
}

// DownURL is the URL of a NATS server that is not running: a loopback port
// a test server listened on and no longer does, for tests of what a client
// does while NATS is down.
func DownURL(t testing.TB) string {
	t.Helper()
	s := New(t)
	url := s.URL()
	s.Stop()
	return url
}

// Cluster is a JetStream cluster of real nats-servers, embedded in the test
// process and routed to each other on loopback.
type Cluster struct {
	Servers []*Server
}

// NewCluster starts size servers clustered together and waits until
// JetStream has elected its meta leader; they shut down when the test ends.
func NewCluster(t testing.TB, size int) *Cluster {
	t.Helper()
	// JetStream clustering needs every server to know its routes when it
	// starts, so the route ports are chosen first.
	routes := make([]*url.URL, size)
	ports := make([]int, size)
	for i := range size {
		ports[i] = restartablePort(t)
		routes[i] = &url.URL{Scheme: "nats", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[i]))}
	}
	c := &Cluster{}
	for i := range size {
		opts := &server.Options{
			ServerName: fmt.Sprintf("natstest-%d", i),
			Host:       "127.0.0.1",
			Port:       restartablePort(t),
			JetStream:  true,
			StoreDir:   t.TempDir(),
			NoLog:      true,
			NoSigs:     true,
			Cluster:    server.ClusterOpts{Name: "natstest", Host: "127.0.0.1", Port: ports[i]},
			Routes:     routes,
		}
		srv, err := server.NewServer(opts)
		if err != nil {
			t.Fatalf("natstest: %v", err)
		}
		// A clustered server is ready only once JetStream has a quorum, so
		// the servers start together and are waited for afterwards.
		go srv.Start()
		s := &Server{srv: srv, opts: opts}
		t.Cleanup(s.Stop)
		c.Servers = append(c.Servers, s)
	}
	for _, s := range c.Servers {
		if !s.srv.ReadyForConnections(30 * time.Second) {
			t.Fatal("natstest: a cluster server did not become ready in 30s")
		}
	}
	nc, err := nats.Connect(c.URL())
	if err != nil {
		t.Fatalf("natstest: connect to the cluster: %v", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("natstest: jetstream: %v", err)
	}
	waittest.ForErr(t, 30*time.Second, "the JetStream cluster to form", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := js.AccountInfo(ctx)
		return err
	})
	return c
}

// URL lists every server of the cluster, as a client's seed list.
func (c *Cluster) URL() string {
	urls := make([]string, len(c.Servers))
	for i, s := range c.Servers {
		urls[i] = s.URL()
	}
	return strings.Join(urls, ",")
}
