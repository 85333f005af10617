package farm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"net/url"
	"time"
)

// Handler is the farm's JSON API:
//
//	POST   /v1/instances?network=P  create (201; 409 the id is taken; 507 no free address)
//	GET    /v1/instances            every instance
//	GET    /v1/instances/{id}       one (404 when there is none)
//	PATCH  /v1/instances/{id}       rewrite its mark (proxyUid, installation, marked)
//	DELETE /v1/instances/{id}       delete (204; 404 when there was none)
//	GET    /v1/stats                {"instances": n}
func (f *Farm) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/stats", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, Stats{Instances: f.Len()})
	})
	mux.HandleFunc("POST /v1/instances", func(w http.ResponseWriter, r *http.Request) {
		network, err := netip.ParsePrefix(r.URL.Query().Get("network"))
		if err != nil {
			http.Error(w, "network: "+err.Error(), http.StatusBadRequest)
			return
		}
		var in Instance
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<16)).Decode(&in); err != nil {
			http.Error(w, "body: "+err.Error(), http.StatusBadRequest)
			return
		}
		out, err := f.Create(in, network)
		switch {
		case errors.Is(err, ErrExists):
			http.Error(w, err.Error(), http.StatusConflict)
		case errors.Is(err, ErrNoAddress), errors.Is(err, ErrPort):
			http.Error(w, err.Error(), http.StatusInsufficientStorage)
		case err != nil:
			http.Error(w, err.Error(), http.StatusBadRequest)
		default:
			writeJSON(w, http.StatusCreated, out)
		}
	})
	mux.HandleFunc("GET /v1/instances", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, f.List())
	})
	mux.HandleFunc("GET /v1/instances/{id}", func(w http.ResponseWriter, r *http.Request) {
		if in, ok := f.Get(r.PathValue("id")); ok {
			writeJSON(w, http.StatusOK, in)
			return
		}
		http.NotFound(w, r)
	})
	mux.HandleFunc("PATCH /v1/instances/{id}", func(w http.ResponseWriter, r *http.Request) {
		var m Instance
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<16)).Decode(&m); err != nil {
			http.Error(w, "body: "+err.Error(), http.StatusBadRequest)
			return
		}
		if in, ok := f.Mark(r.PathValue("id"), m.ProxyUID, m.Installation, m.Marked); ok {
			writeJSON(w, http.StatusOK, in)
			return
		}
		http.NotFound(w, r)
	})
	mux.HandleFunc("DELETE /v1/instances/{id}", func(w http.ResponseWriter, r *http.Request) {
		if f.Delete(r.PathValue("id")) {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		http.NotFound(w, r)
	})
	return mux
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// Stats is the farm's answer to GET /v1/stats.
type Stats struct {
	Instances int `json:"instances"`
}

// Client calls a farm's API.
type Client struct {
	// Base is the farm's API URL (http://127.0.0.1:port).
	Base string
	HTTP *http.Client
}

// NewClient is a client of the farm at base.
func NewClient(base string) *Client {
	return &Client{Base: base, HTTP: &http.Client{Timeout: 10 * time.Second,
		Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 64, IdleConnTimeout: 30 * time.Second}}}
}

// StatusError is an answer of the farm other than the expected one.
type StatusError struct {
	Code    int
	Message string
}

func (e *StatusError) Error() string { return fmt.Sprintf("farm answered %d: %s", e.Code, e.Message) }

// IsStatus reports whether err is the farm's answer code.
func IsStatus(err error, code int) bool {
	var se *StatusError
	return errors.As(err, &se) && se.Code == code
}

func (c *Client) do(ctx context.Context, method, path string, body, out any, want int) error {
	var rd io.Reader
	if body != nil {
		raw, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(raw)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.Base+path, rd)
	if err != nil {
		return err
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != want {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		return &StatusError{Code: resp.StatusCode, Message: string(bytes.TrimSpace(msg))}
	}
	if out != nil {
		return json.NewDecoder(resp.Body).Decode(out)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return nil
}

// Create makes in at an address of network.
func (c *Client) Create(ctx context.Context, in Instance, network netip.Prefix) (Instance, error) {
	var out Instance
	err := c.do(ctx, http.MethodPost, "/v1/instances?network="+url.QueryEscape(network.String()), in, &out, http.StatusCreated)
	return out, err
}

// Get returns the instance of id (a 404 StatusError when there is none).
func (c *Client) Get(ctx context.Context, id string) (Instance, error) {
	var out Instance
	err := c.do(ctx, http.MethodGet, "/v1/instances/"+url.PathEscape(id), nil, &out, http.StatusOK)
	return out, err
}

// Mark rewrites the instance's mark.
func (c *Client) Mark(ctx context.Context, id, proxyUID, installation string, marked bool) (Instance, error) {
	var out Instance
	err := c.do(ctx, http.MethodPatch, "/v1/instances/"+url.PathEscape(id),
		Instance{ProxyUID: proxyUID, Installation: installation, Marked: marked}, &out, http.StatusOK)
	return out, err
}

// Delete removes the instance (a 404 StatusError when there was none).
func (c *Client) Delete(ctx context.Context, id string) error {
	return c.do(ctx, http.MethodDelete, "/v1/instances/"+url.PathEscape(id), nil, nil, http.StatusNoContent)
}

// List returns every instance.
func (c *Client) List(ctx context.Context) ([]Instance, error) {
	var out []Instance
	err := c.do(ctx, http.MethodGet, "/v1/instances", nil, &out, http.StatusOK)
	return out, err
}

// Stats returns how many instances the farm holds (every one, marked or
// not), without listing them.
func (c *Client) Stats(ctx context.Context) (Stats, error) {
	var out Stats
	err := c.do(ctx, http.MethodGet, "/v1/stats", nil, &out, http.StatusOK)
	return out, err
}
