package api_test

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

func TestCredentialsAPI(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	ctx := context.Background()
	created, err := h.Client.CreateProxy(ctx, orchtest.Managed("p1"))
	if err != nil {
		t.Fatal(err)
	}
	uid := created.GetProxy().GetUid()
	first, err := h.Client.GetProxyCredentials(ctx, &proxyv1.GetProxyCredentialsRequest{Uid: uid})
	if err != nil {
		t.Fatal(err)
	}
	c := first.GetCredentials()
	if c.GetUsername() == "" || c.GetPassword() == "" || first.GetCredentialsTime() == nil {
		t.Fatalf("a new managed proxy has no credentials: %v", first.GetCredentialsTime())
	}

	// Reads never carry them, in any view.
	got, err := h.Client.GetProxy(ctx, &proxyv1.GetProxyRequest{Name: "p1"})
	if err != nil {
		t.Fatal(err)
	}
	list, err := h.Client.ListProxies(ctx, &proxyv1.ListProxiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for what, b := range map[string]string{
		"GetProxy": protojson.Format(got), "ListProxies": protojson.Format(list), "CreateProxy": protojson.Format(created),
	} {
		if strings.Contains(b, c.GetPassword()) || strings.Contains(b, c.GetUsername()) {
			t.Errorf("%s carries the credentials", what)
		}
	}
	if got.GetProxy().GetStatus().GetCredentialsTime() == nil {
		t.Error("status.credentials_time unset")
	}

	// Rotation: new ones, the old ones gone.
	rotated, err := h.Client.RotateCredentials(ctx, &proxyv1.RotateCredentialsRequest{Name: "p1"})
	if err != nil {
		t.Fatal(err)
	}
	if b := protojson.Format(rotated); strings.Contains(b, c.GetPassword()) {
		t.Error("RotateCredentials' answer carries credentials")
	}
	second, err := h.Client.GetProxyCredentials(ctx, &proxyv1.GetProxyCredentialsRequest{Uid: uid})
	if err != nil {
		t.Fatal(err)
	}
	if second.GetCredentials().GetPassword() == c.GetPassword() || second.GetCredentials().GetUsername() == c.GetUsername() {
		t.Error("rotation kept the old credentials")
	}

	// Refusals name the reason.
	open := orchtest.Managed("open")
	open.Spec.Credentials = proxyv1.CredentialsPolicy_CREDENTIALS_POLICY_NONE
	if _, err := h.Client.CreateProxy(ctx, open); err != nil {
		t.Fatal(err)
	}
	ext := &proxyv1.CreateProxyRequest{Name: "ext", Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL,
		Endpoint:            &proxyv1.Endpoint{Host: "203.0.113.7", Port: 3128},
		EndpointCredentials: &proxyv1.ProxyCredentials{Username: "crawl", Password: "ext-secret-4711"}}}
	extResp, err := h.Client.CreateProxy(ctx, ext)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(protojson.Format(extResp), "ext-secret-4711") {
		t.Error("CreateProxy's answer carries the endpoint credentials")
	}
	extCreds, err := h.Client.GetProxyCredentials(ctx, &proxyv1.GetProxyCredentialsRequest{Uid: extResp.GetProxy().GetUid()})
	if err != nil || extCreds.GetCredentials().GetPassword() != "ext-secret-4711" {
		t.Errorf("the external proxy's own credentials were not kept: %v", err)
	}
	for name, want := range map[string]string{"open": "CREDENTIALS_POLICY_NONE", "ext": "EXTERNAL", "nope": ""} {
		_, err := h.Client.RotateCredentials(ctx, &proxyv1.RotateCredentialsRequest{Name: name})
		wantCode := codes.FailedPrecondition
		if want == "" {
			wantCode = codes.NotFound
		}
		if status.Code(err) != wantCode || !strings.Contains(err.Error(), want) {
			t.Errorf("rotate %s: %v, want %v naming %q", name, err, wantCode, want)
		}
	}
	openCreds, err := h.Client.GetProxyCredentials(ctx, &proxyv1.GetProxyCredentialsRequest{Uid: "00000000-0000-0000-0000-000000000000"})
	if status.Code(err) != codes.NotFound {
		t.Errorf("unknown uid: %v %v", openCreds, err)
	}
	// Bad input names the field.
	_, err = h.Client.CreateProxy(ctx, &proxyv1.CreateProxyRequest{Name: "bad", Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL,
		Endpoint:            &proxyv1.Endpoint{Host: "203.0.113.7", Port: 3128},
		EndpointCredentials: &proxyv1.ProxyCredentials{Username: "a:b", Password: "x"}}})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "spec.endpoint_credentials.username") {
		t.Errorf("bad endpoint user: %v", err)
	}
	managedWithOwn := orchtest.Managed("own")
	managedWithOwn.Spec.EndpointCredentials = &proxyv1.ProxyCredentials{Username: "a", Password: "b"}
	if _, err := h.Client.CreateProxy(ctx, managedWithOwn); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "spec.endpoint_credentials") {
		t.Errorf("managed with endpoint credentials: %v", err)
	}
}
