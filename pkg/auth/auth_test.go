package auth

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
)

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func writeTokens(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestAuthenticate(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "tokens")
	writeTokens(t, path, "# crawler fleets\ncrawler-a s3cret-a crawler\n\ncrawler-b s3cret-b crawler,viewer\n")
	a, err := New(Config{TokenFile: path}, quiet())
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		header     string
		wantClient string
		wantRoles  []Role
		wantCode   codes.Code
	}{
		{"Bearer s3cret-a", "crawler-a", []Role{Crawler}, codes.OK},
		{"bearer s3cret-b", "crawler-b", []Role{Crawler, Viewer}, codes.OK},
		{"", "", nil, codes.Unauthenticated},
		{"Bearer ", "", nil, codes.Unauthenticated},
		{"Basic s3cret-a", "", nil, codes.Unauthenticated},
		{"Bearer nope", "", nil, codes.Unauthenticated},
		{"Bearer crawler-a", "", nil, codes.Unauthenticated},
	}
	for _, tc := range cases {
		id, err := a.Authenticate(tc.header)
		if status.Code(err) != tc.wantCode || id.ClientID != tc.wantClient || !slices.Equal(id.Roles, tc.wantRoles) {
			t.Errorf("Authenticate(%q) = %+v, %v; want %q %v, %v", tc.header, id, err, tc.wantClient, tc.wantRoles, tc.wantCode)
		}
		if err != nil && strings.Contains(err.Error(), "s3cret") {
			t.Errorf("error reveals a token: %v", err)
		}
	}
}

func TestTokenFileRotation(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "tokens")
	writeTokens(t, path, "crawler old-token crawler\n")
	var logs strings.Builder
	a, err := New(Config{TokenFile: path}, slog.New(slog.NewTextHandler(&syncWriter{w: &logs}, nil)))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	a.tokens.Now = func() time.Time { return now }

	writeTokens(t, path, "crawler new-token-longer crawler\n")
	// Within the one-second recheck window the old token still works.
	if _, err := a.Authenticate("Bearer old-token"); err != nil {
		t.Fatalf("old token refused inside the recheck window: %v", err)
	}
	now = now.Add(2 * time.Second)
	if _, err := a.Authenticate("Bearer old-token"); status.Code(err) != codes.Unauthenticated {
		t.Errorf("old token after rotation: %v, want Unauthenticated", err)
	}
	if id, err := a.Authenticate("Bearer new-token-longer"); err != nil || id.ClientID != "crawler" {
		t.Errorf("new token: %+v, %v", id, err)
	}

	// A broken rewrite keeps the last good tokens.
	// A broken rewrite keeps the last good tokens, with a WARNING.
	writeTokens(t, path, "only-one-field-and-much-longer-than-before\n")
	now = now.Add(2 * time.Second)
	if _, err := a.Authenticate("Bearer new-token-longer"); err != nil {
		t.Errorf("a broken token file dropped the good tokens: %v", err)
	}
	if !strings.Contains(logs.String(), "WARNING: the token file cannot be used") {
		t.Errorf("no WARNING for the broken token file: %q", logs.String())
	}

	// Rotating a role: the same token, another role.
	writeTokens(t, path, "crawler new-token-longer viewer\n")
	now = now.Add(2 * time.Second)
	if id, err := a.Authenticate("Bearer new-token-longer"); err != nil || !slices.Equal(id.Roles, []Role{Viewer}) {
		t.Errorf("after a role change: %+v, %v", id, err)
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	dup := filepath.Join(dir, "dup")
	writeTokens(t, dup, "a sharedtok admin\nb sharedtok viewer\n")
	file := func(name, content string) string {
		p := filepath.Join(dir, name)
		writeTokens(t, p, content)
		return p
	}
	empty := filepath.Join(dir, "empty")
	writeTokens(t, empty, "# nothing\n")
	cases := map[string]Config{
		"neither":        {},
		"both":           {TokenFile: dup, Disabled: true},
		"missing file":   {TokenFile: filepath.Join(dir, "absent")},
		"shared token":   {TokenFile: dup},
		"no tokens":      {TokenFile: empty},
		"malformed line": {TokenFile: file("bad", "a b c d\n")},
		"unknown role":   {TokenFile: file("role", "a sharedtok root\n")},
		"empty role":     {TokenFile: file("norole", "a sharedtok admin,\n")},
		// The format before roles: refused rather than guessed.
		"no roles": {TokenFile: file("old", "a sharedtok\n")},
	}
	for name, cfg := range cases {
		if _, err := New(cfg, quiet()); err == nil {
			t.Errorf("%s: New succeeded", name)
		} else if strings.Contains(err.Error(), "sharedtok") {
			t.Errorf("%s: error reveals a token: %v", name, err)
		}
	}
}

func TestDisabledWarnsLoudly(t *testing.T) {
	t.Parallel()
	var buf strings.Builder
	a, err := New(Config{Disabled: true}, slog.New(slog.NewTextHandler(&buf, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(buf.String(), "WARNING: authentication is disabled") || !strings.Contains(buf.String(), "level=WARN") {
		t.Errorf("no loud warning: %q", buf.String())
	}
	if id, err := a.Authenticate(""); err != nil || id.ClientID != Anonymous || !slices.Equal(id.Roles, AllRoles()) {
		t.Errorf("disabled: %+v, %v", id, err)
	}
}

type leaseService struct {
	leasev1.UnimplementedLeaseServiceServer
	seen chan Identity
}

func (s *leaseService) ListProxies(ctx context.Context, _ *leasev1.ListProxiesRequest) (*leasev1.ListProxiesResponse, error) {
	s.seen <- identity(ctx)
	return &leasev1.ListProxiesResponse{}, nil
}

type healthService struct {
	healthv1.UnimplementedHealthServiceServer
	seen chan Identity
}

func (s *healthService) WatchProxyHealth(_ *healthv1.WatchProxyHealthRequest, stream healthv1.HealthService_WatchProxyHealthServer) error {
	s.seen <- identity(stream.Context())
	return nil
}

func identity(ctx context.Context) Identity {
	id, _ := ctx.Value(identityKey{}).(Identity)
	return id
}

// testService is a gRPC service the role table does not know.
type testService struct {
	testgrpc.UnimplementedTestServiceServer
}

func (testService) EmptyCall(context.Context, *testgrpc.Empty) (*testgrpc.Empty, error) {
	return &testgrpc.Empty{}, nil
}

// Over a real gRPC server: health is exempt, every other method needs a
// token and a role the table grants, handlers of unary and streaming calls
// see the caller, and a method missing from the table is denied.
func TestInterceptors(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "tokens")
	writeTokens(t, path, "crawler-a tok-a crawler\nops tok-ops viewer,admin\n")
	a, err := New(Config{TokenFile: path}, quiet())
	if err != nil {
		t.Fatal(err)
	}
	lease, hs := &leaseService{seen: make(chan Identity, 4)}, &healthService{seen: make(chan Identity, 4)}
	srv := grpc.NewServer(a.ServerOptions()...)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	leasev1.RegisterLeaseServiceServer(srv, lease)
	healthv1.RegisterHealthServiceServer(srv, hs)
	testgrpc.RegisterTestServiceServer(srv, testService{})
	addr := grpctest.Serve(t, srv)
	dial := func(opts ...grpc.DialOption) *grpc.ClientConn { return grpctest.Dial(t, addr, opts...) }
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	anon, wrong := dial(), dial(grpc.WithPerRPCCredentials(BearerToken("nope")))
	crawler, ops := dial(grpc.WithPerRPCCredentials(BearerToken("tok-a"))), dial(grpc.WithPerRPCCredentials(BearerToken("tok-ops")))
	if _, err := healthpb.NewHealthClient(anon).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Errorf("health Check must be exempt: %v", err)
	}
	for name, conn := range map[string]*grpc.ClientConn{"without a token": anon, "with a wrong token": wrong} {
		if _, err := leasev1.NewLeaseServiceClient(conn).ListProxies(ctx, &leasev1.ListProxiesRequest{}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("call %s: %v, want Unauthenticated", name, err)
		}
	}
	if _, err := leasev1.NewLeaseServiceClient(crawler).ListProxies(ctx, &leasev1.ListProxiesRequest{}); err != nil {
		t.Fatal(err)
	}
	if got := <-lease.seen; got.ClientID != "crawler-a" || !slices.Equal(got.Roles, []Role{Crawler}) {
		t.Errorf("unary handler saw %+v", got)
	}

	// A streaming call without the role: denied, naming the roles needed.
	stream, err := healthv1.NewHealthServiceClient(crawler).WatchProxyHealth(ctx, &healthv1.WatchProxyHealthRequest{})
	if err == nil {
		_, err = stream.Recv()
	}
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), "needs the role admin or viewer") {
		t.Errorf("WatchProxyHealth as a crawler: %v, want PermissionDenied naming admin or viewer", err)
	}
	stream, err = healthv1.NewHealthServiceClient(ops).WatchProxyHealth(ctx, &healthv1.WatchProxyHealthRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != io.EOF {
		t.Fatalf("stream: %v", err)
	}
	if got := <-hs.seen; got.ClientID != "ops" || !got.Has(Admin) || !got.Has(Viewer) {
		t.Errorf("stream handler saw %+v", got)
	}

	// Not in the table: nobody, whatever the roles.
	if _, err := testgrpc.NewTestServiceClient(ops).EmptyCall(ctx, &testgrpc.Empty{}); status.Code(err) != codes.PermissionDenied ||
		!strings.Contains(err.Error(), "not in the role table") {
		t.Errorf("a method missing from the table: %v, want PermissionDenied", err)
	}
	if len(lease.seen)+len(hs.seen) != 0 {
		t.Errorf("rejected calls reached the handler")
	}
	if err := CheckCovered(srv.GetServiceInfo()); err == nil || !strings.Contains(err.Error(), "/grpc.testing.TestService/EmptyCall") {
		t.Errorf("CheckCovered with an unknown service = %v, want it named", err)
	}
}

// syncWriter serialises writes of concurrent log lines.
type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}
