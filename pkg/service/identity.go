package service

import (
	"context"

	identityv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/identity/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
)

// identityServer answers GetIdentity on every service: the caller as the
// auth interceptor authenticated it.
type identityServer struct {
	identityv1.UnimplementedIdentityServiceServer
	disabled bool
}

func (s identityServer) GetIdentity(ctx context.Context, _ *identityv1.GetIdentityRequest) (*identityv1.GetIdentityResponse, error) {
	id := auth.IdentityOf(ctx)
	resp := &identityv1.GetIdentityResponse{ClientId: id.ClientID, AuthenticationDisabled: s.disabled}
	for _, r := range id.Roles {
		resp.Roles = append(resp.Roles, string(r))
	}
	return resp, nil
}
