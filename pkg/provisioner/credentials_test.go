package provisioner

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// credentialsOf is the orchestrator's GetProxyCredentials over a map of
// proxy UID to credentials (nil: the proxy has none); a UID it lacks is
// NOT_FOUND.
type credentialsOf map[string]*proxyv1.ProxyCredentials

func (c credentialsOf) GetProxyCredentials(_ context.Context, in *proxyv1.GetProxyCredentialsRequest, _ ...grpc.CallOption) (*proxyv1.GetProxyCredentialsResponse, error) {
	creds, ok := c[in.GetUid()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "proxy %s not found", in.GetUid())
	}
	return &proxyv1.GetProxyCredentialsResponse{Credentials: creds}, nil
}

// updatingBackend records what UpdateCredentials was given.
type updatingBackend struct {
	*memBackend
	got *proxyv1.ProxyCredentials
}

func (b *updatingBackend) UpdateCredentials(_ context.Context, req *provisionerv1.UpdateCredentialsRequest) (*provisionerv1.Instance, error) {
	b.got = req.GetCredentials()
	return &provisionerv1.Instance{ProviderId: req.GetProviderId(), State: provisionerv1.InstanceState_INSTANCE_STATE_RUNNING}, nil
}

func TestUpdateCredentialsFetchesTheProxysCurrentOnes(t *testing.T) {
	t.Parallel()
	current := &proxyv1.ProxyCredentials{Username: "egress-0123456789ab", Password: "pw-current-secret"}
	source := credentialsOf{"u1": current, "open": nil}
	req := func(uid string) *provisionerv1.UpdateCredentialsRequest {
		return &provisionerv1.UpdateCredentialsRequest{Provider: "pve", ProviderId: "vms/100/proxy-" + uid, ProxyUid: uid, Installation: "test"}
	}
	ctx := context.Background()

	b := &updatingBackend{memBackend: newMem()}
	rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: b, Credentials: source})
	in, err := rt.UpdateCredentials(ctx, req("u1"))
	if err != nil || in.GetProviderId() != "vms/100/proxy-u1" {
		t.Fatalf("UpdateCredentials = %v, %v", in, err)
	}
	if b.got.GetUsername() != current.GetUsername() || b.got.GetPassword() != current.GetPassword() {
		t.Errorf("the backend got %v, want the proxy's current credentials", b.got)
	}
	for _, tc := range []struct {
		name string
		uid  string
		want errclass.Class
	}{
		{"a proxy without credentials: nothing to update to", "open", errclass.Permanent},
		{"a proxy the orchestrator does not know", "gone", errclass.Permanent},
	} {
		if _, err := rt.UpdateCredentials(ctx, req(tc.uid)); errclass.Of(err) != tc.want || strings.Contains(err.Error(), current.GetPassword()) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}

	plain := NewRuntime(RuntimeOptions{Provider: "pve", Backend: newMem(), Credentials: source})
	_, err = grpcClient(t, plain).UpdateCredentials(ctx, req("u1"))
	if status.Code(err) != codes.Unimplemented || errclass.Of(errclass.FromStatus(err)) != errclass.Unsupported {
		t.Errorf("a backend that cannot update in place: %v, want UNIMPLEMENTED with reason Unsupported", err)
	}
}
