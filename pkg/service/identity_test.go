package service

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	identityv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/identity/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
)

// GetIdentity answers with the token's client id and roles, refuses an
// unknown token like every call, and says when authentication is off.
func TestGetIdentity(t *testing.T) {
	t.Parallel()
	tokens := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(tokens, []byte("ops tok-admin admin\nboard tok-viewer viewer,crawler\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		auth     auth.Config
		token    string
		want     *identityv1.GetIdentityResponse
		wantCode codes.Code
	}{
		{"admin", auth.Config{TokenFile: tokens}, "tok-admin", &identityv1.GetIdentityResponse{ClientId: "ops", Roles: []string{"admin"}}, codes.OK},
		{"two roles", auth.Config{TokenFile: tokens}, "tok-viewer", &identityv1.GetIdentityResponse{ClientId: "board", Roles: []string{"viewer", "crawler"}}, codes.OK},
		{"unknown token", auth.Config{TokenFile: tokens}, "tok-nobody", nil, codes.Unauthenticated},
		{"no token", auth.Config{TokenFile: tokens}, "", nil, codes.Unauthenticated},
		{"auth disabled", auth.Config{Disabled: true}, "", &identityv1.GetIdentityResponse{ClientId: auth.Anonymous,
			Roles: []string{"admin", "viewer", "crawler", "service"}, AuthenticationDisabled: true}, codes.OK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			a := tc.auth
			s, err := New(ctx, Options{Name: "identity", GRPCListen: "127.0.0.1:0", HTTPListen: "127.0.0.1:0", LogLevel: "error",
				ShutdownTimeout: 5 * time.Second, Auth: &a})
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- s.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("Run: %v", err)
				}
			}()
			conn, err := grpc.NewClient(s.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			opts := []grpc.CallOption{grpc.WaitForReady(true)}
			if tc.token != "" {
				opts = append(opts, grpc.PerRPCCredentials(auth.BearerToken(tc.token)))
			}
			cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
			defer ccancel()
			got, err := identityv1.NewIdentityServiceClient(conn).GetIdentity(cctx, &identityv1.GetIdentityRequest{}, opts...)
			if status.Code(err) != tc.wantCode {
				t.Fatalf("GetIdentity = %v, want %v", err, tc.wantCode)
			}
			if tc.want == nil {
				return
			}
			if got.GetClientId() != tc.want.GetClientId() || !slices.Equal(got.GetRoles(), tc.want.GetRoles()) ||
				got.GetAuthenticationDisabled() != tc.want.GetAuthenticationDisabled() {
				t.Errorf("GetIdentity = %v, want %v", got, tc.want)
			}
		})
	}
}
