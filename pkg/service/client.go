package service

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/telemetry"
)

// Client is how one gRPC API of the suite is reached: every client (the
// services' clients of each other, egressctl, tests) is built from one,
// so TLS and credentials work the same everywhere.
type Client struct {
	// Addr is host:port.
	Addr string
	// CAFile holds the PEM CAs that verify the server; setting it turns
	// TLS on.
	CAFile string
	// TLS turns TLS on with the system's roots when CAFile is empty.
	TLS bool
	// ServerName is the name the server's certificate must carry; empty:
	// the host of Addr.
	ServerName string
	// TokenFile holds the bearer token sent on every call (the whole file,
	// trimmed). It is re-read when it changes, so rotating it needs no
	// restart.
	TokenFile string
	// Token is a bearer token given directly (egressctl --token). Ignored
	// when TokenFile is set.
	Token string
}

// RegisterFlags adds --<prefix>-ca-file, --<prefix>-server-name and
// --<prefix>-token-file for reaching what (e.g. "the orchestrator").
func (c *Client) RegisterFlags(fs *flag.FlagSet, prefix, what string) {
	fs.StringVar(&c.CAFile, prefix+"-ca-file", c.CAFile, "PEM CA file that verifies "+what+"'s TLS certificate; setting it dials "+what+" over TLS")
	fs.StringVar(&c.ServerName, prefix+"-server-name", c.ServerName, "name "+what+"'s TLS certificate must carry (default: the host of its address)")
	fs.StringVar(&c.TokenFile, prefix+"-token-file", c.TokenFile, "file holding the bearer token sent to "+what+" (a token with the service role); re-read when it changes")
}

// TLSEnabled reports whether the client dials over TLS.
func (c *Client) TLSEnabled() bool { return c.TLS || c.CAFile != "" }

// TLSConfig is the client's TLS configuration: nil when it dials in
// plaintext. The CA file is read now.
func (c *Client) TLSConfig() (*tls.Config, error) {
	if !c.TLSEnabled() {
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: c.ServerName}
	if c.CAFile != "" {
		roots, err := readCAFile(c.CAFile)
		if err != nil {
			return nil, err
		}
		cfg.RootCAs = roots
	}
	return cfg, nil
}

func readCAFile(path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("CA file: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("CA file %s: no PEM certificates", path)
	}
	return roots, nil
}

// DialOptions are the gRPC options of the client: transport credentials,
// the bearer token and tracing. Files are read now, so a missing CA or
// token file fails at start rather than at the first call.
func (c *Client) DialOptions() ([]grpc.DialOption, error) {
	cfg, err := c.TLSConfig()
	if err != nil {
		return nil, err
	}
	transport := insecure.NewCredentials()
	if cfg != nil {
		transport = credentials.NewTLS(cfg)
	}
	opts := append(telemetry.DialOptions(), grpc.WithTransportCredentials(transport))
	switch {
	case c.TokenFile != "":
		tok := &fileToken{path: c.TokenFile}
		if _, err := tok.token(); err != nil {
			return nil, err
		}
		opts = append(opts, grpc.WithPerRPCCredentials(tok))
	case c.Token != "":
		opts = append(opts, grpc.WithPerRPCCredentials(auth.BearerToken(c.Token)))
	}
	return opts, nil
}

// Dial returns a connection to the API (connecting lazily, as
// grpc.NewClient does), with extra options after the client's own.
func (c *Client) Dial(extra ...grpc.DialOption) (*grpc.ClientConn, error) {
	if c.Addr == "" {
		return nil, errors.New("no address")
	}
	opts, err := c.DialOptions()
	if err != nil {
		return nil, err
	}
	return grpc.NewClient(c.Addr, append(opts, extra...)...)
}

// fileToken sends the bearer token held in a file, so a rotated Secret
// takes effect at the next call without a restart. The token is kept in
// memory; each call only looks at the file (a stat) and re-reads it when
// its identity (a Secret's symlink swap gives a new file), size or
// modification time changed, so callers that call per crawler request
// (the gateway) read no file per call. The token never appears in errors
// or logs.
type fileToken struct {
	path string

	mu   sync.Mutex
	tok  string
	stat os.FileInfo
}

func (f *fileToken) token() (string, error) {
	st, err := os.Stat(f.path)
	if err != nil {
		return "", fmt.Errorf("token file: %w", err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.tok != "" && os.SameFile(st, f.stat) && st.Size() == f.stat.Size() && st.ModTime().Equal(f.stat.ModTime()) {
		return f.tok, nil
	}
	b, err := os.ReadFile(f.path)
	if err != nil {
		return "", fmt.Errorf("token file: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" || strings.ContainsAny(tok, " \t\r\n") {
		return "", fmt.Errorf("token file %s: want exactly one token", f.path)
	}
	f.tok, f.stat = tok, st
	return tok, nil
}

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (f *fileToken) GetRequestMetadata(ctx context.Context, uri ...string) (map[string]string, error) {
	tok, err := f.token()
	if err != nil {
		return nil, err
	}
	return auth.BearerToken(tok).GetRequestMetadata(ctx, uri...)
}

// RequireTransportSecurity implements credentials.PerRPCCredentials: the
// suite's loopback and in-cluster connections may be plaintext.
func (f *fileToken) RequireTransportSecurity() bool { return false }
