package api_test

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

// Cloud-init is returned only in the FULL view, only to admins: never by
// default, never to viewers or services (the lease service's resync), never
// in write responses, error texts or the replicas' logs.
func TestCloudInitOnlyInTheFullViewForAdmins(t *testing.T) {
	t.Parallel()
	const secret = "#cloud-config\npassword: s3cr3t-cl0ud-1n1t\n"
	const secret2 = "#cloud-config\npassword: n3w-s3cr3t\n"
	h := orchtest.New(t)
	_, prov := h.StartCloud("fake")
	h.StartReplica()

	tokens := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(tokens, []byte("ops tok-admin admin\nboard tok-viewer viewer\nlease tok-service service\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	authn, err := auth.New(auth.Config{TokenFile: tokens}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(authn.ServerOptions()...)
	proxyv1.RegisterProxyServiceServer(srv, h.API)
	addr := grpctest.Serve(t, srv)
	client := func(token string) proxyv1.ProxyServiceClient {
		return proxyv1.NewProxyServiceClient(grpctest.Dial(t, addr, grpc.WithPerRPCCredentials(auth.BearerToken(token))))
	}
	admin, viewer, service := client("tok-admin"), client("tok-viewer"), client("tok-service")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	full := proxyv1.ProxyView_PROXY_VIEW_FULL
	var texts []string // every error text and response but FULL ones, checked for the secret at the end

	req := orchtest.Managed("p1")
	req.Spec.CloudInit = secret
	created, err := admin.CreateProxy(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if created.GetProxy().GetSpec().GetCloudInit() != "" {
		t.Error("CreateProxy returned the cloud-init")
	}
	texts = append(texts, created.String())
	h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	// The provisioner needs it: the Create command carries it.
	var carried bool
	for _, cmd := range prov.Received() {
		carried = carried || (cmd.GetOperation() == busv1.Operation_OPERATION_CREATE && cmd.GetCreate().GetCloudInit() == secret)
	}
	if !carried {
		t.Error("no Create command carried the cloud-init to the provisioner")
	}

	// Get.
	for _, tc := range []struct {
		name   string
		c      proxyv1.ProxyServiceClient
		view   proxyv1.ProxyView
		want   string
		denied bool
	}{
		{"admin, default view", admin, proxyv1.ProxyView_PROXY_VIEW_UNSPECIFIED, "", false},
		{"admin, BASIC", admin, proxyv1.ProxyView_PROXY_VIEW_BASIC, "", false},
		{"admin, FULL", admin, full, secret, false},
		{"viewer, default view", viewer, proxyv1.ProxyView_PROXY_VIEW_UNSPECIFIED, "", false},
		{"viewer, FULL", viewer, full, "", true},
	} {
		resp, err := tc.c.GetProxy(ctx, &proxyv1.GetProxyRequest{Name: "p1", View: tc.view})
		texts = append(texts, status.Convert(err).Message())
		if tc.want == "" {
			texts = append(texts, resp.String())
		}
		switch {
		case tc.denied:
			if status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), "needs the role admin") {
				t.Errorf("GetProxy %s = %v, want PERMISSION_DENIED naming admin", tc.name, err)
			}
		case err != nil:
			t.Errorf("GetProxy %s: %v", tc.name, err)
		case resp.GetProxy().GetSpec().GetCloudInit() != tc.want:
			t.Errorf("GetProxy %s: cloud-init %q, want %q", tc.name, resp.GetProxy().GetSpec().GetCloudInit(), tc.want)
		}
	}
	if _, err := service.GetProxy(ctx, &proxyv1.GetProxyRequest{Name: "p1"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("GetProxy as a service = %v, want PERMISSION_DENIED (services list, they do not get)", err)
	}

	// List: what the lease service's resync sees, and the views.
	for _, tc := range []struct {
		name   string
		c      proxyv1.ProxyServiceClient
		view   proxyv1.ProxyView
		want   string
		denied bool
	}{
		{"service (the lease resync)", service, proxyv1.ProxyView_PROXY_VIEW_UNSPECIFIED, "", false},
		{"service, FULL", service, full, "", true},
		{"viewer", viewer, proxyv1.ProxyView_PROXY_VIEW_BASIC, "", false},
		{"viewer, FULL", viewer, full, "", true},
		{"admin", admin, proxyv1.ProxyView_PROXY_VIEW_UNSPECIFIED, "", false},
		{"admin, FULL", admin, full, secret, false},
	} {
		resp, err := tc.c.ListProxies(ctx, &proxyv1.ListProxiesRequest{View: tc.view})
		texts = append(texts, status.Convert(err).Message())
		if tc.want == "" {
			texts = append(texts, resp.String())
		}
		switch {
		case tc.denied:
			if status.Code(err) != codes.PermissionDenied {
				t.Errorf("ListProxies %s = %v, want PERMISSION_DENIED", tc.name, err)
			}
		case err != nil || len(resp.GetProxies()) != 1:
			t.Errorf("ListProxies %s = %v, %v", tc.name, resp, err)
		case resp.GetProxies()[0].GetSpec().GetCloudInit() != tc.want:
			t.Errorf("ListProxies %s: cloud-init %q, want %q", tc.name, resp.GetProxies()[0].GetSpec().GetCloudInit(), tc.want)
		}
	}
	if _, err := admin.ListProxies(ctx, &proxyv1.ListProxiesRequest{View: 7}); status.Code(err) != codes.InvalidArgument ||
		!strings.Contains(err.Error(), "view") {
		t.Errorf("an unknown view = %v, want INVALID_ARGUMENT naming view", err)
	}

	// Watch from before the create: FULL carries the cloud-init of the
	// current generation only; BASIC never.
	watch := func(c proxyv1.ProxyServiceClient, view proxyv1.ProxyView) proxyv1.ProxyService_WatchProxiesClient {
		s, err := c.WatchProxies(ctx, &proxyv1.WatchProxiesRequest{SinceRevision: 1, View: view})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	denied := watch(viewer, full)
	if _, err := denied.Recv(); status.Code(err) != codes.PermissionDenied {
		t.Errorf("WatchProxies FULL as a viewer = %v, want PERMISSION_DENIED", err)
	}
	row := h.WaitFor("p1", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	updated, err := admin.UpdateProxy(ctx, &proxyv1.UpdateProxyRequest{Name: "p1", Spec: func() *proxyv1.ProxySpec {
		s := orchtest.Managed("p1").GetSpec()
		s.CloudInit = secret2
		return s
	}(), Generation: row.Generation})
	if err != nil {
		t.Fatal(err)
	}
	if updated.GetProxy().GetSpec().GetCloudInit() != "" {
		t.Error("UpdateProxy returned the cloud-init")
	}
	texts = append(texts, updated.String())
	fullStream, basicStream := watch(admin, full), watch(service, proxyv1.ProxyView_PROXY_VIEW_UNSPECIFIED)
	var sawNew bool
	for !sawNew {
		ev, err := fullStream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		got := ev.GetProxy().GetSpec().GetCloudInit()
		switch {
		case ev.GetProxy().GetGeneration() == updated.GetProxy().GetGeneration():
			if got != secret2 {
				t.Errorf("FULL watch, current generation: cloud-init %q, want the new one", got)
			}
			sawNew = true
		case got != "":
			t.Errorf("FULL watch, generation %d (not current) carries cloud-init %q", ev.GetProxy().GetGeneration(), got)
		}
	}
	for range 2 {
		ev, err := basicStream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if ev.GetProxy().GetSpec().GetCloudInit() != "" {
			t.Error("BASIC watch carries cloud-init")
		}
		texts = append(texts, ev.String())
	}

	deleted, err := admin.DeleteProxy(ctx, &proxyv1.DeleteProxyRequest{Name: "p1"})
	if err != nil {
		t.Fatal(err)
	}
	texts = append(texts, deleted.String())
	if _, err := viewer.DeleteProxy(ctx, &proxyv1.DeleteProxyRequest{Name: "p1"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("DeleteProxy as a viewer = %v, want PERMISSION_DENIED", err)
	}
	h.WaitGone("p1")

	for _, text := range append(texts, h.Logs.String()) {
		if strings.Contains(text, "s3cr3t") {
			t.Fatalf("cloud-init in a response, error text or log: %q", text)
		}
	}
}
