// Package grpctest serves a test's gRPC server on a loopback port of its
// own and dials it: the real transport (HTTP/2 over TCP), without TLS.
package grpctest

import (
	"net"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/egress-proxies/egress-proxies/pkg/validate"
)

// Serve serves srv on a free loopback port until the test ends and
// returns its address. Register the services on srv first.
func Serve(tb testing.TB, srv *grpc.Server) string {
	tb.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("grpctest: %v", err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	tb.Cleanup(func() { srv.Stop(); <-done })
	return lis.Addr().String()
}

// Dial returns a client connection to addr without transport security,
// closed when the test ends (before a server Serve started in the same
// test stops).
func Dial(tb testing.TB, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	tb.Helper()
	conn, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	if err != nil {
		tb.Fatalf("grpctest: %v", err)
	}
	tb.Cleanup(func() { _ = conn.Close() })
	return conn
}

// NewServer is a gRPC server as the services build it for their API: the
// contract's request rules enforced (pkg/validate) before any handler, plus
// opts.
func NewServer(tb testing.TB, opts ...grpc.ServerOption) *grpc.Server {
	tb.Helper()
	v, err := validate.New()
	if err != nil {
		tb.Fatalf("grpctest: %v", err)
	}
	return grpc.NewServer(append(v.ServerOptions(), opts...)...)
}
