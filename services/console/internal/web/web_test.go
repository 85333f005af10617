package web

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// gRPC's and the NATS test server's background goroutines outlive
		// a test by design.
		goleak.IgnoreTopFunction("google.golang.org/grpc/internal/grpcsync.(*CallbackSerializer).run"),
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*Server).Start.func1"),
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*Server).startGoRoutine.func1"))
}

// orchestrator is a real orchestrator process, the API every console
// action goes to, and a real lease service beside it (the proxy page
// shows leases and cooldowns), on one PostgreSQL database and NATS.
type orchestrator struct {
	addr   string
	tokens string
	conn   *grpc.ClientConn
	lease  *grpc.ClientConn
}

func startOrchestrator(t *testing.T, extra ...string) *orchestrator {
	t.Helper()
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	o := &orchestrator{tokens: write("tokens", "ops tok-admin admin\nboard tok-viewer viewer\nfleet tok-crawler crawler\nsuite tok-service service\n")}
	dsn := pgtest.NewDatabase(t, pgtest.Template{Name: "console_empty", Fingerprint: "none",
		Migrate: func(context.Context, string) error { return nil }})
	nats := natstest.New(t).URL()
	authFlag := "--auth-token-file=" + o.tokens
	for _, e := range extra {
		if e == "--auth-disabled" {
			authFlag = e
		}
	}
	_, addrs := servicetest.Start(t, "../../../orchestrator", []string{
		"--database-url=" + dsn, "--nats-url=" + nats, authFlag,
		"--providers-config=" + write("providers.yaml", "providers:\n  - name: local\n    type: local\n    local: {stateDir: "+dir+"}\n"),
		"--cloud-init-key-file=" + write("keys.yaml", "active: k\nkeys:\n  k: "+base64.StdEncoding.EncodeToString(key)+"\n"),
	})
	o.addr = addrs.GRPC
	_, lease := servicetest.Start(t, "../../../lease", []string{
		"--database-url=" + dsn, "--nats-url=" + nats, authFlag,
		"--orchestrator-addr=" + o.addr, "--orchestrator-token-file=" + write("service-token", "tok-service\n"),
	})
	var err error
	if o.conn, err = grpc.NewClient(o.addr, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.conn.Close() })
	if o.lease, err = grpc.NewClient(lease.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.lease.Close() })
	return o
}

// console serves the console over o (the health client points at the
// orchestrator: these tests open no page that reads health).
func console(t *testing.T, o *orchestrator, cfg Config) *httptest.Server {
	t.Helper()
	if cfg.SessionKeys == nil {
		cfg.SessionKeys = [][]byte{RandomSessionKey()}
	}
	srv, err := New(NewBackends(o.conn, o.lease, o.conn), cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	t.Cleanup(ts.Close)
	return ts
}

// browser is a cookie-keeping client that does not follow redirects and
// sends what a browser sends on a same-origin request.
type browser struct {
	t    *testing.T
	base string
	c    *http.Client
}

func newBrowser(t *testing.T, base string) *browser {
	jar, _ := cookiejar.New(nil)
	return &browser{t: t, base: base, c: &http.Client{Jar: jar, Timeout: 30 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

func (b *browser) do(method, path string, form url.Values, hdr map[string]string) (*http.Response, string) {
	b.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, b.base+path, body)
	if err != nil {
		b.t.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	req.Header.Set("Sec-Fetch-Site", "same-origin")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := b.c.Do(req)
	if err != nil {
		b.t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp, string(raw)
}

var csrfMeta = regexp.MustCompile(`<meta name="csrf-token" content="([^"]+)">`)

// signIn signs in with token and returns the page's CSRF token.
func (b *browser) signIn(token string) string {
	b.t.Helper()
	resp, body := b.do("POST", "/signin", url.Values{"token": {token}}, nil)
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/" {
		b.t.Fatalf("sign-in with a good token = %d %s %q", resp.StatusCode, resp.Header.Get("Location"), body)
	}
	resp, body = b.do("GET", "/proxies", nil, nil)
	m := csrfMeta.FindStringSubmatch(body)
	if resp.StatusCode != 200 || m == nil {
		b.t.Fatalf("the proxies page after sign-in = %d, CSRF meta %v", resp.StatusCode, m)
	}
	return m[1]
}

// Every response carries the strict CSP with a fresh nonce that the page's
// one script tag uses, and the other security headers.
func TestSecurityHeaders(t *testing.T) {
	ts := console(t, startOrchestrator(t), Config{})
	b := newBrowser(t, ts.URL)
	var nonces []string
	for range 2 {
		resp, body := b.do("GET", "/signin", nil, nil)
		csp := resp.Header.Get("Content-Security-Policy")
		m := regexp.MustCompile(`script-src 'nonce-([A-Za-z0-9_-]+)' 'strict-dynamic'`).FindStringSubmatch(csp)
		if m == nil {
			t.Fatalf("CSP %q has no nonce-based script-src", csp)
		}
		nonces = append(nonces, m[1])
		// default-src 'none' leaves out objects, frames, fonts and the rest.
		for _, d := range []string{"default-src 'none'", "base-uri 'none'", "frame-ancestors 'none'", "form-action 'self'",
			"require-trusted-types-for 'script'", "trusted-types console", "style-src 'self'", "connect-src 'self'"} {
			if !strings.Contains(csp, d) {
				t.Errorf("CSP %q lacks %q", csp, d)
			}
		}
		if strings.Contains(csp, "unsafe-inline") || strings.Contains(csp, "unsafe-eval") {
			t.Errorf("CSP %q allows unsafe code", csp)
		}
		if !strings.Contains(body, `<script src="/static/app.js" nonce="`+m[1]+`"`) {
			t.Errorf("the page's script does not carry the response's nonce")
		}
		if strings.Count(body, "<script") != 1 || regexp.MustCompile(` on[a-z]+=`).MatchString(body) {
			t.Errorf("the page has inline scripts or event handlers")
		}
		for k, want := range map[string]string{"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
			"Referrer-Policy": "no-referrer", "Cross-Origin-Opener-Policy": "same-origin", "Cache-Control": "no-store"} {
			if got := resp.Header.Get(k); got != want {
				t.Errorf("%s = %q, want %q", k, got, want)
			}
		}
	}
	if nonces[0] == nonces[1] {
		t.Error("two responses share a nonce")
	}
	if resp, _ := b.do("GET", "/static/app.js", nil, nil); resp.Header.Get("Content-Security-Policy") == "" || resp.StatusCode != 200 {
		t.Errorf("static script: %d, CSP %q", resp.StatusCode, resp.Header.Get("Content-Security-Policy"))
	}
}

// Sign-in: a bad token and a crawler's are refused saying why; a viewer's
// starts a session in a sealed, httpOnly, SameSite cookie (Secure and
// __Host- when asked), never echoing the token; a page without a session
// sends the browser to the sign-in page.
func TestSignIn(t *testing.T) {
	o := startOrchestrator(t)
	ts := console(t, o, Config{})
	b := newBrowser(t, ts.URL)
	if resp, _ := b.do("GET", "/", nil, nil); resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/signin" {
		t.Errorf("the overview without a session = %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	for _, tc := range []struct {
		token, want string
		status      int
	}{
		{"nope", "Sign-in refused: the orchestrator does not accept this token (invalid bearer token).", 401},
		{"", "Sign-in refused: enter a token (the services require one).", 401},
		{"tok-crawler", "Sign-in refused: the token of client fleet has the role crawler; the console needs viewer or admin.", 403},
	} {
		resp, body := b.do("POST", "/signin", url.Values{"token": {tc.token}}, nil)
		if resp.StatusCode != tc.status || !strings.Contains(body, tc.want) {
			t.Errorf("sign-in with %q = %d, want %d and %q in\n%s", tc.token, resp.StatusCode, tc.status, tc.want, body)
		}
		if len(resp.Cookies()) != 0 {
			t.Errorf("a refused sign-in set a cookie")
		}
		if tc.token != "" && strings.Contains(body, tc.token+`"`) {
			t.Errorf("the refusal echoes the token")
		}
	}
	resp, _ := b.do("POST", "/signin", url.Values{"token": {"tok-viewer"}}, nil)
	cookies := resp.Cookies()
	if len(cookies) != 1 {
		t.Fatalf("cookies %v", cookies)
	}
	c := cookies[0]
	if c.Name != "egress-console" || !c.HttpOnly || c.SameSite != http.SameSiteLaxMode || c.Secure || c.Path != "/" {
		t.Errorf("session cookie %+v", c)
	}
	if strings.Contains(c.Value, "tok-viewer") || strings.Contains(resp.Header.Get("Location"), "tok") {
		t.Error("the token shows in the cookie or the redirect")
	}
	// A cross-site POST never signs anyone in (login CSRF).
	if resp, _ := b.do("POST", "/signin", url.Values{"token": {"tok-admin"}}, map[string]string{"Sec-Fetch-Site": "cross-site"}); resp.StatusCode != http.StatusForbidden {
		t.Errorf("cross-site sign-in = %d, want 403", resp.StatusCode)
	}

	secure := newBrowser(t, console(t, o, Config{SecureCookies: true}).URL)
	resp, _ = secure.do("POST", "/signin", url.Values{"token": {"tok-viewer"}}, nil)
	if c := resp.Cookies(); len(c) != 1 || c[0].Name != "__Host-egress-console" || !c[0].Secure || !c[0].HttpOnly {
		t.Errorf("secure session cookie %+v", c)
	}
	if resp.Header.Get("Strict-Transport-Security") == "" {
		t.Error("no HSTS with secure cookies")
	}
}

// The session cookie opens only under a key of the console's, for its
// lifetime: a forged or expired one is no session, and keys rotate.
func TestSessionCookie(t *testing.T) {
	old, cur := RandomSessionKey(), RandomSessionKey()
	now := time.Unix(1_800_000_000, 0)
	sealOld, _ := newSealer([][]byte{old})
	rotated, _ := newSealer([][]byte{cur, old})
	sess := &session{Token: "tok", ClientID: "ops", Roles: []string{"admin"}, CSRF: "x", Expires: now.Add(time.Hour).Unix()}
	v, err := sealOld.seal("c", sess)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := rotated.open("c", v, now); err != nil || got.Token != "tok" {
		t.Errorf("a cookie under the previous key after rotation: %v, %v", got, err)
	}
	if _, err := rotated.open("other", v, now); err == nil {
		t.Error("a cookie opened under another cookie name")
	}
	if _, err := rotated.open("c", v, now.Add(2*time.Hour)); err == nil || !strings.Contains(err.Error(), "expired") {
		t.Errorf("an expired session: %v", err)
	}
	tampered := []byte(v)
	tampered[len(tampered)/2] ^= 1
	if _, err := rotated.open("c", string(tampered), now); err == nil {
		t.Error("a tampered cookie opened")
	}
	stranger, _ := newSealer([][]byte{RandomSessionKey()})
	if _, err := stranger.open("c", v, now); err == nil {
		t.Error("a cookie opened under a key it was not sealed with")
	}
	if _, err := newSealer([][]byte{[]byte("short")}); err == nil {
		t.Error("a short key was taken")
	}
	dir := t.TempDir()
	good := filepath.Join(dir, "keys")
	_ = os.WriteFile(good, []byte("# current\n"+base64.StdEncoding.EncodeToString(cur)+"\n\n"+base64.StdEncoding.EncodeToString(old)+"\n"), 0o600)
	if keys, err := ReadSessionKeys(good); err != nil || len(keys) != 2 {
		t.Errorf("ReadSessionKeys = %d keys, %v", len(keys), err)
	}
	bad := filepath.Join(dir, "bad")
	_ = os.WriteFile(bad, []byte(base64.StdEncoding.EncodeToString(cur)+"\nnot-a-key-at-all\n"), 0o600)
	if _, err := ReadSessionKeys(bad); err == nil || !strings.Contains(err.Error(), "line 2") || strings.Contains(err.Error(), "not-a-key") {
		t.Errorf("a bad key file: %v (want the line, never the content)", err)
	}
}

// Every action needs the same-origin signal, a session and its CSRF
// token before anything reaches the orchestrator; with them, an admin's
// action is done and a viewer's forced one is refused by the
// orchestrator; a viewer's pages offer no action.
func TestActionsCSRFAndRoles(t *testing.T) {
	o := startOrchestrator(t)
	ts := console(t, o, Config{})
	admin := newBrowser(t, ts.URL)
	adminCSRF := admin.signIn("tok-admin")
	viewer := newBrowser(t, ts.URL)
	viewerCSRF := viewer.signIn("tok-viewer")
	api := proxyv1.NewProxyServiceClient(o.conn)
	exists := func(name string) bool {
		_, err := api.GetProxy(context.Background(), &proxyv1.GetProxyRequest{Name: name}, grpc.PerRPCCredentials(auth.BearerToken("tok-admin")))
		return err == nil
	}
	create := func(b *browser, name, csrf string, hdr map[string]string) (int, map[string]any) {
		form := url.Values{"name": {name}, "provider": {"local"}, "labels": {"team=a"}, "cloud_init": {"#cloud-config\npassword: hunter2\n"}}
		if csrf != "" {
			form.Set("csrf", csrf)
		}
		h := map[string]string{"X-Requested-With": "console"}
		for k, v := range hdr {
			h[k] = v
		}
		resp, body := b.do("POST", "/actions/proxies", form, h)
		var out map[string]any
		_ = json.Unmarshal([]byte(body), &out)
		return resp.StatusCode, out
	}
	for _, tc := range []struct {
		name, csrf string
		hdr        map[string]string
		want       string
	}{
		{"no-csrf", "", nil, "lacks this session's CSRF token"},
		{"wrong-csrf", viewerCSRF, nil, "lacks this session's CSRF token"},
		{"cross-site", adminCSRF, map[string]string{"Sec-Fetch-Site": "cross-site"}, ""},
	} {
		code, out := create(admin, tc.name, tc.csrf, tc.hdr)
		if code != http.StatusForbidden || (tc.want != "" && !strings.Contains(fmt.Sprint(out["error"]), tc.want)) {
			t.Errorf("%s: %d %v, want 403 %q", tc.name, code, out, tc.want)
		}
		if exists(tc.name) {
			t.Errorf("%s: the proxy was created", tc.name)
		}
	}
	if code, out := create(admin, "by-admin", adminCSRF, nil); code != 200 || out["ok"] != true {
		t.Fatalf("the admin's create: %d %v", code, out)
	}
	if !exists("by-admin") {
		t.Fatal("the admin's proxy does not exist")
	}
	// The CSRF token in a header does as well (the console's script).
	resp, body := admin.do("POST", "/actions/proxies/by-admin/drain", url.Values{"timeout": {"5m"}},
		map[string]string{"X-Requested-With": "console", "X-CSRF-Token": adminCSRF})
	if resp.StatusCode != 200 || !strings.Contains(body, "is draining until") {
		t.Errorf("drain: %d %s", resp.StatusCode, body)
	}
	code, out := create(viewer, "by-viewer", viewerCSRF, nil)
	if code != http.StatusForbidden || !strings.Contains(fmt.Sprint(out["error"]), `needs the role admin; client "board" has viewer`) || exists("by-viewer") {
		t.Errorf("a viewer's forced create: %d %v", code, out)
	}
	resp, body = viewer.do("POST", "/actions/proxies/by-admin/delete", url.Values{"csrf": {viewerCSRF}}, map[string]string{"X-Requested-With": "console"})
	if resp.StatusCode != http.StatusForbidden || !exists("by-admin") {
		t.Errorf("a viewer's forced delete: %d %s", resp.StatusCode, body)
	}
	// Rotating credentials: refused to a viewer forcing it by hand; the
	// admin's rotation makes new ones, and no page ever shows them.
	before, err := api.GetProxy(context.Background(), &proxyv1.GetProxyRequest{Name: "by-admin"}, grpc.PerRPCCredentials(auth.BearerToken("tok-admin")))
	if err != nil || before.GetProxy().GetStatus().GetCredentialsTime() == nil {
		t.Fatalf("by-admin has no credentials: %v %v", before, err)
	}
	resp, body = viewer.do("POST", "/actions/proxies/by-admin/rotate-credentials", url.Values{"csrf": {viewerCSRF}}, map[string]string{"X-Requested-With": "console"})
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("a viewer's forced rotation: %d %s", resp.StatusCode, body)
	}
	if _, apage := admin.do("GET", "/proxies/by-admin", nil, nil); !strings.Contains(apage, `id="rotate-credentials"`) {
		t.Error("the admin's proxy page offers no rotation")
	}
	resp, body = admin.do("POST", "/actions/proxies/by-admin/rotate-credentials", url.Values{"csrf": {adminCSRF}}, map[string]string{"X-Requested-With": "console"})
	if resp.StatusCode != 200 || !strings.Contains(body, "has new credentials") {
		t.Errorf("the admin's rotation: %d %s", resp.StatusCode, body)
	}
	creds, err := api.GetProxyCredentials(context.Background(), &proxyv1.GetProxyCredentialsRequest{Uid: before.GetProxy().GetUid()}, grpc.PerRPCCredentials(auth.BearerToken("tok-service")))
	if err != nil || creds.GetCredentials().GetPassword() == "" {
		t.Fatalf("the proxy's credentials: %v %v", creds, err)
	}
	if !creds.GetCredentialsTime().AsTime().After(before.GetProxy().GetStatus().GetCredentialsTime().AsTime()) {
		t.Errorf("credentials made %v, not after the rotation's start (%v)", creds.GetCredentialsTime().AsTime(), before.GetProxy().GetStatus().GetCredentialsTime().AsTime())
	}
	for who, b := range map[string]*browser{"admin": admin, "viewer": viewer} {
		if _, page := b.do("GET", "/proxies/by-admin", nil, nil); strings.Contains(page, creds.GetCredentials().GetPassword()) || !strings.Contains(page, `id="proxy-credentials"`) {
			t.Errorf("the %s's proxy page shows the password, or not when the credentials were made", who)
		}
	}

	// A plain form post (no script) is answered with a redirect, and only
	// ever to a path of the console.
	resp, _ = admin.do("POST", "/actions/proxies/by-admin/drain", url.Values{"csrf": {adminCSRF}, "cancel": {"true"}, "next": {"//evil.example/"}}, nil)
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/" {
		t.Errorf("form post answer %d %s, want 303 to /", resp.StatusCode, resp.Header.Get("Location"))
	}

	// The pages: a viewer sees the proxy but no action and never its
	// cloud-init; an admin sees both.
	_, vpage := viewer.do("GET", "/proxies/by-admin", nil, nil)
	_, apage := admin.do("GET", "/proxies/by-admin", nil, nil)
	if !strings.Contains(vpage, "by-admin") || strings.Contains(vpage, "data-action") || strings.Contains(vpage, "hunter2") || !strings.Contains(vpage, "hidden: admins only") {
		t.Errorf("the viewer's proxy page shows an action or the cloud-init")
	}
	if !strings.Contains(apage, `id="proxy-actions"`) || !strings.Contains(apage, "hunter2") {
		t.Errorf("the admin's proxy page lacks the actions or the cloud-init")
	}
	_, vlist := viewer.do("GET", "/proxies", nil, nil)
	if strings.Contains(vlist, "data-action") || strings.Contains(vlist, "create-proxy") {
		t.Error("the viewer's proxies page offers to create")
	}
}

// A token removed from the services' token file ends the session at the
// next page: the orchestrator no longer takes it.
func TestRevokedToken(t *testing.T) {
	o := startOrchestrator(t)
	ts := console(t, o, Config{})
	b := newBrowser(t, ts.URL)
	b.signIn("tok-viewer")
	if err := os.WriteFile(o.tokens, []byte("ops tok-admin admin\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	waittest.For(t, 10*time.Second, "the revoked token ends the session", func() bool {
		resp, body := b.do("GET", "/", nil, nil)
		return resp.StatusCode == http.StatusUnauthorized && strings.Contains(body, "refused the token") && strings.Contains(body, "Sign in again")
	})
}

// With authentication off on the services (make run), an empty token signs
// in as anonymous with every role, and every page says authentication is
// off.
func TestSignInWithAuthenticationOff(t *testing.T) {
	ts := console(t, startOrchestrator(t, "--auth-disabled"), Config{})
	b := newBrowser(t, ts.URL)
	b.signIn("")
	_, body := b.do("GET", "/proxies", nil, nil)
	if !strings.Contains(body, "Authentication is off on the services") || !strings.Contains(body, `id="create-proxy"`) ||
		!strings.Contains(body, "anonymous") {
		t.Errorf("the proxies page with authentication off lacks the warning, the actions or the anonymous user")
	}
}
