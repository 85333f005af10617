// Package proxy is the gateway's HTTP listener: a forward proxy for
// absolute-URI requests and CONNECT tunnels on one port. Each request is
// authenticated from Proxy-Authorization, sent through a leased proxy, and
// classified by the ban rules; each CONNECT becomes a tunnel.
package proxy

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/access"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/options"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/rules"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/session"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/tunnel"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/upstream"
)

// Response headers the gateway adds (HTTP answers and the CONNECT answer).
const (
	// HeaderProxy names the proxy the request went through.
	HeaderProxy = "X-Egress-Proxy"
	// HeaderLease is the lease id: report a tunnel's outcome with it.
	HeaderLease = "X-Egress-Lease"
	// HeaderMoved is set when the session moved to another proxy for this
	// request: "<previous proxy>; reason=<reason>".
	HeaderMoved = "X-Egress-Session-Moved"
	// HeaderRule names the ban rule that classified the answer.
	HeaderRule = "X-Egress-Rule"
)

// Handler serves the HTTP listener.
type Handler struct {
	Core   *tunnel.Core
	Access *access.Checker
	Rules  *rules.Set
	Log    *slog.Logger
}

const realm = `Basic realm="egress-gateway"`

func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodConnect && (r.URL.Scheme == "" || r.URL.Host == "") {
		// Not a proxy request (a client that took the gateway for the
		// target).
		http.Error(w, "this is a forward proxy: send absolute-URI requests (http://host/path) or CONNECT", http.StatusBadRequest)
		return
	}
	user, pass, present := access.ParseBasic(r.Header.Get("Proxy-Authorization"))
	caller, err := h.Access.Check(r.RemoteAddr, user, pass, present)
	if err != nil {
		h.refuseAccess(w, err)
		return
	}
	kind, target := "forward", r.URL.Host
	if r.Method == http.MethodConnect {
		kind, target = "connect", connectTarget(r)
	}
	ctx, span := tunnel.StartSpan(r.Context(), caller, kind, target)
	defer span.End()
	r = r.WithContext(ctx)
	if r.Method == http.MethodConnect {
		h.connect(w, r, caller)
		return
	}
	h.forward(w, r, caller)
}

// connectTarget is a CONNECT's host:port.
func connectTarget(r *http.Request) string {
	if r.Host != "" {
		return r.Host
	}
	return r.URL.Host
}

func (h *Handler) refuseAccess(w http.ResponseWriter, err error) {
	var refused *access.Refused
	var bad *options.Error
	switch {
	case errors.As(err, &bad):
		h.Core.Metrics.AuthFailures.WithLabelValues("http", "bad_option").Inc()
		w.Header().Set("Connection", "close")
		http.Error(w, bad.Error(), http.StatusBadRequest)
	case errors.As(err, &refused) && refused.Reason == access.RateLimited:
		h.Core.Metrics.AuthFailures.WithLabelValues("http", string(refused.Reason)).Inc()
		w.Header().Set("Connection", "close")
		http.Error(w, refused.Error(), http.StatusTooManyRequests)
	case errors.As(err, &refused):
		h.Core.Metrics.AuthFailures.WithLabelValues("http", string(refused.Reason)).Inc()
		w.Header().Set("Proxy-Authenticate", realm)
		http.Error(w, refused.Error(), http.StatusProxyAuthRequired)
	default:
		http.Error(w, "internal error", http.StatusInternalServerError)
	}
}

func (h *Handler) connect(w http.ResponseWriter, r *http.Request, caller access.Caller) {
	t, f := h.Core.Open(r.Context(), caller, "connect", connectTarget(r))
	if f != nil {
		h.Core.Metrics.Requests.WithLabelValues(caller.ClientID, caller.Options.Pool, caller.Options.Provider, "connect", f.Outcome).Inc()
		http.Error(w, f.Message, f.Status)
		return
	}
	rc := http.NewResponseController(w)
	hijacked, brw, err := rc.Hijack()
	conn := unwrap(hijacked)
	if err != nil {
		h.Core.Abort(t)
		http.Error(w, "cannot open a tunnel on this connection", http.StatusInternalServerError)
		return
	}
	var b strings.Builder
	b.WriteString("HTTP/1.1 200 Connection established\r\n")
	b.WriteString(HeaderProxy + ": " + t.Lease.ProxyName + "\r\n")
	b.WriteString(HeaderLease + ": " + t.Lease.ID + "\r\n")
	if t.MovedFrom != "" {
		b.WriteString(HeaderMoved + ": " + t.MovedFrom + "; reason=" + t.MoveReason + "\r\n")
	}
	b.WriteString("\r\n")
	if _, err := conn.Write([]byte(b.String())); err != nil {
		_ = conn.Close()
		h.Core.Abort(t)
		return
	}
	var buffered []byte
	if n := brw.Reader.Buffered(); n > 0 {
		buffered, _ = brw.Reader.Peek(n)
		buffered = append([]byte(nil), buffered...)
	}
	_ = conn.SetDeadline(noDeadline)
	h.Core.Relay(t, conn, buffered)
}

// forward sends an absolute-URI request through a leased proxy. When the
// proxy cannot be reached (nothing of the request sent), or a ban rule
// classifies an idempotent request's answer, it moves to another proxy, up
// to the retries; the client gets one answer.
func (h *Handler) forward(w http.ResponseWriter, r *http.Request, caller access.Caller) {
	core := h.Core
	host := r.URL.Hostname()
	labels := func(pool, outcome string) []string {
		return []string{caller.ClientID, pool, caller.Options.Provider, "http", outcome}
	}
	body := &trackedBody{r: r.Body}
	idempotent := (r.Method == http.MethodGet || r.Method == http.MethodHead || r.Method == http.MethodOptions) &&
		(r.ContentLength == 0 || r.Body == http.NoBody)
	var movedFrom, moveReason string
	for attempt := 0; ; attempt++ {
		last := attempt >= core.Retries
		lease, f := core.Acquire(r.Context(), caller, host)
		if f != nil {
			tunnel.TraceFailure(r.Context(), f)
			core.Metrics.Requests.WithLabelValues(labels(caller.Options.Pool, f.Outcome)...).Inc()
			http.Error(w, f.Message, f.Status)
			return
		}
		if lease.Moved() && movedFrom == "" {
			movedFrom, moveReason = lease.MovedFrom, lease.MoveReason
		}
		var sess *session.Counters
		if lease.Session() {
			sess = core.Sessions.Use(session.Key{ClientID: caller.ClientID, ID: caller.Options.Session},
				lease.SessionKey, lease.ID, lease.ProxyName, lease.Addr, lease.Pool, lease.TTL, lease.MoveReason)
		}
		out := outgoing(r, body)
		resp, err := core.Dialer.Transport(lease.Addr, lease.User).RoundTrip(out)
		if err != nil {
			sess.Done()
			unreached := upstream.IsDialError(err)
			if unreached {
				core.Metrics.Retries.WithLabelValues("upstream_unreachable").Inc()
				core.Dialer.Forget(lease.Addr, lease.User)
				_ = core.Leaser.Report(r.Context(), lease.ID, leasev1.Outcome_OUTCOME_ERROR, host, upstream.GlobalScope)
			}
			core.Finish(lease)
			if !last && r.Context().Err() == nil && (unreached && body.n == 0 || idempotent) {
				continue
			}
			core.Metrics.Requests.WithLabelValues(labels(lease.Pool, "upstream_error")...).Inc()
			f := &tunnel.Failure{Status: http.StatusBadGateway, Message: "the request could not be sent through a proxy", Outcome: "upstream_error"}
			tunnel.TraceFailure(r.Context(), f)
			if r.Context().Err() == nil {
				http.Error(w, f.Message, f.Status)
			}
			return
		}
		outcome := "success"
		var matched *rules.Match
		if !h.Rules.Empty() {
			var prefix []byte
			if h.Rules.NeedsBody(host, resp.StatusCode) {
				prefix, resp.Body, _ = rules.ReadPrefix(resp.Body, h.Rules.BodyLimit())
			}
			if m, ok := h.Rules.Classify(host, resp.StatusCode, resp.Header, prefix); ok {
				matched = &m
				outcome = string(m.Outcome)
				core.Metrics.Rules.WithLabelValues(m.Rule, outcome).Inc()
				_ = core.Leaser.Report(r.Context(), lease.ID, ruleOutcome(m.Outcome), host, upstream.TargetScope)
				if m.Retry && idempotent && !last {
					core.Metrics.Retries.WithLabelValues("ban_rule").Inc()
					_ = resp.Body.Close()
					sess.Done()
					core.Finish(lease)
					continue
				}
			}
		}
		removeHopHeaders(resp.Header)
		hdr := w.Header()
		for k, vs := range resp.Header {
			hdr[k] = vs
		}
		hdr.Set(HeaderProxy, lease.ProxyName)
		hdr.Set(HeaderLease, lease.ID)
		if movedFrom != "" {
			hdr.Set(HeaderMoved, movedFrom+"; reason="+moveReason)
		}
		if matched != nil {
			hdr.Set(HeaderRule, matched.Rule)
		}
		w.WriteHeader(resp.StatusCode)
		n, _ := io.Copy(w, resp.Body)
		_ = resp.Body.Close()
		core.Metrics.Requests.WithLabelValues(labels(lease.Pool, outcome)...).Inc()
		core.Metrics.Bytes.WithLabelValues("up", caller.ClientID, lease.Pool, caller.Options.Provider).Add(float64(body.n))
		core.Metrics.Bytes.WithLabelValues("down", caller.ClientID, lease.Pool, caller.Options.Provider).Add(float64(n))
		sess.Add(body.n, n)
		sess.Done()
		core.Finish(lease)
		return
	}
}

func ruleOutcome(o rules.Outcome) leasev1.Outcome {
	switch o {
	case rules.Banned:
		return leasev1.Outcome_OUTCOME_BANNED
	case rules.Captcha:
		return leasev1.Outcome_OUTCOME_CAPTCHA
	default:
		return leasev1.Outcome_OUTCOME_BLOCKED
	}
}

// outgoing is the request as it goes to the proxy: no hop-by-hop header,
// no Proxy-Authorization, its body counted and never closed by a failed
// attempt.
func outgoing(r *http.Request, body *trackedBody) *http.Request {
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.Close = false
	if r.Body != nil && r.Body != http.NoBody {
		out.Body = body
	}
	removeHopHeaders(out.Header)
	return out
}

// hopHeaders are the hop-by-hop headers of RFC 9110 section 7.6.1, plus
// the proxy's own credentials.
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
	"Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

func removeHopHeaders(h http.Header) {
	for _, f := range h.Values("Connection") {
		for _, name := range strings.Split(f, ",") {
			if name = strings.TrimSpace(name); name != "" {
				h.Del(name)
			}
		}
	}
	for _, k := range hopHeaders {
		h.Del(k)
	}
}

// trackedBody counts what was read of a request body and ignores Close,
// so an attempt that failed before sending anything leaves it whole for
// the next.
type trackedBody struct {
	r io.Reader
	n int64
}

func (b *trackedBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	b.n += int64(n)
	return n, err
}

func (b *trackedBody) Close() error { return nil }

var noDeadline time.Time

// Serve serves the listener with the limits of srv applied, counting the
// connections dropped for a timeout in refusals.
func Serve(ctx context.Context, srv *http.Server, lis net.Listener, refusals *prometheus.CounterVec) error {
	w := &timeouts{refusals: refusals}
	lis = w.listen(lis)
	srv.ConnState = w.connState
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
