package auth

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

func exempt(fullMethod string) bool {
	return strings.HasPrefix(fullMethod, "/"+healthpb.Health_ServiceDesc.ServiceName+"/") ||
		strings.HasPrefix(fullMethod, "/grpc.reflection.")
}

// Authorize checks that the caller of fullMethod may call it: a valid token
// (UNAUTHENTICATED otherwise), a role the table grants for the method
// (PERMISSION_DENIED naming the roles that would do), and room in the
// caller's rate limit (RESOURCE_EXHAUSTED with a retry delay). It returns
// ctx carrying the caller's identity.
func (a *Authenticator) Authorize(ctx context.Context, fullMethod string) (context.Context, error) {
	if exempt(fullMethod) {
		return ctx, nil
	}
	var header string
	// One header, read without copying the whole metadata map.
	if v := metadata.ValueFromIncomingContext(ctx, "authorization"); len(v) > 0 {
		header = v[0]
	}
	id, err := a.Authenticate(header)
	if err != nil {
		return nil, err
	}
	r, ok := table[fullMethod]
	if !ok {
		return nil, status.Errorf(codes.PermissionDenied, "%s is not in the role table; no role may call it", fullMethod)
	}
	if !slices.ContainsFunc(id.Roles, func(have Role) bool { return slices.Contains(r.Roles, have) }) {
		return nil, status.Errorf(codes.PermissionDenied, "%s needs the role %s; client %q has %s",
			fullMethod, strings.ReplaceAll(roleList(r.Roles), ", ", " or "), id.ClientID, roleList(id.Roles))
	}
	if err := a.limits.allow(ctx, r.Limit, id.ClientID); err != nil {
		return nil, err
	}
	return WithIdentity(ctx, id), nil
}

// ServerOptions returns the interceptors that enforce authentication,
// roles and rate limits.
func (a *Authenticator) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			ctx, err := a.Authorize(ctx, info.FullMethod)
			if err != nil {
				return nil, err
			}
			return h(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			ctx, err := a.Authorize(ss.Context(), info.FullMethod)
			if err != nil {
				return err
			}
			return h(srv, &authedStream{ServerStream: ss, ctx: ctx})
		}),
	}
}

type authedStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *authedStream) Context() context.Context { return s.ctx }

// CheckCovered fails when a service registered on a gRPC server (its
// GetServiceInfo) has a method the role table lacks, so such a service
// refuses to start instead of denying the method to everyone at run time.
func CheckCovered(services map[string]grpc.ServiceInfo) error {
	var missing []string
	for name, info := range services {
		for _, m := range info.Methods {
			full := "/" + name + "/" + m.Name
			if _, ok := table[full]; !ok && !exempt(full) {
				missing = append(missing, full)
			}
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		return fmt.Errorf("methods missing from the role table in pkg/auth: %s", strings.Join(missing, ", "))
	}
	return nil
}
