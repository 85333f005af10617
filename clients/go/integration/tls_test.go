package integration

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/clients/go/egress"
)

// tlsServerName is the DNS name in the lease service's test certificate.
const tlsServerName = "lease.egress.test"

// tlsFiles are a CA and a server certificate it signed for tlsServerName
// and 127.0.0.1, written as PEM files.
type tlsFiles struct {
	caFile, certFile, keyFile string
	pool                      *x509.CertPool
}

func makeTLS(t *testing.T) *tlsFiles {
	t.Helper()
	dir := t.TempDir()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "egress test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: tlsServerName},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		DNSNames: []string{tlsServerName}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	f := &tlsFiles{caFile: filepath.Join(dir, "ca.pem"), certFile: filepath.Join(dir, "tls.crt"), keyFile: filepath.Join(dir, "tls.key"), pool: x509.NewCertPool()}
	f.pool.AddCert(ca)
	for path, block := range map[string]*pem.Block{
		f.caFile:   {Type: "CERTIFICATE", Bytes: caDER},
		f.certFile: {Type: "CERTIFICATE", Bytes: der},
		f.keyFile:  {Type: "EC PRIVATE KEY", Bytes: keyDER},
	} {
		if err := os.WriteFile(path, pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

// Against a lease service serving TLS, the clients verify it with a CA file
// and a server name, and refuse it when they cannot: the Go client at once
// (a verification failure is not retried), the Python client likewise.
func TestTLS(t *testing.T) {
	t.Parallel()
	tf := makeTLS(t)
	s := newSuiteTLS(t, 1, tf)
	_, port, _ := net.SplitHostPort(s.lease.GRPC)
	cases := []struct {
		name    string
		addr    string
		o       egress.Options
		wantErr string
	}{
		{name: "CA file and server name", addr: "127.0.0.1:" + port, o: egress.Options{CAFile: tf.caFile, ServerName: tlsServerName}},
		{name: "CA file, address in the certificate", addr: "127.0.0.1:" + port, o: egress.Options{CAFile: tf.caFile}},
		{name: "system roots", addr: "127.0.0.1:" + port, o: egress.Options{}, wantErr: "certificate"},
		{name: "wrong server name", addr: "127.0.0.1:" + port, o: egress.Options{CAFile: tf.caFile, ServerName: "other.test"}, wantErr: "certificate"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.o.Token = token
			c, err := egress.New(tc.addr, tc.o)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			start := time.Now()
			l, err := c.Acquire(ctx(t), "example.com", egress.Selector{}, 5*time.Second)
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("acquire over TLS: %v", err)
				}
				if err := l.Release(); err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) || errors.Is(err, egress.ErrNoProxyAvailable) {
				t.Fatalf("acquire = %v, want a %s error", err, tc.wantErr)
			}
			if strings.Contains(err.Error(), token) {
				t.Errorf("the error carries the token: %v", err)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("a verification failure was retried for %v", d)
			}
		})
	}

	t.Run("python client", func(t *testing.T) {
		python, err := exec.LookPath("/usr/bin/python3")
		if err != nil {
			t.Fatalf("no /usr/bin/python3 (scripts/ensure-deps.sh installs it): %v", err)
		}
		_, httpPort, _ := net.SplitHostPort(s.lease.HTTP)
		script := `
import sys
from egress_proxies import LeaseClient, LeaseError
url, ca, token = sys.argv[1:4]
with LeaseClient(url, token, ca_file=ca) as c, c.acquire("example.com", ttl=5, max_wait=10) as lease:
    print("leased", lease.proxy_name)
try:
    LeaseClient(url, token).list_proxies()
    print("system roots accepted the test CA")
except LeaseError as e:
    print("refused:", e)
`
		cmd := exec.CommandContext(ctx(t), python, "-c", script, "https://127.0.0.1:"+httpPort, tf.caFile, token)
		cmd.Env = append(os.Environ(), "PYTHONPATH=../../python", "PYTHONDONTWRITEBYTECODE=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("python: %v\n%s", err, out)
		}
		if !strings.Contains(string(out), "leased proxy-0") || !strings.Contains(string(out), "refused:") || !strings.Contains(string(out), "CERTIFICATE_VERIFY_FAILED") {
			t.Fatalf("python client over TLS:\n%s", out)
		}
	})
}
