package service

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/tlstest"
)

// serverCert writes a certificate for the name egress.test only — not for
// the loopback address the service is dialled at — and its key, issued by
// a CA of the test's own.
func serverCert(t *testing.T) (ca *tlstest.CA, certFile, keyFile string) {
	t.Helper()
	ca = tlstest.NewCA(t, "egress service test CA")
	certFile, keyFile = ca.Issue(t, "egress.test")
	return ca, certFile, keyFile
}

type providersOnly struct {
	proxyv1.UnimplementedProxyServiceServer
}

func (providersOnly) ListProviders(context.Context, *proxyv1.ListProvidersRequest) (*proxyv1.ListProvidersResponse, error) {
	return &proxyv1.ListProvidersResponse{Providers: []*proxyv1.Provider{{Name: "local", Type: "local"}}}, nil
}

// With a certificate, gRPC and HTTP (REST layer included, which dials the
// service's own TLS port) are served over TLS.
func TestTLS(t *testing.T) {
	t.Parallel()
	ca, certFile, keyFile := serverCert(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := New(ctx, Options{Name: "tls-test", GRPCListen: "127.0.0.1:0", HTTPListen: "127.0.0.1:0",
		LogLevel: "error", TLSCertFile: certFile, TLSKeyFile: keyFile, ShutdownTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	proxyv1.RegisterProxyServiceServer(s.GRPC, providersOnly{})
	s.MountREST(proxyv1.RegisterProxyServiceHandler)
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()

	clientTLS := &tls.Config{RootCAs: ca.Pool, ServerName: "egress.test"}
	conn, err := grpc.NewClient(s.GRPCAddr(), grpc.WithTransportCredentials(credentials.NewTLS(clientTLS)))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
	defer ccancel()
	if _, err := healthpb.NewHealthClient(conn).Check(cctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("gRPC over TLS: %v", err)
	}

	// A client that would speak HTTP/2 gets HTTP/1.1: the listener offers
	// no ALPN, and the body limits rely on HTTP/1.x (closeUnread).
	https := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: clientTLS, ForceAttemptHTTP2: true}}
	resp, err := https.Get("https://" + s.HTTPAddr() + "/v1/providers")
	if err != nil {
		t.Fatalf("REST over TLS: %v", err)
	}
	if resp.ProtoMajor != 1 {
		t.Errorf("REST over TLS spoke %s, want HTTP/1.1", resp.Proto)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"name":"local"`) {
		t.Errorf("REST over TLS = %d %s", resp.StatusCode, body)
	}
	if resp, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + s.HTTPAddr() + "/healthz"); err == nil {
		resp.Body.Close()
		if resp.StatusCode == 200 {
			t.Error("plain HTTP was served on the TLS port")
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
}

func TestTLSFlagsGoTogether(t *testing.T) {
	t.Parallel()
	_, certFile, _ := serverCert(t)
	_, err := New(context.Background(), Options{Name: "x", GRPCListen: "127.0.0.1:0", HTTPListen: "127.0.0.1:0", TLSCertFile: certFile})
	if err == nil || !strings.Contains(err.Error(), "go together") {
		t.Errorf("cert without key: %v", err)
	}
}

// The REST layer dials the service's own gRPC port like every client of
// the suite: it verifies the certificate with a CA file and a server name
// (by default the service's own certificate and the first name it
// carries). The certificates here name hosts, never the loopback address
// the REST layer dials; a CA or a name that does not verify stops the
// service at start, saying why.
func TestRESTSelfDialVerifiesTLS(t *testing.T) {
	t.Parallel()
	ca := tlstest.NewCA(t, "egress REST test CA")
	other := tlstest.NewCA(t, "some other CA")
	orchCert, orchKey := ca.Issue(t, "orchestrator.egress.test", "orchestrator")
	ipCert, ipKey := ca.Issue(t, "192.0.2.7")
	cases := []struct {
		name           string
		cert, key      string
		caFile, server string
		refused        string // in Run's error; empty: REST works
	}{
		{name: "defaults: its own certificate and first name", cert: orchCert, key: orchKey},
		{name: "defaults: an IP address the certificate names", cert: ipCert, key: ipKey},
		{name: "the CA and the first name", cert: orchCert, key: orchKey, caFile: ca.File, server: "orchestrator.egress.test"},
		{name: "the CA and another name of the certificate", cert: orchCert, key: orchKey, caFile: ca.File, server: "orchestrator"},
		{name: "the CA alone", cert: orchCert, key: orchKey, caFile: ca.File},
		{name: "a wrong CA", cert: orchCert, key: orchKey, caFile: other.File, server: "orchestrator.egress.test", refused: "certificate signed by unknown authority"},
		{name: "a name the certificate lacks", cert: orchCert, key: orchKey, caFile: ca.File, server: "lease.egress.test", refused: "lease.egress.test"},
		{name: "a name the certificate lacks, own certificate", cert: orchCert, key: orchKey, server: "127.0.0.1", refused: "127.0.0.1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			s, err := New(ctx, Options{Name: "rest-tls-test", GRPCListen: "127.0.0.1:0", HTTPListen: "127.0.0.1:0", LogLevel: "error",
				TLSCertFile: tc.cert, TLSKeyFile: tc.key, RESTCAFile: tc.caFile, RESTServerName: tc.server, ShutdownTimeout: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			proxyv1.RegisterProxyServiceServer(s.GRPC, providersOnly{})
			s.MountREST(proxyv1.RegisterProxyServiceHandler)
			done := make(chan error, 1)
			go func() { done <- s.Run(ctx) }()
			if tc.refused != "" {
				select {
				case err := <-done:
					if err == nil || !strings.Contains(err.Error(), "REST layer") || !strings.Contains(err.Error(), tc.refused) {
						t.Errorf("Run: %v; want a refusal naming the REST layer and %q", err, tc.refused)
					}
				case <-time.After(20 * time.Second):
					t.Fatal("the service serves with a REST layer that cannot verify its gRPC port")
				}
				return
			}
			name := tc.server
			if name == "" {
				name = "orchestrator.egress.test"
				if tc.cert == ipCert {
					name = "192.0.2.7"
				}
			}
			https := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool, ServerName: name}}}
			deadline := time.Now().Add(10 * time.Second)
			for {
				resp, err := https.Get("https://" + s.HTTPAddr() + "/v1/providers")
				if err == nil {
					body, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					if resp.StatusCode == 200 && strings.Contains(string(body), `"name":"local"`) {
						break
					}
					err = fmt.Errorf("%d %s", resp.StatusCode, body)
				}
				if time.Now().After(deadline) {
					t.Fatalf("REST through the REST layer: %v", err)
				}
				time.Sleep(50 * time.Millisecond) // Run marks the REST layer ready after its check
			}
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
}

// The REST layer's TLS flags need TLS, and a CA file that cannot be used
// stops the start.
func TestRESTTLSFlagsNeedTLS(t *testing.T) {
	t.Parallel()
	ca, certFile, keyFile := serverCert(t)
	for name, o := range map[string]Options{
		"CA without TLS":   {RESTCAFile: ca.File},
		"name without TLS": {RESTServerName: "egress.test"},
		"missing CA file":  {TLSCertFile: certFile, TLSKeyFile: keyFile, RESTCAFile: ca.File + ".absent"},
		"CA file not PEM":  {TLSCertFile: certFile, TLSKeyFile: keyFile, RESTCAFile: keyFile},
	} {
		o.Name, o.GRPCListen, o.HTTPListen = "x", "127.0.0.1:0", "127.0.0.1:0"
		if _, err := New(context.Background(), o); err == nil || !strings.Contains(err.Error(), "--rest-") {
			t.Errorf("%s: %v; want an error naming the REST layer flag", name, err)
		}
	}
}
