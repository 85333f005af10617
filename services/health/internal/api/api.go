// Package api serves HealthService: proxy health from the shared store (so
// every replica answers for every proxy, whoever probes it), transitions
// as a stream, and provider health. Requests arrive checked against the
// contract's rules (pkg/validate, on every server through pkg/service).
package api

import (
	"context"
	"encoding/base64"
	"errors"
	"log/slog"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	"github.com/egress-proxies/egress-proxies/pkg/validate"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store"
	"github.com/egress-proxies/egress-proxies/services/health/internal/transitions"
)

// Provider is one configured provider.
type Provider struct {
	Name string
	Type string
}

// Server implements HealthService.
type Server struct {
	healthv1.UnimplementedHealthServiceServer

	Store *store.Store
	Hub   *transitions.Hub
	// Providers are the configured providers, in config order.
	Providers func() []Provider
	Log       *slog.Logger
	// Stopping, when closed, ends every watch (the service is shutting
	// down: a graceful stop waits for streams, and watches never end on
	// their own).
	Stopping <-chan struct{}
}

const (
	defaultPageSize = 100
	maxPageSize     = 1000
)

// GetProxyHealth returns one proxy's health.
func (s *Server) GetProxyHealth(ctx context.Context, req *healthv1.GetProxyHealthRequest) (*healthv1.GetProxyHealthResponse, error) {
	h, err := s.Store.GetProxy(ctx, req.GetProxyName())
	if errors.Is(err, store.ErrNotFound) {
		return nil, status.Errorf(codes.NotFound, "proxy %q is not probed", req.GetProxyName())
	}
	if err != nil {
		return nil, s.internal(ctx, "reading proxy health", err)
	}
	return &healthv1.GetProxyHealthResponse{Health: h}, nil
}

// ListProxyHealth lists proxies by name, a page at a time.
func (s *Server) ListProxyHealth(ctx context.Context, req *healthv1.ListProxyHealthRequest) (*healthv1.ListProxyHealthResponse, error) {
	size := int(req.GetPageSize()) // never negative: a contract rule
	switch {
	case size == 0:
		size = defaultPageSize
	case size > maxPageSize:
		size = maxPageSize
	}
	afterName, afterUID, err := decodePageToken(req.GetPageToken())
	if err != nil {
		return nil, err
	}
	list, err := s.Store.ListProxies(ctx, afterName, afterUID, size+1)
	if err != nil {
		return nil, s.internal(ctx, "listing proxy health", err)
	}
	resp := &healthv1.ListProxyHealthResponse{}
	if len(list) > size {
		list = list[:size]
		last := list[size-1]
		resp.NextPageToken = encodePageToken(last.GetProxyName(), last.GetProxyUid())
	}
	resp.Proxies = list
	return resp, nil
}

// WatchProxyHealth streams transitions after since_sequence, then live.
func (s *Server) WatchProxyHealth(req *healthv1.WatchProxyHealthRequest, stream healthv1.HealthService_WatchProxyHealthServer) error {
	ctx := stream.Context()
	since := req.GetSinceSequence() // never negative: a contract rule
	// Subscribe first, so nothing stored from here on is missed; the
	// backlog fills the gap up to the hub's position.
	ch, hubPos, cancel, err := s.Hub.Subscribe(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return status.FromContextError(ctx.Err()).Err()
		}
		return status.Error(codes.Unavailable, "the service is shutting down")
	}
	defer cancel()
	// Headers tell the client the watch is established: from here on it
	// misses nothing.
	if err := stream.SendHeader(metadata.MD{}); err != nil {
		return err
	}
	last := hubPos
	if since > 0 {
		pruned, err := s.Store.PrunedThrough(ctx)
		if err != nil {
			return s.internal(ctx, "reading retention", err)
		}
		if since < pruned {
			return status.Errorf(codes.OutOfRange, "transitions up to sequence %d are no longer retained; resume from %d or 0", pruned, pruned)
		}
		last = since
		for last < hubPos {
			ts, err := s.Store.TransitionsAfter(ctx, last, 500)
			if err != nil {
				return s.internal(ctx, "reading transitions", err)
			}
			if len(ts) == 0 {
				break
			}
			for _, t := range ts {
				if t.GetSequence() > hubPos {
					break
				}
				if err := stream.Send(&healthv1.WatchProxyHealthResponse{Transition: t}); err != nil {
					return err
				}
				last = t.GetSequence()
			}
			if ts[len(ts)-1].GetSequence() >= hubPos {
				break
			}
		}
	}
	for {
		select {
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		case <-s.Stopping:
			return status.Errorf(codes.Unavailable, "the service is shutting down; resume with since_sequence=%d", last)
		case t, ok := <-ch:
			if !ok {
				if ctx.Err() != nil {
					return status.FromContextError(ctx.Err()).Err()
				}
				return status.Errorf(codes.Unavailable, "watch ended (falling behind, or shutting down); resume with since_sequence=%d", last)
			}
			if t.GetSequence() <= last {
				continue
			}
			if err := stream.Send(&healthv1.WatchProxyHealthResponse{Transition: t}); err != nil {
				return err
			}
			last = t.GetSequence()
		}
	}
}

// GetProviderHealth returns one provider's latest check.
func (s *Server) GetProviderHealth(ctx context.Context, req *healthv1.GetProviderHealthRequest) (*healthv1.GetProviderHealthResponse, error) {
	var cfg *Provider
	provs := s.Providers()
	for i := range provs {
		if provs[i].Name == req.GetProvider() {
			cfg = &provs[i]
		}
	}
	if cfg == nil {
		return nil, status.Errorf(codes.NotFound, "provider %q is not configured", req.GetProvider())
	}
	all, err := s.Store.Providers(ctx)
	if err != nil {
		return nil, s.internal(ctx, "reading provider health", err)
	}
	h, ok := all[cfg.Name]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "provider %q has not been checked yet", cfg.Name)
	}
	return &healthv1.GetProviderHealthResponse{Health: h}, nil
}

// ListProviderHealth lists every configured provider in config order; one
// not checked yet has readiness UNSPECIFIED.
func (s *Server) ListProviderHealth(ctx context.Context, _ *healthv1.ListProviderHealthRequest) (*healthv1.ListProviderHealthResponse, error) {
	all, err := s.Store.Providers(ctx)
	if err != nil {
		return nil, s.internal(ctx, "reading provider health", err)
	}
	resp := &healthv1.ListProviderHealthResponse{}
	for _, p := range s.Providers() {
		h, ok := all[p.Name]
		if !ok {
			h = &healthv1.ProviderHealth{Provider: p.Name, Type: p.Type}
		}
		resp.Providers = append(resp.Providers, h)
	}
	return resp, nil
}

func (s *Server) internal(ctx context.Context, what string, err error) error {
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	s.Log.ErrorContext(ctx, what+" failed", "error", err)
	return status.Error(codes.Unavailable, what+" failed; retry")
}

// decodePageToken reads a ListProxyHealth page token: where the previous
// page stopped. An empty token starts at the beginning.
func decodePageToken(tok string) (afterName, afterUID string, err error) {
	if tok == "" {
		return "", "", nil
	}
	raw, err := base64.RawURLEncoding.DecodeString(tok)
	name, uid, ok := strings.Cut(string(raw), "\x00")
	if err != nil || !ok || name == "" {
		return "", "", validate.Field("page_token", "is not one this service issued")
	}
	return name, uid, nil
}

// encodePageToken is the token of the page after the proxy name/uid.
func encodePageToken(name, uid string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(name + "\x00" + uid))
}
