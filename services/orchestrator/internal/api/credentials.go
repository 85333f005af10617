package api

import (
	"context"
	"errors"
	"log/slog"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/telemetry"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// log is the server's logger; slog's default without one.
func (s *Server) log() *slog.Logger {
	if s.Log != nil {
		return s.Log
	}
	return slog.Default()
}

// warnOpen logs the WARNING for a MANAGED proxy that runs open to anyone:
// its spec says credentials NONE.
func (s *Server) warnOpen(r *lifecycle.Proxy) {
	if r.Spec.GetMode() == proxyv1.ProxyMode_PROXY_MODE_MANAGED && !lifecycle.WantsCredentials(r.Spec) {
		s.log().Warn("WARNING: proxy has spec.credentials NONE: it serves anyone who can reach it",
			"proxy_name", r.Name, "proxy_uid", r.UID)
	}
}

// RotateCredentials implements ProxyService.
func (s *Server) RotateCredentials(ctx context.Context, req *proxyv1.RotateCredentialsRequest) (*proxyv1.RotateCredentialsResponse, error) {
	var row *lifecycle.Proxy
	err := s.Store.Write(ctx, func(tx *store.Tx) error {
		r, err := tx.LockByName(ctx, req.GetName())
		if errors.Is(err, store.ErrNotFound) {
			return status.Errorf(codes.NotFound, "proxy %q not found", req.GetName())
		}
		if err != nil {
			return err
		}
		if err := lifecycle.RotateCredentials(r, telemetry.TraceParent(ctx), tx.Now()); err != nil {
			return status.Errorf(codes.FailedPrecondition, "proxy %q: %v", r.Name, err)
		}
		row = r
		tx.Update(r)
		return nil
	})
	if err != nil {
		if _, ok := status.FromError(err); ok {
			return nil, err
		}
		return nil, internal(err)
	}
	s.log().Info("proxy credentials rotated", "proxy_name", row.Name, "proxy_uid", row.UID)
	return &proxyv1.RotateCredentialsResponse{Proxy: row.Proto(false)}, nil
}

// GetProxyCredentials implements ProxyService: the service role only
// (pkg/auth), for the suite's own services.
func (s *Server) GetProxyCredentials(ctx context.Context, req *proxyv1.GetProxyCredentialsRequest) (*proxyv1.GetProxyCredentialsResponse, error) {
	r, err := s.Store.GetByUID(ctx, req.GetUid())
	if errors.Is(err, store.ErrNotFound) {
		return nil, status.Errorf(codes.NotFound, "no proxy has uid %s", req.GetUid())
	}
	if err != nil {
		return nil, internal(err)
	}
	out := &proxyv1.GetProxyCredentialsResponse{ServiceOnly: r.Spec.GetCredentialsServiceOnly()}
	if c := r.Credentials; c != nil {
		out.Credentials = &proxyv1.ProxyCredentials{Username: c.Username, Password: c.Password}
		out.CredentialsTime = timestamppb.New(c.Time)
	}
	return out, nil
}
