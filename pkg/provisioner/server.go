package provisioner

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// Server is the gRPC ProvisionerService over a Runtime. Errors leave it as
// errclass.ToStatus made them: the class's code and an ErrorInfo reason.
type Server struct {
	provisionerv1.UnimplementedProvisionerServiceServer
	RT *Runtime
}

func grpcErr(err error) error {
	if err == nil {
		return nil
	}
	return errclass.ToStatus(err).Err()
}

// CreateInstance implements the RPC.
func (s *Server) CreateInstance(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.CreateInstanceResponse, error) {
	in, err := s.RT.Create(ctx, req)
	if err != nil {
		return nil, grpcErr(err)
	}
	return &provisionerv1.CreateInstanceResponse{Instance: in}, nil
}

// GetInstance implements the RPC.
func (s *Server) GetInstance(ctx context.Context, req *provisionerv1.GetInstanceRequest) (*provisionerv1.GetInstanceResponse, error) {
	in, err := s.RT.Get(ctx, req)
	if err != nil {
		return nil, grpcErr(err)
	}
	return &provisionerv1.GetInstanceResponse{Instance: in}, nil
}

// DeleteInstance implements the RPC.
func (s *Server) DeleteInstance(ctx context.Context, req *provisionerv1.DeleteInstanceRequest) (*provisionerv1.DeleteInstanceResponse, error) {
	deleted, err := s.RT.Delete(ctx, req)
	if err != nil {
		return nil, grpcErr(err)
	}
	return &provisionerv1.DeleteInstanceResponse{Deleted: deleted}, nil
}

// ListInstances implements the RPC.
func (s *Server) ListInstances(ctx context.Context, req *provisionerv1.ListInstancesRequest) (*provisionerv1.ListInstancesResponse, error) {
	out, err := s.RT.List(ctx, req)
	if err != nil {
		return nil, grpcErr(err)
	}
	return &provisionerv1.ListInstancesResponse{Instances: out}, nil
}

// UpdateCredentials implements the RPC.
func (s *Server) UpdateCredentials(ctx context.Context, req *provisionerv1.UpdateCredentialsRequest) (*provisionerv1.UpdateCredentialsResponse, error) {
	in, err := s.RT.UpdateCredentials(ctx, req)
	if err != nil {
		return nil, grpcErr(err)
	}
	return &provisionerv1.UpdateCredentialsResponse{Instance: in}, nil
}

// CheckBackend implements the RPC; UNIMPLEMENTED when the backend has no
// check.
func (s *Server) CheckBackend(ctx context.Context, req *provisionerv1.CheckBackendRequest) (*provisionerv1.CheckBackendResponse, error) {
	out, err := s.RT.Check(ctx, req)
	if errors.Is(err, ErrNoCheck) {
		return nil, status.Errorf(codes.Unimplemented, "provider %q: %v", s.RT.Provider(), err)
	}
	if err != nil {
		return nil, grpcErr(err)
	}
	return &provisionerv1.CheckBackendResponse{Targets: out}, nil
}
