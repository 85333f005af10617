// Package integration tests the Go client (module clients/go) against a
// real lease service: the service's binary as a real process over real
// PostgreSQL and NATS JetStream, real forward proxies (goproxy) and real
// TLS sites. It is a module of its own so that the client module depends on
// nothing but the API stubs and gRPC.
package integration
