package local

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// statusThrough fetches target through the proxy at addr with user (nil:
// no credentials) and returns the HTTP status of the proxy's answer, or
// 200 when the page came through.
func statusThrough(t *testing.T, addr string, user *url.Userinfo, target *httptest.Server) int {
	t.Helper()
	pool := target.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs
	var proxyStatus int
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		Proxy:           http.ProxyURL(&url.URL{Scheme: "http", Host: addr, User: user}),
		TLSClientConfig: &tls.Config{RootCAs: pool},
		OnProxyConnectResponse: func(_ context.Context, _ *url.URL, _ *http.Request, resp *http.Response) error {
			proxyStatus = resp.StatusCode
			return nil
		},
	}}
	resp, err := client.Get(target.URL)
	if err != nil {
		if proxyStatus != 0 {
			return proxyStatus
		}
		t.Fatalf("fetch through %s: %v", addr, err)
	}
	defer resp.Body.Close()
	_, _ = io.ReadAll(resp.Body)
	return resp.StatusCode
}

func TestSquidDemandsTheCredentials(t *testing.T) {
	t.Parallel()
	target := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("hello through the proxy"))
	}))
	t.Cleanup(target.Close)
	ctx := context.Background()
	dir := t.TempDir()
	b := newBackend(t, "squid", dir)
	cleanup(t, b)
	uid := uuid.NewString()
	creds := &proxyv1.ProxyCredentials{Username: "egress-0123456789ab", Password: "pw-Zq81x_secret"}
	inst, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{Provider: "local", ProxyUid: uid, ProxyName: "p1", Port: 3128, Credentials: creds})
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort(inst.GetIp(), "3128")
	cases := []struct {
		name string
		user *url.Userinfo
		want int
	}{
		{"no credentials", nil, http.StatusProxyAuthRequired},
		{"wrong password", url.UserPassword(creds.GetUsername(), "not-it"), http.StatusProxyAuthRequired},
		{"the proxy's credentials", url.UserPassword(creds.GetUsername(), creds.GetPassword()), http.StatusOK},
	}
	for _, tc := range cases {
		if got := statusThrough(t, addr, tc.user, target); got != tc.want {
			t.Errorf("%s: status %d, want %d", tc.name, got, tc.want)
		}
	}
	// The instance's files hold a hash, never the password.
	filepath.WalkDir(filepath.Join(dir, uid), func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		raw, _ := os.ReadFile(p)
		if strings.Contains(string(raw), creds.GetPassword()) {
			t.Errorf("%s holds the password", p)
		}
		return nil
	})
}

func TestBuiltinProxyRefusesCredentials(t *testing.T) {
	t.Parallel()
	b := newBackend(t, "builtin", t.TempDir())
	cleanup(t, b)
	_, err := b.Create(context.Background(), &provisionerv1.CreateInstanceRequest{Provider: "local", ProxyUid: uuid.NewString(), ProxyName: "p1", Port: 3128,
		Credentials: &proxyv1.ProxyCredentials{Username: "u", Password: "secret-xyz"}})
	if !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), "cannot demand them") || strings.Contains(err.Error(), "secret-xyz") {
		t.Errorf("builtin proxy with credentials: %v, want Permanent without the secret", err)
	}
}
