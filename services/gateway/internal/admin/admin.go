// Package admin serves the gateway's GatewayService: this replica's
// sessions, ending a session fleet-wide, reporting a tunnel's outcome, and
// the replica's status.
package admin

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	gatewayv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/gateway/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/session"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/tunnel"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/upstream"
)

// Server implements GatewayService.
type Server struct {
	gatewayv1.UnimplementedGatewayServiceServer
	Core      *tunnel.Core
	ProxyAddr string
	SocksAddr string
	Ready     func() bool
}

// client is whose sessions a call may touch: an operator (admin or
// viewer) names any client, or every client with an empty one; a crawler
// only ever its own.
func client(ctx context.Context, asked string) (string, error) {
	id := auth.IdentityOf(ctx)
	if id.Has(auth.Admin) || id.Has(auth.Viewer) {
		return asked, nil
	}
	if asked != "" && asked != id.ClientID {
		return "", status.Error(codes.PermissionDenied, "client_id: a crawler sees only its own sessions")
	}
	return id.ClientID, nil
}

// ListSessions implements GatewayService.
func (s *Server) ListSessions(ctx context.Context, req *gatewayv1.ListSessionsRequest) (*gatewayv1.ListSessionsResponse, error) {
	c, err := client(ctx, req.GetClientId())
	if err != nil {
		return nil, err
	}
	out := &gatewayv1.ListSessionsResponse{}
	for _, ss := range s.Core.Sessions.List(c) {
		out.Sessions = append(out.Sessions, toProto(ss))
	}
	return out, nil
}

// GetSession implements GatewayService.
func (s *Server) GetSession(ctx context.Context, req *gatewayv1.GetSessionRequest) (*gatewayv1.GetSessionResponse, error) {
	c, err := owner(ctx, req.GetClientId())
	if err != nil {
		return nil, err
	}
	ss, ok := s.Core.Sessions.Get(session.Key{ClientID: c, ID: req.GetSessionId()})
	if !ok {
		return nil, status.Errorf(codes.NotFound, "session %q of client %q: this replica has not served it within its lifetime", req.GetSessionId(), c)
	}
	return &gatewayv1.GetSessionResponse{Session: toProto(ss)}, nil
}

// owner is the client of one session: the named one for operators, the
// caller's own otherwise (and for operators naming none).
func owner(ctx context.Context, asked string) (string, error) {
	c, err := client(ctx, asked)
	if err != nil {
		return "", err
	}
	if c == "" {
		c = auth.ClientID(ctx)
	}
	return c, nil
}

// EndSession implements GatewayService.
func (s *Server) EndSession(ctx context.Context, req *gatewayv1.EndSessionRequest) (*gatewayv1.EndSessionResponse, error) {
	c, err := owner(ctx, req.GetClientId())
	if err != nil {
		return nil, err
	}
	s.Core.Sessions.Forget(session.Key{ClientID: c, ID: req.GetSessionId()})
	lease, existed, err := s.Core.Leaser.SessionLease(ctx, c, req.GetSessionId())
	var np *upstream.NoProxyError
	switch {
	case errors.As(err, &np):
		// A session with a live lease is always answered: it had none.
		return &gatewayv1.EndSessionResponse{}, nil
	case err != nil:
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	s.Core.Leaser.ReleaseID(lease.ID)
	return &gatewayv1.EndSessionResponse{Ended: existed}, nil
}

// ReportOutcome implements GatewayService.
func (s *Server) ReportOutcome(ctx context.Context, req *gatewayv1.ReportOutcomeRequest) (*gatewayv1.ReportOutcomeResponse, error) {
	leaseID := req.GetLeaseId()
	switch {
	case (leaseID == "") == (req.GetSessionId() == ""):
		return nil, status.Error(codes.InvalidArgument, "lease_id, session_id: set exactly one")
	case leaseID == "":
		c := auth.ClientID(ctx)
		if ss, ok := s.Core.Sessions.Get(session.Key{ClientID: c, ID: req.GetSessionId()}); ok {
			leaseID = ss.LeaseID
		} else {
			lease, existed, err := s.Core.Leaser.SessionLease(ctx, c, req.GetSessionId())
			if err != nil {
				return nil, status.Errorf(codes.NotFound, "session %q: no live lease", req.GetSessionId())
			}
			if !existed {
				s.Core.Leaser.ReleaseID(lease.ID)
				return nil, status.Errorf(codes.NotFound, "session %q: no live lease", req.GetSessionId())
			}
			leaseID = lease.ID
		}
	}
	if err := s.Core.Leaser.Report(ctx, leaseID, req.GetOutcome(), req.GetTargetHost(), upstream.TargetScope); err != nil {
		if st, ok := status.FromError(err); ok && st.Code() != codes.Unknown {
			return nil, status.Error(st.Code(), st.Message())
		}
		return nil, status.Error(codes.Unavailable, "the lease service cannot be reached")
	}
	return &gatewayv1.ReportOutcomeResponse{LeaseId: leaseID}, nil
}

// GetStatus implements GatewayService.
func (s *Server) GetStatus(context.Context, *gatewayv1.GetStatusRequest) (*gatewayv1.GetStatusResponse, error) {
	return &gatewayv1.GetStatusResponse{
		Ready: s.Ready(), ProxyAddress: s.ProxyAddr, SocksAddress: s.SocksAddr,
		ActiveTunnels: int64(s.Core.Limits.Active()), Sessions: int64(len(s.Core.Sessions.List(""))),
	}, nil
}

func toProto(s session.Session) *gatewayv1.Session {
	return &gatewayv1.Session{
		SessionId: s.Key.ID, ClientId: s.Key.ClientID, SessionKey: s.LeaseKey, LeaseId: s.LeaseID,
		ProxyName: s.ProxyName, ProxyAddress: s.ProxyAddr, Pool: s.Pool, Lifetime: durationpb.New(s.Lifetime),
		CreateTime: timestamppb.New(s.Created), LastUseTime: timestamppb.New(s.LastUsed),
		Moves: s.Moves, LastMoveReason: s.LastMove, Requests: s.Requests,
		BytesUp: s.BytesUp, BytesDown: s.BytesDown, Active: s.ActiveConn,
	}
}
