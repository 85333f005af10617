// Package natstest gives each test its own NATS server with JetStream: the
// real nats-server, embedded in the test process, on a random loopback port
// with its store in the test's temporary directory. Streams, consumers and
// subjects of one test can never be seen by another.
package natstest

import (
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Server is one test's NATS server.
type Server struct {
	srv *server.Server
}

// New starts a server for the test and shuts it down when the test ends.
func New(t testing.TB) *Server {
	t.Helper()
	opts := &server.Options{
		ServerName: "natstest",
		Host:       "127.0.0.1",
		Port:       server.RANDOM_PORT,
		JetStream:  true,
		StoreDir:   t.TempDir(),
		NoLog:      true,
		NoSigs:     true,
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("natstest: %v", err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		t.Fatal("natstest: server did not become ready in 10s")
	}
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	return &Server{srv: srv}
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
