package web

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// redirect is an action's answer that moves the browser elsewhere.
type redirect string

// done is an action's answer: what happened, in a sentence.
type done string

// action serves a POST that changes something. In order: the browser must
// say the request is same-origin (http.CrossOriginProtection reads
// Sec-Fetch-Site and Origin), the user must be signed in, the body is
// bounded before it is read, and the form (or the X-CSRF-Token header)
// must carry the session's CSRF secret. Only then does the console call
// the service, as the user: whether the user may do it is the service's
// decision (a viewer's forced action comes back PERMISSION_DENIED).
func (s *Server) action(h func(http.ResponseWriter, *http.Request, *session) (any, error)) http.Handler {
	return s.origin.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sess, err := s.cookies.get(r, s.cfg.Now())
		if err != nil {
			s.answer(w, r, nil, &apiError{Status: http.StatusUnauthorized, Message: "Sign in first: " + err.Error() + "."})
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
		if err := r.ParseForm(); err != nil {
			s.answer(w, r, nil, &apiError{Status: http.StatusRequestEntityTooLarge, Message: "The form is too large or cannot be read."})
			return
		}
		sent := r.Header.Get("X-CSRF-Token")
		if sent == "" {
			sent = r.PostForm.Get("csrf")
		}
		if sent == "" || subtle.ConstantTimeCompare([]byte(sent), []byte(sess.CSRF)) != 1 {
			s.answer(w, r, nil, &apiError{Status: http.StatusForbidden, Message: "The request lacks this session's CSRF token; reload the page and try again."})
			return
		}
		out, err := h(w, r, sess)
		s.answer(w, r, out, err)
	}))
}

// answer writes an action's outcome: JSON to the console's script, a
// redirect or a page to a plain form post.
func (s *Server) answer(w http.ResponseWriter, r *http.Request, out any, err error) {
	var e *apiError
	if err != nil && !errors.As(err, &e) {
		e = &apiError{Status: http.StatusBadRequest, Message: err.Error()}
	}
	script := r.Header.Get("X-Requested-With") == "console"
	if script {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		body := map[string]any{"ok": e == nil}
		status := http.StatusOK
		switch v := out.(type) {
		case redirect:
			body["redirect"] = string(v)
		case done:
			body["message"] = string(v)
		}
		if e != nil {
			body["error"], status = e.Message, e.Status
		}
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(body)
		return
	}
	if e != nil {
		http.Error(w, e.Message, e.Status)
		return
	}
	next := r.PostForm.Get("next")
	if v, ok := out.(redirect); ok {
		next = string(v)
	}
	// Only paths of this console: never another origin.
	if !strings.HasPrefix(next, "/") || strings.HasPrefix(next, "//") || strings.ContainsAny(next, "\\\r\n") {
		next = "/"
	}
	http.Redirect(w, r, next, http.StatusSeeOther)
}

func formInvalid(field, problem string) error {
	return &apiError{Status: http.StatusBadRequest, Message: fmt.Sprintf("%s: %s", field, problem)}
}

// parseLabels reads `k=v, k2=v2`; the orchestrator checks the syntax.
func parseLabels(field, s string) (map[string]string, error) {
	out := map[string]string{}
	for _, part := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == '\n' }) {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		k, v, ok := strings.Cut(part, "=")
		if !ok || strings.TrimSpace(k) == "" {
			return nil, formInvalid(field, fmt.Sprintf("%q is not key=value", part))
		}
		out[strings.TrimSpace(k)] = strings.TrimSpace(v)
	}
	return out, nil
}

func parseUint(field, s string, max uint64) (uint64, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, nil
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil || n > max {
		return 0, formInvalid(field, fmt.Sprintf("must be a whole number from 0 to %d", max))
	}
	return n, nil
}

func parseDuration(field, s string) (*durationpb.Duration, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return nil, formInvalid(field, "must be a duration such as 10m or 1h30m")
	}
	return durationpb.New(d), nil
}

func callCtx(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), 15*time.Second)
}

// proxySpec reads the spec fields shared by the proxy and pool forms.
func proxySpec(f func(string) string) (*proxyv1.ProxySpec, error) {
	spec := &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: strings.TrimSpace(f("provider"))}
	if f("mode") == "external" {
		spec.Mode, spec.Provider = proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, ""
		port, err := parseUint("endpoint port", f("endpoint_port"), 65535)
		if err != nil {
			return nil, err
		}
		spec.Endpoint = &proxyv1.Endpoint{Host: strings.TrimSpace(f("endpoint_host")), Port: uint32(port)}
		return spec, nil
	}
	if z, m, i := strings.TrimSpace(f("zone")), strings.TrimSpace(f("machine_type")), strings.TrimSpace(f("image")); z+m+i != "" {
		spec.Placement = &proxyv1.Placement{Zone: z, MachineType: m, Image: i}
	}
	port, err := parseUint("port", f("port"), 65535)
	if err != nil {
		return nil, err
	}
	spec.Port = uint32(port)
	spec.CloudInit = f("cloud_init")
	return spec, nil
}

func (s *Server) createProxy(_ http.ResponseWriter, r *http.Request, sess *session) (any, error) {
	labels, err := parseLabels("labels", r.PostForm.Get("labels"))
	if err != nil {
		return nil, err
	}
	spec, err := proxySpec(r.PostForm.Get)
	if err != nil {
		return nil, err
	}
	name := strings.TrimSpace(r.PostForm.Get("name"))
	ctx, cancel := callCtx(r)
	defer cancel()
	resp, err := s.api.Proxies.CreateProxy(ctx, &proxyv1.CreateProxyRequest{Name: name, Labels: labels, Spec: spec}, as(sess))
	if e := fromAPI("the orchestrator", err); e != nil {
		return nil, e
	}
	s.log.Info("proxy created", "client_id", sess.ClientID, "proxy_uid", resp.GetProxy().GetUid(), "name", name)
	return done(fmt.Sprintf("Proxy %s created: %s.", name, phaseName(resp.GetProxy().GetStatus().GetPhase()))), nil
}

func (s *Server) deleteProxy(_ http.ResponseWriter, r *http.Request, sess *session) (any, error) {
	name := r.PathValue("name")
	ctx, cancel := callCtx(r)
	defer cancel()
	resp, err := s.api.Proxies.DeleteProxy(ctx, &proxyv1.DeleteProxyRequest{Name: name, SkipCleanup: r.PostForm.Get("skip_cleanup") == "on"}, as(sess))
	if e := fromAPI("the orchestrator", err); e != nil {
		return nil, e
	}
	s.log.Info("proxy deleted", "client_id", sess.ClientID, "proxy_uid", resp.GetProxy().GetUid(), "name", name)
	return done("Proxy " + name + " is being deleted."), nil
}

func (s *Server) drainProxy(_ http.ResponseWriter, r *http.Request, sess *session) (any, error) {
	name := r.PathValue("name")
	timeout, err := parseDuration("drain timeout", r.PostForm.Get("timeout"))
	if err != nil {
		return nil, err
	}
	cancelDrain := r.PostForm.Get("cancel") == "on" || r.PostForm.Get("cancel") == "true"
	ctx, cancel := callCtx(r)
	defer cancel()
	resp, err := s.api.Proxies.DrainProxy(ctx, &proxyv1.DrainProxyRequest{Name: name, DrainTimeout: timeout, Cancel: cancelDrain}, as(sess))
	if e := fromAPI("the orchestrator", err); e != nil {
		return nil, e
	}
	s.log.Info("proxy drain", "client_id", sess.ClientID, "proxy_uid", resp.GetProxy().GetUid(), "name", name, "cancel", cancelDrain)
	if cancelDrain {
		return done("Proxy " + name + " takes leases again."), nil
	}
	return done("Proxy " + name + " is draining until " + fmtTime(resp.GetProxy().GetDrainDeadline()) + "."), nil
}

func (s *Server) rotateCredentials(_ http.ResponseWriter, r *http.Request, sess *session) (any, error) {
	name := r.PathValue("name")
	ctx, cancel := callCtx(r)
	defer cancel()
	resp, err := s.api.Proxies.RotateCredentials(ctx, &proxyv1.RotateCredentialsRequest{Name: name}, as(sess))
	if e := fromAPI("the orchestrator", err); e != nil {
		return nil, e
	}
	s.log.Info("proxy credentials rotated", "client_id", sess.ClientID, "proxy_uid", resp.GetProxy().GetUid(), "name", name)
	return done("Proxy " + name + " has new credentials (made " + fmtTime(resp.GetProxy().GetStatus().GetCredentialsTime()) + "); the old ones stop working."), nil
}

// parseSpread reads `provider[/zone]=weight, …`.
func parseSpread(s string) ([]*proxyv1.SpreadTarget, error) {
	var out []*proxyv1.SpreadTarget
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		target, weight, _ := strings.Cut(part, "=")
		w, err := parseUint("spread", weight, 1000)
		if err != nil {
			return nil, err
		}
		provider, zone, _ := strings.Cut(strings.TrimSpace(target), "/")
		out = append(out, &proxyv1.SpreadTarget{Provider: provider, Zone: zone, Weight: uint32(w)})
	}
	return out, nil
}

func (s *Server) createPool(_ http.ResponseWriter, r *http.Request, sess *session) (any, error) {
	labels, err := parseLabels("proxy labels", r.PostForm.Get("labels"))
	if err != nil {
		return nil, err
	}
	spec, err := proxySpec(r.PostForm.Get)
	if err != nil {
		return nil, err
	}
	spread, err := parseSpread(r.PostForm.Get("spread"))
	if err != nil {
		return nil, err
	}
	replicas, err := parseUint("replicas", r.PostForm.Get("replicas"), 10000)
	if err != nil {
		return nil, err
	}
	name := strings.TrimSpace(r.PostForm.Get("name"))
	ctx, cancel := callCtx(r)
	defer cancel()
	resp, err := s.api.Pools.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: name, Spec: &proxyv1.ProxyPoolSpec{
		Template: &proxyv1.ProxyTemplate{Labels: labels, Spec: spec}, Replicas: int32(replicas), Spread: spread,
	}}, as(sess))
	if e := fromAPI("the orchestrator", err); e != nil {
		return nil, e
	}
	s.log.Info("pool created", "client_id", sess.ClientID, "pool", name, "pool_uid", resp.GetPool().GetUid())
	return done(fmt.Sprintf("Pool %s created with %d replicas.", name, replicas)), nil
}

func (s *Server) scalePool(_ http.ResponseWriter, r *http.Request, sess *session) (any, error) {
	name := r.PathValue("name")
	replicas, err := parseUint("replicas", r.PostForm.Get("replicas"), 10000)
	if err != nil {
		return nil, err
	}
	ctx, cancel := callCtx(r)
	defer cancel()
	resp, err := s.api.Pools.ScaleProxyPool(ctx, &proxyv1.ScaleProxyPoolRequest{Name: name, Replicas: int32(replicas)}, as(sess))
	if e := fromAPI("the orchestrator", err); e != nil {
		return nil, e
	}
	s.log.Info("pool scaled", "client_id", sess.ClientID, "pool", name, "replicas", replicas)
	return done(fmt.Sprintf("Pool %s scaled to %d (desired %d).", name, replicas, resp.GetPool().GetStatus().GetDesiredReplicas())), nil
}

func (s *Server) deletePool(_ http.ResponseWriter, r *http.Request, sess *session) (any, error) {
	name := r.PathValue("name")
	ctx, cancel := callCtx(r)
	defer cancel()
	if _, err := s.api.Pools.DeleteProxyPool(ctx, &proxyv1.DeleteProxyPoolRequest{Name: name}, as(sess)); err != nil {
		return nil, fromAPI("the orchestrator", err)
	}
	s.log.Info("pool deleted", "client_id", sess.ClientID, "pool", name)
	return done("Pool " + name + " drains its proxies, then goes."), nil
}
