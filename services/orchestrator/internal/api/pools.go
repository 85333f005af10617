package api

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/pool"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/spec"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// PoolServer implements ProxyPoolService.
type PoolServer struct {
	proxyv1.UnimplementedProxyPoolServiceServer
	Server *Server
}

func (s *PoolServer) store() *store.Store { return s.Server.Store }

func (s *PoolServer) validate(v *spec.Violations, sp *proxyv1.ProxyPoolSpec) {
	pool.Validate(v, sp, s.Server.configured, s.Server.Providers.Current().Names())
}

func poolErr(err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	return internal(err)
}

// CreateProxyPool implements ProxyPoolService.
func (s *PoolServer) CreateProxyPool(ctx context.Context, req *proxyv1.CreateProxyPoolRequest) (*proxyv1.CreateProxyPoolResponse, error) {
	var v spec.Violations
	spec.ValidateLabels(&v, "labels", req.GetLabels())
	s.validate(&v, req.GetSpec())
	if err := v.Err(); err != nil {
		return nil, err
	}
	want := pool.Normalize(req.GetSpec())
	var out *store.PoolRow
	created := false
	write := func(tx *store.Tx) error {
		created = false
		existing, err := tx.LockPool(ctx, req.GetName())
		switch {
		case errors.Is(err, store.ErrPoolNotFound):
		case err != nil:
			return err
		case existing.Deleting():
			return status.Errorf(codes.AlreadyExists, "pool %q is being deleted; create it again once it is gone", req.GetName())
		case proto.Equal(existing.Spec, want) && maps.Equal(existing.Labels, req.GetLabels()):
			out = existing
			return nil
		default:
			return status.Errorf(codes.AlreadyExists, "pool %q already exists with a different spec or labels", req.GetName())
		}
		now := tx.Now()
		p := &store.PoolRow{
			UID: uuid.NewString(), Name: req.GetName(), Labels: req.GetLabels(), Spec: want,
			Generation: 1, CreateTime: now,
			Status: &proxyv1.ProxyPoolStatus{TemplateHash: pool.TemplateHash(want)},
		}
		if err := tx.WritePool(ctx, p, proxyv1.ChangeType_CHANGE_TYPE_CREATED); err != nil {
			return err
		}
		out, created = p, true
		return nil
	}
	err := s.store().Write(ctx, write)
	if errors.Is(err, store.ErrPoolExists) {
		// Another request created the name between our look and our
		// insert: a second look answers as if it had come first
		// (the same pool, or AlreadyExists for another spec).
		err = s.store().Write(ctx, write)
	}
	if err != nil {
		return nil, poolErr(err)
	}
	return &proxyv1.CreateProxyPoolResponse{Pool: out.Proto(false), Created: created}, nil
}

// GetProxyPool implements ProxyPoolService.
func (s *PoolServer) GetProxyPool(ctx context.Context, req *proxyv1.GetProxyPoolRequest) (*proxyv1.GetProxyPoolResponse, error) {
	p, err := s.store().GetPool(ctx, req.GetName())
	if errors.Is(err, store.ErrPoolNotFound) {
		return nil, status.Errorf(codes.NotFound, "pool %q not found", req.GetName())
	}
	if err != nil {
		return nil, internal(err)
	}
	return &proxyv1.GetProxyPoolResponse{Pool: p.Proto(false)}, nil
}

// ListProxyPools implements ProxyPoolService.
func (s *PoolServer) ListProxyPools(ctx context.Context, req *proxyv1.ListProxyPoolsRequest) (*proxyv1.ListProxyPoolsResponse, error) {
	var after string
	if req.GetPageToken() != "" {
		var tok pageToken
		raw, err := base64.RawURLEncoding.DecodeString(req.GetPageToken())
		if err != nil || json.Unmarshal(raw, &tok) != nil || tok.Filter != "pools" {
			return nil, spec.Violations{{Field: "page_token", Description: "not a token from a previous ListProxyPools"}}.Err()
		}
		after = tok.After
	}
	size := int(req.GetPageSize())
	if size == 0 {
		size = DefaultPageSize
	}
	rows, rev, err := s.store().ListPools(ctx, after, size+1)
	if err != nil {
		return nil, internal(err)
	}
	resp := &proxyv1.ListProxyPoolsResponse{Revision: rev}
	if len(rows) > size {
		rows = rows[:size]
		b, _ := json.Marshal(pageToken{After: rows[size-1].Name, Filter: "pools"})
		resp.NextPageToken = base64.RawURLEncoding.EncodeToString(b)
	}
	for _, r := range rows {
		resp.Pools = append(resp.Pools, r.Proto(false))
	}
	return resp, nil
}

// lockLivePool locks a pool for a change by a client, checking its
// version when the client gave one.
func lockLivePool(ctx context.Context, tx *store.Tx, name string, generation int64, etag string) (*store.PoolRow, error) {
	p, err := tx.LockPool(ctx, name)
	if errors.Is(err, store.ErrPoolNotFound) {
		return nil, status.Errorf(codes.NotFound, "pool %q not found", name)
	}
	if err != nil {
		return nil, err
	}
	if generation != 0 && generation != p.Generation {
		return nil, status.Errorf(codes.FailedPrecondition, "pool %q changed: its generation is %d, not %d; read it again", name, p.Generation, generation)
	}
	if etag != "" && etag != lifecycle.Etag(p.Revision) {
		return nil, status.Errorf(codes.FailedPrecondition, "pool %q changed: its etag is %s, not %s; read it again", name, lifecycle.Etag(p.Revision), etag)
	}
	if p.Deleting() {
		return nil, status.Errorf(codes.FailedPrecondition, "pool %q is being deleted", name)
	}
	return p, nil
}

// UpdateProxyPool implements ProxyPoolService.
func (s *PoolServer) UpdateProxyPool(ctx context.Context, req *proxyv1.UpdateProxyPoolRequest) (*proxyv1.UpdateProxyPoolResponse, error) {
	var v spec.Violations
	spec.ValidateLabels(&v, "labels", req.GetLabels())
	s.validate(&v, req.GetSpec())
	if req.GetGeneration() == 0 && req.GetEtag() == "" {
		v.Add("generation", "one of generation or etag is required")
	}
	if err := v.Err(); err != nil {
		return nil, err
	}
	want := pool.Normalize(req.GetSpec())
	var out *store.PoolRow
	err := s.store().Write(ctx, func(tx *store.Tx) error {
		p, err := lockLivePool(ctx, tx, req.GetName(), req.GetGeneration(), req.GetEtag())
		if err != nil {
			return err
		}
		out = p
		if proto.Equal(p.Spec, want) && maps.Equal(p.Labels, req.GetLabels()) {
			return nil
		}
		if p.Spec.GetReplicas() != want.GetReplicas() || !proto.Equal(p.Spec.GetAutoscaling(), want.GetAutoscaling()) {
			manualScale(p, want, tx.Now(), "UpdateProxyPool")
		}
		p.Spec, p.Labels = want, req.GetLabels()
		p.Generation++
		return tx.WritePool(ctx, p, proxyv1.ChangeType_CHANGE_TYPE_UPDATED)
	})
	if err != nil {
		return nil, poolErr(err)
	}
	return &proxyv1.UpdateProxyPoolResponse{Pool: out.Proto(false)}, nil
}

// manualScale records a client's new desired count as the pool's scaling
// decision; the controller takes it from there.
func manualScale(p *store.PoolRow, want *proxyv1.ProxyPoolSpec, now time.Time, by string) {
	to := pool.Clamp(want, want.GetReplicas())
	from := p.Status.GetDesiredReplicas()
	p.Status.DesiredReplicas = to
	p.Status.LastScalingDecision = &proxyv1.ScalingDecision{
		Time: timestamppb.New(now), FromReplicas: from, ToReplicas: to, Reason: pool.ScaleScaled,
		Message: fmt.Sprintf("%s set replicas to %d", by, want.GetReplicas()),
	}
}

// ScaleProxyPool implements ProxyPoolService.
func (s *PoolServer) ScaleProxyPool(ctx context.Context, req *proxyv1.ScaleProxyPoolRequest) (*proxyv1.ScaleProxyPoolResponse, error) {
	var out *store.PoolRow
	err := s.store().Write(ctx, func(tx *store.Tx) error {
		p, err := lockLivePool(ctx, tx, req.GetName(), 0, "")
		if err != nil {
			return err
		}
		out = p
		if p.Spec.GetReplicas() == req.GetReplicas() && p.Status.GetDesiredReplicas() == pool.Clamp(p.Spec, req.GetReplicas()) {
			return nil
		}
		want := proto.Clone(p.Spec).(*proxyv1.ProxyPoolSpec)
		want.Replicas = req.GetReplicas()
		manualScale(p, want, tx.Now(), "ScaleProxyPool")
		p.Spec = want
		p.Generation++
		return tx.WritePool(ctx, p, proxyv1.ChangeType_CHANGE_TYPE_UPDATED)
	})
	if err != nil {
		return nil, poolErr(err)
	}
	return &proxyv1.ScaleProxyPoolResponse{Pool: out.Proto(false)}, nil
}

// DeleteProxyPool implements ProxyPoolService.
func (s *PoolServer) DeleteProxyPool(ctx context.Context, req *proxyv1.DeleteProxyPoolRequest) (*proxyv1.DeleteProxyPoolResponse, error) {
	var out *store.PoolRow
	err := s.store().Write(ctx, func(tx *store.Tx) error {
		p, err := tx.LockPool(ctx, req.GetName())
		if errors.Is(err, store.ErrPoolNotFound) {
			return status.Errorf(codes.NotFound, "pool %q not found", req.GetName())
		}
		if err != nil {
			return err
		}
		out = p
		if p.Deleting() {
			return nil
		}
		now := tx.Now()
		p.DeleteTime = &now
		owned, err := tx.PoolProxies(ctx, p.Name)
		if err != nil {
			return err
		}
		if len(owned) == 0 {
			return tx.WritePool(ctx, p, proxyv1.ChangeType_CHANGE_TYPE_DELETED)
		}
		// The controller drains the proxies and removes the pool after
		// the last one.
		return tx.WritePool(ctx, p, proxyv1.ChangeType_CHANGE_TYPE_UPDATED)
	})
	if err != nil {
		return nil, poolErr(err)
	}
	return &proxyv1.DeleteProxyPoolResponse{Pool: out.Proto(false)}, nil
}

// WatchProxyPools implements ProxyPoolService.
func (s *PoolServer) WatchProxyPools(req *proxyv1.WatchProxyPoolsRequest, stream proxyv1.ProxyPoolService_WatchProxyPoolsServer) error {
	ctx := stream.Context()
	since := req.GetSinceRevision()
	if since == 0 {
		rev, err := s.store().PoolRevision(ctx)
		if err != nil {
			return internal(err)
		}
		since = rev
	}
	if err := stream.SendHeader(metadata.Pairs(WatchRevisionHeader, strconv.FormatInt(since, 10))); err != nil {
		return err
	}
	compacted := func(since int64) error {
		return status.Errorf(codes.OutOfRange, "pool revision %d is older than the retained change log; list the pools again and watch from the revision the list returns", since)
	}
	return follow(ctx, s.Server, since, compacted, s.store().PoolChanges, func(c store.PoolChange) (int64, error) {
		if req.GetName() != "" && c.Pool.GetName() != req.GetName() {
			return c.Revision, nil
		}
		return c.Revision, stream.Send(&proxyv1.WatchProxyPoolsResponse{
			Revision: c.Revision, Type: c.Type, Pool: c.Pool, ChangeTime: timestamppb.New(c.Time),
		})
	})
}

// DrainProxy implements ProxyService.
func (s *Server) DrainProxy(ctx context.Context, req *proxyv1.DrainProxyRequest) (*proxyv1.DrainProxyResponse, error) {
	timeout := pool.DefaultDrainTimeout
	if req.GetDrainTimeout() != nil {
		timeout = req.GetDrainTimeout().AsDuration()
	}
	var row *lifecycle.Proxy
	err := s.Store.Write(ctx, func(tx *store.Tx) error {
		r, err := tx.LockByName(ctx, req.GetName())
		if errors.Is(err, store.ErrNotFound) {
			return status.Errorf(codes.NotFound, "proxy %q not found", req.GetName())
		}
		if err != nil {
			return err
		}
		row = r
		if r.Deleting() {
			return status.Errorf(codes.FailedPrecondition, "proxy %q is being deleted", r.Name)
		}
		switch {
		case req.GetCancel() && r.Draining():
			lifecycle.Undrain(r)
		case !req.GetCancel() && !r.Draining():
			lifecycle.Drain(r, tx.Now(), timeout)
		default:
			return nil
		}
		tx.Update(r)
		return nil
	})
	if err != nil {
		if _, ok := status.FromError(err); ok {
			return nil, err
		}
		return nil, internal(err)
	}
	return &proxyv1.DrainProxyResponse{Proxy: row.Proto(false)}, nil
}
