package service

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
)

// A Client verifies the server's certificate against its CA file and
// server name, and sends the token of its token file, re-read when it is
// rotated.
func TestClientTLSAndTokenFile(t *testing.T) {
	t.Parallel()
	ca, certFile, keyFile := serverCert(t)
	dir := t.TempDir()
	tokens, tokenFile := filepath.Join(dir, "tokens"), filepath.Join(dir, "token")
	write := func(p, content string) {
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(tokens, "svc tok-1 viewer\nsvc2 tok-2 viewer\n")
	write(tokenFile, "tok-1\n")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := New(ctx, Options{Name: "client-test", GRPCListen: "127.0.0.1:0", HTTPListen: "127.0.0.1:0", LogLevel: "error",
		TLSCertFile: certFile, TLSKeyFile: keyFile, ShutdownTimeout: 5 * time.Second, Auth: &auth.Config{TokenFile: tokens}})
	if err != nil {
		t.Fatal(err)
	}
	proxyv1.RegisterProxyServiceServer(s.GRPC, providersOnly{})
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()

	call := func(c Client) error {
		t.Helper()
		conn, err := c.Dial()
		if err != nil {
			return err
		}
		defer conn.Close()
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		defer ccancel()
		_, err = proxyv1.NewProxyServiceClient(conn).ListProviders(cctx, &proxyv1.ListProvidersRequest{})
		return err
	}
	good := Client{Addr: s.GRPCAddr(), CAFile: ca.File, ServerName: "egress.test", TokenFile: tokenFile}
	if err := call(good); err != nil {
		t.Fatalf("TLS with the CA, the server name and the token: %v", err)
	}
	cases := map[string]struct {
		c    Client
		want codes.Code
	}{
		"plaintext to a TLS port": {Client{Addr: s.GRPCAddr(), TokenFile: tokenFile}, codes.Unavailable},
		"another server name":     {Client{Addr: s.GRPCAddr(), CAFile: ca.File, ServerName: "other.test", TokenFile: tokenFile}, codes.Unavailable},
		"the address as the name": {Client{Addr: s.GRPCAddr(), CAFile: ca.File, TokenFile: tokenFile}, codes.Unavailable},
		"system roots only":       {Client{Addr: s.GRPCAddr(), TLS: true, ServerName: "egress.test", TokenFile: tokenFile}, codes.Unavailable},
		"no token":                {Client{Addr: s.GRPCAddr(), CAFile: ca.File, ServerName: "egress.test"}, codes.Unauthenticated},
		"a token given directly":  {Client{Addr: s.GRPCAddr(), CAFile: ca.File, ServerName: "egress.test", Token: "tok-2"}, codes.OK},
		"a token file wins":       {Client{Addr: s.GRPCAddr(), CAFile: ca.File, ServerName: "egress.test", TokenFile: tokenFile, Token: "nope"}, codes.OK},
	}
	for name, tc := range cases {
		if err := call(tc.c); status.Code(err) != tc.want {
			t.Errorf("%s: %v, want %v", name, err, tc.want)
		}
	}
	// Rotation: the next call sends the new token.
	write(tokens, "svc2 tok-2 viewer\n")
	write(tokenFile, "tok-2\n")
	deadline := time.Now().Add(10 * time.Second)
	for err := call(good); err != nil; err = call(good) {
		if time.Now().After(deadline) {
			t.Fatalf("after rotating both files: %v", err)
		}
		time.Sleep(100 * time.Millisecond) // the server re-reads its token file at most once a second
	}
	// Files that cannot be used fail at once, naming the file, never a token.
	for name, c := range map[string]Client{
		"missing CA":         {Addr: s.GRPCAddr(), CAFile: filepath.Join(dir, "absent")},
		"CA without PEM":     {Addr: s.GRPCAddr(), CAFile: tokens},
		"missing token file": {Addr: s.GRPCAddr(), TokenFile: filepath.Join(dir, "absent")},
		"two tokens":         {Addr: s.GRPCAddr(), TokenFile: tokens},
	} {
		if _, err := c.DialOptions(); err == nil {
			t.Errorf("%s: no error", name)
		} else if strings.Contains(err.Error(), "tok-") {
			t.Errorf("%s: the error shows a token: %v", name, err)
		}
	}
}

// The token file is read once and kept: an unchanged file is not re-read
// (a token written into the kept one shows it), a replaced or rewritten
// one is at the next call, and a missing one fails naming the file.
func TestFileTokenKeptAndReloadedOnChange(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "token")
	write := func(name, content string) {
		t.Helper()
		tmp := filepath.Join(dir, name)
		if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		// As a Secret is rotated: a new file put in place.
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	want := func(f *fileToken, tok string) {
		t.Helper()
		got, err := f.token()
		if err != nil || got != tok {
			t.Fatalf("token() = %q, %v; want %q", got, err, tok)
		}
	}
	write("a", "tok-1\n")
	f := &fileToken{path: path}
	want(f, "tok-1")
	// Unchanged, the file is not read again: the kept token is sent.
	f.mu.Lock()
	f.tok = "tok-kept"
	f.mu.Unlock()
	want(f, "tok-kept")

	// Replaced: the next call reads it.
	write("b", "tok-2\n")
	want(f, "tok-2")
	// Rewritten in place (same file, another size).
	if err := os.WriteFile(path, []byte("tok-three\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	want(f, "tok-three")

	// Missing, or holding two tokens: refused, naming the file and no
	// token.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if _, err := f.token(); err == nil || !strings.Contains(err.Error(), "token file") || strings.Contains(err.Error(), "tok-") {
		t.Fatalf("missing file: %v", err)
	}
	write("d", "tok-5 tok-6\n")
	if _, err := f.token(); err == nil || strings.Contains(err.Error(), "tok-") {
		t.Fatalf("two tokens: %v", err)
	}
}
