// Package tlstest issues certificates for tests that run real TLS: a CA
// of the test's own and server certificates it signs, written as PEM files
// the services read with --tls-cert-file, --tls-key-file and --*-ca-file.
package tlstest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// CA is a certificate authority made for one test.
type CA struct {
	// File is the CA certificate as a PEM file.
	File string
	// Pool holds the CA certificate.
	Pool *x509.CertPool

	cert   *x509.Certificate
	key    *ecdsa.PrivateKey
	dir    string
	serial atomic.Int64
}

// NewCA makes a CA named name and writes its certificate into a temporary
// directory of t.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	ca := &CA{Pool: x509.NewCertPool(), cert: cert, key: key, dir: t.TempDir()}
	ca.Pool.AddCert(cert)
	ca.serial.Store(1)
	ca.File = write(t, ca.dir, "ca.crt", &pem.Block{Type: "CERTIFICATE", Bytes: der})
	return ca
}

// Issue writes a server certificate for names (DNS names, or IP
// addresses) signed by the CA, and its key; it returns their files.
func (ca *CA) Issue(t testing.TB, names ...string) (certFile, keyFile string) {
	t.Helper()
	serial := ca.serial.Add(1)
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: names[0]},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, n := range names {
		if ip := net.ParseIP(n); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, n)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	base := names[0] + "-" + big.NewInt(serial).String()
	return write(t, ca.dir, base+".crt", &pem.Block{Type: "CERTIFICATE", Bytes: der}),
		write(t, ca.dir, base+".key", &pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func write(t testing.TB, dir, name string, block *pem.Block) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, pem.EncodeToMemory(block), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
