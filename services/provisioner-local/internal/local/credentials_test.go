package local

import (
	"context"
	"crypto/tls"
	"encoding/base64"
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

func TestUpdateCredentialsInPlace(t *testing.T) {
	t.Parallel()
	target := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("hello through the proxy"))
	}))
	t.Cleanup(target.Close)
	ctx := context.Background()
	b := newBackend(t, "squid", t.TempDir())
	cleanup(t, b)
	uid := uuid.NewString()
	old := &proxyv1.ProxyCredentials{Username: "egress-0123456789ab", Password: "pw-old_secret1"}
	inst, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{Provider: "local", ProxyUid: uid, ProxyName: "p1", Port: 3128, Credentials: old})
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort(inst.GetIp(), "3128")
	oldUser := url.UserPassword(old.GetUsername(), old.GetPassword())
	if got := statusThrough(t, addr, oldUser, target); got != http.StatusOK {
		t.Fatalf("before the update, the old credentials: status %d", got)
	}
	// A tunnel opened with the old credentials, alive across the update.
	tunnel, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer tunnel.Close()
	host := strings.TrimPrefix(target.URL, "https://")
	req := &http.Request{Method: http.MethodConnect, URL: &url.URL{Opaque: host}, Host: host, Header: http.Header{}}
	req.Header.Set("Proxy-Authorization", "Basic "+basic(old.GetUsername(), old.GetPassword()))
	if err := req.Write(tunnel); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	if n, err := tunnel.Read(buf); err != nil || !strings.Contains(string(buf[:n]), " 200 ") {
		t.Fatalf("CONNECT with the old credentials: %q, %v", buf[:n], err)
	}

	updated := &proxyv1.ProxyCredentials{Username: "egress-ba9876543210", Password: "pw-new_secret2"}
	got, err := b.UpdateCredentials(ctx, &provisionerv1.UpdateCredentialsRequest{Provider: "local", ProviderId: inst.GetProviderId(), ProxyUid: uid, Credentials: updated})
	if err != nil {
		t.Fatal(err)
	}
	if got.GetProviderId() != inst.GetProviderId() || got.GetIp() != inst.GetIp() || got.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_RUNNING {
		t.Errorf("after the update: %v, want the same running instance %v", got, inst)
	}
	if got := statusThrough(t, addr, oldUser, target); got != http.StatusProxyAuthRequired {
		t.Errorf("the old credentials right after the update: status %d, want 407", got)
	}
	if got := statusThrough(t, addr, url.UserPassword(updated.GetUsername(), updated.GetPassword()), target); got != http.StatusOK {
		t.Errorf("the new credentials: status %d, want 200", got)
	}
	_ = tunnel.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := tunnel.Read(buf); err == nil {
		t.Error("the tunnel opened with the old credentials is still open after the update")
	}

	_, err = b.UpdateCredentials(ctx, &provisionerv1.UpdateCredentialsRequest{Provider: "local", ProviderId: "instances/" + uuid.NewString(), Credentials: updated})
	if !errclass.Is(err, errclass.NotFound) {
		t.Errorf("updating an instance that does not exist: %v, want NotFound", err)
	}
}

func basic(user, password string) string {
	return base64.StdEncoding.EncodeToString([]byte(user + ":" + password))
}
