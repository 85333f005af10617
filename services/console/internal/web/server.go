// Package web is the operators' console: server-rendered pages (Go
// templates embedded in the binary), a little JavaScript for what changes
// live (server-sent events fed by the services' watch streams) and for the
// proxies table, and the actions, each a POST that the console forwards to
// the service that owns it with the signed-in user's token.
package web

import (
	"context"
	"crypto/rand"
	"embed"
	"encoding/base64"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"time"

	identityv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/identity/v1"
)

//go:embed templates/*.html
var templateFiles embed.FS

//go:embed static
var staticFiles embed.FS

// Config are the console's settings.
type Config struct {
	// SessionKeys seal the session cookie: the first seals, every one
	// opens.
	SessionKeys [][]byte
	// SessionTTL is how long a sign-in lasts.
	SessionTTL time.Duration
	// SecureCookies marks the session cookie Secure (the console is
	// reached over TLS, directly or through an Ingress).
	SecureCookies bool
	// Gateway, when set, is where the overview reads the gateway's
	// request and byte counters.
	Gateway *GatewayMetrics
	// Now is the clock; time.Now when nil.
	Now func() time.Time
}

// Server serves the console.
type Server struct {
	api     *Backends
	cfg     Config
	cookies *cookies
	log     *slog.Logger
	pages   map[string]*template.Template
	mux     *http.ServeMux
	origin  *http.CrossOriginProtection
}

// New returns the console over the services' APIs.
func New(api *Backends, cfg Config, log *slog.Logger) (*Server, error) {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.SessionTTL <= 0 {
		cfg.SessionTTL = 12 * time.Hour
	}
	seal, err := newSealer(cfg.SessionKeys)
	if err != nil {
		return nil, err
	}
	s := &Server{api: api, cfg: cfg, log: log, mux: http.NewServeMux(), origin: http.NewCrossOriginProtection(),
		cookies: &cookies{sealer: seal, secure: cfg.SecureCookies, ttl: cfg.SessionTTL}}
	if s.pages, err = parsePages(); err != nil {
		return nil, err
	}
	s.routes()
	return s, nil
}

func parsePages() (map[string]*template.Template, error) {
	out := map[string]*template.Template{}
	names, err := fs.Glob(templateFiles, "templates/*.html")
	if err != nil {
		return nil, err
	}
	for _, n := range names {
		base := strings.TrimSuffix(strings.TrimPrefix(n, "templates/"), ".html")
		if base == "layout" || base == "fragments" {
			continue
		}
		t, err := template.New(base).Funcs(funcs).ParseFS(templateFiles, "templates/layout.html", "templates/fragments.html", n)
		if err != nil {
			return nil, err
		}
		out[base] = t
	}
	frags, err := template.New("fragments").Funcs(funcs).ParseFS(templateFiles, "templates/fragments.html")
	if err != nil {
		return nil, err
	}
	out["layout-fragments"] = frags
	return out, nil
}

// ServeHTTP serves every console request with its security headers.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Cross-Origin-Opener-Policy", "same-origin")
	h.Set("Cross-Origin-Resource-Policy", "same-origin")
	h.Set("Permissions-Policy", "camera=(), microphone=(), geolocation=()")
	if s.cfg.SecureCookies {
		h.Set("Strict-Transport-Security", "max-age=31536000")
	}
	// A new nonce per response: the only scripts that run are the ones
	// this response names, and every DOM sink needs the console's trusted
	// types policy.
	nonce := newNonce()
	h.Set("Content-Security-Policy", csp(nonce))
	s.mux.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), nonceKey{}, nonce)))
}

// csp is the Content-Security-Policy of every response.
func csp(nonce string) string {
	return strings.Join([]string{
		"default-src 'none'",
		"script-src 'nonce-" + nonce + "' 'strict-dynamic'",
		"style-src 'self'",
		"img-src 'self'",
		"connect-src 'self'",
		"form-action 'self'",
		"frame-ancestors 'none'",
		"base-uri 'none'",
		"require-trusted-types-for 'script'",
		"trusted-types console",
	}, "; ")
}

type nonceKey struct{}

func newNonce() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)
}

func nonceOf(r *http.Request) string {
	n, _ := r.Context().Value(nonceKey{}).(string)
	return n
}

func (s *Server) routes() {
	static, _ := fs.Sub(staticFiles, "static")
	files := http.StripPrefix("/static/", http.FileServerFS(static))
	s.mux.Handle("GET /static/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "no-cache")
		files.ServeHTTP(w, r)
	}))
	s.mux.HandleFunc("GET /signin", s.signInPage)
	s.mux.Handle("POST /signin", s.origin.Handler(http.HandlerFunc(s.signIn)))
	s.mux.Handle("POST /signout", s.action(s.signOut))

	s.mux.HandleFunc("GET /{$}", s.page("overview", s.overview))
	s.mux.HandleFunc("GET /proxies", s.page("proxies", s.proxies))
	s.mux.HandleFunc("GET /proxies/{name}", s.page("proxy", s.proxy))
	s.mux.HandleFunc("GET /pools", s.page("pools", s.pools))
	s.mux.HandleFunc("GET /pools/{name}", s.page("pool", s.pool))
	s.mux.HandleFunc("GET /leases", s.page("leases", s.leases))
	s.mux.HandleFunc("GET /providers", s.page("providers", s.providers))

	s.mux.HandleFunc("GET /events/proxies", s.signedIn(s.proxyEvents))
	s.mux.HandleFunc("GET /events/view", s.signedIn(s.viewEvents))

	s.mux.Handle("POST /actions/proxies", s.action(s.createProxy))
	s.mux.Handle("POST /actions/proxies/{name}/delete", s.action(s.deleteProxy))
	s.mux.Handle("POST /actions/proxies/{name}/drain", s.action(s.drainProxy))
	s.mux.Handle("POST /actions/proxies/{name}/rotate-credentials", s.action(s.rotateCredentials))
	s.mux.Handle("POST /actions/pools", s.action(s.createPool))
	s.mux.Handle("POST /actions/pools/{name}/scale", s.action(s.scalePool))
	s.mux.Handle("POST /actions/pools/{name}/delete", s.action(s.deletePool))
}

// view is what every page template gets.
type view struct {
	Title    string
	Page     string
	Nonce    string
	CSRF     string
	ClientID string
	Roles    string
	Admin    bool
	AuthOff  bool
	Gateway  bool
	Error    string
	Data     any
}

func (s *Server) render(w http.ResponseWriter, r *http.Request, status int, page string, v view) {
	v.Page, v.Nonce = page, nonceOf(r)
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	if err := s.pages[page].ExecuteTemplate(w, "layout", v); err != nil {
		s.log.Error("rendering a page failed", "page", page, "error", err)
	}
}

// page serves a page to a signed-in user: the session is read, the token
// checked again with the orchestrator (a revoked token or a changed role
// shows at once), and the handler fills the page's data.
func (s *Server) page(name string, fill func(context.Context, *http.Request, *session) (string, any, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		sess, err := s.cookies.get(r, s.cfg.Now())
		if err != nil {
			http.Redirect(w, r, "/signin", http.StatusSeeOther)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), 15*time.Second)
		defer cancel()
		id, err := s.api.Identity.GetIdentity(ctx, &identityv1.GetIdentityRequest{}, as(sess))
		if e := fromAPI("the orchestrator", err); e != nil {
			if e.Code == 16 { // UNAUTHENTICATED: the token was revoked
				s.cookies.clear(w)
				s.render(w, r, http.StatusUnauthorized, "signin", view{Title: "Sign in", Error: e.Message + ". Sign in again."})
				return
			}
			s.render(w, r, e.Status, "error", s.viewFor(sess, nil, "Error", e.Message))
			return
		}
		title, data, err := fill(ctx, r, sess)
		v := s.viewFor(sess, id, title, "")
		v.Data = data
		if err != nil {
			e, ok := err.(*apiError)
			if !ok {
				e = &apiError{Status: http.StatusInternalServerError, Message: err.Error()}
			}
			v.Error, v.Title = e.Message, "Error"
			s.render(w, r, e.Status, "error", v)
			return
		}
		s.render(w, r, http.StatusOK, name, v)
	}
}

func (s *Server) viewFor(sess *session, id *identityv1.GetIdentityResponse, title, errMsg string) view {
	v := view{Title: title, CSRF: sess.CSRF, ClientID: sess.ClientID, Error: errMsg, Gateway: s.cfg.Gateway != nil}
	roles := sess.Roles
	if id != nil {
		roles = id.GetRoles()
		v.AuthOff = id.GetAuthenticationDisabled()
	}
	v.Roles = strings.Join(roles, ", ")
	v.Admin = slices.Contains(roles, "admin")
	return v
}

// signedIn serves a non-page request (the event streams) to a signed-in
// user.
func (s *Server) signedIn(h func(http.ResponseWriter, *http.Request, *session)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		sess, err := s.cookies.get(r, s.cfg.Now())
		if err != nil {
			http.Error(w, "sign in first", http.StatusUnauthorized)
			return
		}
		h(w, r, sess)
	}
}

func (s *Server) signInPage(w http.ResponseWriter, r *http.Request) {
	if _, err := s.cookies.get(r, s.cfg.Now()); err == nil {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	s.render(w, r, http.StatusOK, "signin", view{Title: "Sign in"})
}

// maxFormBytes bounds every form the console reads (a proxy with 64 KiB
// of cloud-init and its fields fits).
const maxFormBytes = 128 << 10

// signIn checks the token with the orchestrator and, for a viewer or an
// admin, starts a session. The token arrives in the POST body only.
func (s *Server) signIn(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	if err := r.ParseForm(); err != nil {
		s.render(w, r, http.StatusBadRequest, "signin", view{Title: "Sign in", Error: "The form could not be read."})
		return
	}
	token := strings.TrimSpace(r.PostForm.Get("token"))
	ctx, cancel := context.WithTimeout(r.Context(), 15*time.Second)
	defer cancel()
	sess := &session{Token: token}
	if token == "" {
		// With authentication off the services take any caller; the
		// orchestrator says so, and then no token is needed.
		sess.Token = "none"
	}
	id, err := s.api.Identity.GetIdentity(ctx, &identityv1.GetIdentityRequest{}, as(sess))
	if e := fromAPI("The orchestrator", err); e != nil {
		msg := e.Message
		if e.Code == 16 {
			msg = "Sign-in refused: the orchestrator does not accept this token (" + strings.TrimPrefix(e.Message, "The orchestrator refused the token: ") + ")."
			if token == "" {
				msg = "Sign-in refused: enter a token (the services require one)."
			}
		}
		s.log.Info("sign-in refused", "reason", e.Code.String())
		s.render(w, r, e.Status, "signin", view{Title: "Sign in", Error: msg})
		return
	}
	roles := id.GetRoles()
	if !slices.Contains(roles, "admin") && !slices.Contains(roles, "viewer") {
		s.log.Info("sign-in refused", "client_id", id.GetClientId(), "reason", "role")
		s.render(w, r, http.StatusForbidden, "signin", view{Title: "Sign in",
			Error: "Sign-in refused: the token of client " + id.GetClientId() + " has the role " + strings.Join(roles, ", ") + "; the console needs viewer or admin."})
		return
	}
	sess.ClientID, sess.Roles, sess.CSRF = id.GetClientId(), roles, newCSRFSecret()
	sess.Expires = s.cfg.Now().Add(s.cfg.SessionTTL).Unix()
	if err := s.cookies.set(w, sess); err != nil {
		http.Error(w, "cannot start a session", http.StatusInternalServerError)
		return
	}
	s.log.Info("signed in", "client_id", id.GetClientId(), "roles", strings.Join(roles, ","))
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

func (s *Server) signOut(w http.ResponseWriter, r *http.Request, _ *session) (any, error) {
	s.cookies.clear(w)
	return redirect("/signin"), nil
}
