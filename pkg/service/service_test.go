package service

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// selfSigned writes a certificate for the name egress.test only — not for
// the loopback address the service is dialled at — and its key.
func selfSigned(t *testing.T) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "egress.test"}, DNSNames: []string{"egress.test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	pool = x509.NewCertPool()
	pool.AddCert(cert)
	return certFile, keyFile, pool
}

type providersOnly struct {
	proxyv1.UnimplementedProxyServiceServer
}

func (providersOnly) ListProviders(context.Context, *proxyv1.ListProvidersRequest) (*proxyv1.ListProvidersResponse, error) {
	return &proxyv1.ListProvidersResponse{Providers: []*proxyv1.Provider{{Name: "local", Type: "local"}}}, nil
}

// With a certificate, gRPC and HTTP (gateway included, which dials the
// service's own TLS port) are served over TLS.
func TestTLS(t *testing.T) {
	t.Parallel()
	certFile, keyFile, pool := selfSigned(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := New(ctx, Options{Name: "tls-test", GRPCListen: "127.0.0.1:0", HTTPListen: "127.0.0.1:0",
		LogLevel: "error", TLSCertFile: certFile, TLSKeyFile: keyFile, ShutdownTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	proxyv1.RegisterProxyServiceServer(s.GRPC, providersOnly{})
	s.MountGateway(proxyv1.RegisterProxyServiceHandler)
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()

	clientTLS := &tls.Config{RootCAs: pool, ServerName: "egress.test"}
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

	https := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: clientTLS}}
	resp, err := https.Get("https://" + s.HTTPAddr() + "/v1/providers")
	if err != nil {
		t.Fatalf("REST over TLS: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"name":"local"`) {
		t.Errorf("gateway over TLS = %d %s", resp.StatusCode, body)
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
	certFile, _, _ := selfSigned(t)
	_, err := New(context.Background(), Options{Name: "x", GRPCListen: "127.0.0.1:0", HTTPListen: "127.0.0.1:0", TLSCertFile: certFile})
	if err == nil || !strings.Contains(err.Error(), "go together") {
		t.Errorf("cert without key: %v", err)
	}
}
