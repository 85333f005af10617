package auth

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
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

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
	writeTokens(t, path, "# crawler fleets\ncrawler-a s3cret-a\n\ncrawler-b s3cret-b\n")
	a, err := New(Config{TokenFile: path}, quiet())
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		header     string
		wantClient string
		wantCode   codes.Code
	}{
		{"Bearer s3cret-a", "crawler-a", codes.OK},
		{"bearer s3cret-b", "crawler-b", codes.OK},
		{"", "", codes.Unauthenticated},
		{"Bearer ", "", codes.Unauthenticated},
		{"Basic s3cret-a", "", codes.Unauthenticated},
		{"Bearer nope", "", codes.Unauthenticated},
		{"Bearer crawler-a", "", codes.Unauthenticated},
	}
	for _, tc := range cases {
		client, err := a.Authenticate(tc.header)
		if status.Code(err) != tc.wantCode || client != tc.wantClient {
			t.Errorf("Authenticate(%q) = %q, %v; want %q, %v", tc.header, client, err, tc.wantClient, tc.wantCode)
		}
		if err != nil && strings.Contains(err.Error(), "s3cret") {
			t.Errorf("error reveals a token: %v", err)
		}
	}
}

func TestTokenFileRotation(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "tokens")
	writeTokens(t, path, "crawler old-token\n")
	a, err := New(Config{TokenFile: path}, quiet())
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	a.now = func() time.Time { return now }

	writeTokens(t, path, "crawler new-token-longer\n")
	// Within the one-second recheck window the old token still works.
	if _, err := a.Authenticate("Bearer old-token"); err != nil {
		t.Fatalf("old token refused inside the recheck window: %v", err)
	}
	now = now.Add(2 * time.Second)
	if _, err := a.Authenticate("Bearer old-token"); status.Code(err) != codes.Unauthenticated {
		t.Errorf("old token after rotation: %v, want Unauthenticated", err)
	}
	if c, err := a.Authenticate("Bearer new-token-longer"); err != nil || c != "crawler" {
		t.Errorf("new token: %q, %v", c, err)
	}

	// A broken rewrite keeps the last good tokens.
	writeTokens(t, path, "only-one-field-and-much-longer-than-before\n")
	now = now.Add(2 * time.Second)
	if _, err := a.Authenticate("Bearer new-token-longer"); err != nil {
		t.Errorf("a broken token file dropped the good tokens: %v", err)
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	dup := filepath.Join(dir, "dup")
	writeTokens(t, dup, "a sharedtok\nb sharedtok\n")
	empty := filepath.Join(dir, "empty")
	writeTokens(t, empty, "# nothing\n")
	cases := map[string]Config{
		"neither":        {},
		"both":           {TokenFile: dup, Disabled: true},
		"missing file":   {TokenFile: filepath.Join(dir, "absent")},
		"shared token":   {TokenFile: dup},
		"no tokens":      {TokenFile: empty},
		"malformed line": {TokenFile: func() string { p := filepath.Join(dir, "bad"); writeTokens(t, p, "a b c\n"); return p }()},
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
	if c, err := a.Authenticate(""); err != nil || c != Anonymous {
		t.Errorf("disabled: %q, %v", c, err)
	}
}

type testService struct {
	testgrpc.UnimplementedTestServiceServer
	seen chan string
}

func (s *testService) EmptyCall(ctx context.Context, _ *testgrpc.Empty) (*testgrpc.Empty, error) {
	s.seen <- ClientID(ctx)
	return &testgrpc.Empty{}, nil
}

func (s *testService) StreamingOutputCall(_ *testgrpc.StreamingOutputCallRequest, stream testgrpc.TestService_StreamingOutputCallServer) error {
	s.seen <- ClientID(stream.Context())
	return nil
}

// Over a real gRPC server: health is exempt, every other method needs a
// token, and handlers of unary and streaming calls see the client id.
func TestInterceptors(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "tokens")
	writeTokens(t, path, "crawler-a tok-a\n")
	a, err := New(Config{TokenFile: path}, quiet())
	if err != nil {
		t.Fatal(err)
	}
	svc := &testService{seen: make(chan string, 4)}
	srv := grpc.NewServer(a.ServerOptions()...)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	testgrpc.RegisterTestServiceServer(srv, svc)
	addr := grpctest.Serve(t, srv)
	dial := func(opts ...grpc.DialOption) *grpc.ClientConn { return grpctest.Dial(t, addr, opts...) }
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	anon, wrong, good := dial(), dial(grpc.WithPerRPCCredentials(BearerToken("nope"))), dial(grpc.WithPerRPCCredentials(BearerToken("tok-a")))
	if _, err := healthpb.NewHealthClient(anon).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Errorf("health Check must be exempt: %v", err)
	}
	if _, err := testgrpc.NewTestServiceClient(anon).EmptyCall(ctx, &testgrpc.Empty{}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("call without a token: %v, want Unauthenticated", err)
	}
	if _, err := testgrpc.NewTestServiceClient(wrong).EmptyCall(ctx, &testgrpc.Empty{}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("call with a wrong token: %v, want Unauthenticated", err)
	}
	if _, err := testgrpc.NewTestServiceClient(good).EmptyCall(ctx, &testgrpc.Empty{}); err != nil {
		t.Fatal(err)
	}
	if got := <-svc.seen; got != "crawler-a" {
		t.Errorf("unary handler saw client %q", got)
	}
	stream, err := testgrpc.NewTestServiceClient(good).StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != io.EOF {
		t.Fatalf("stream: %v", err)
	}
	if got := <-svc.seen; got != "crawler-a" {
		t.Errorf("stream handler saw client %q", got)
	}
	if len(svc.seen) != 0 {
		t.Errorf("rejected calls reached the handler")
	}
}
