package integration

import (
	"crypto/x509"
	"errors"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/clients/go/egress"
	"github.com/egress-proxies/egress-proxies/pkg/tlstest"
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
	ca := tlstest.NewCA(t, "egress test CA")
	cert, key := ca.Issue(t, tlsServerName, "127.0.0.1")
	return &tlsFiles{caFile: ca.File, certFile: cert, keyFile: key, pool: ca.Pool}
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
