package service

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/api/annotations"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/emptypb"

	gatewayv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/gateway/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	identityv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/identity/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
)

// rpc is one method of the suite's APIs with its REST mapping, if any.
type rpc struct {
	full      string
	streaming bool
	method    string // HTTP method; empty without a REST mapping
	path      string
	body      bool
}

var pathParam = regexp.MustCompile(`\{[^}]*\}`)

// suiteRPCs reads every RPC of every egress.* service and its
// google.api.http mapping from the compiled descriptors.
func suiteRPCs(t *testing.T) []rpc {
	t.Helper()
	var out []rpc
	protoregistry.GlobalFiles.RangeFiles(func(fd protoreflect.FileDescriptor) bool {
		if !strings.HasPrefix(string(fd.Package()), "egress.") {
			return true
		}
		for i := range fd.Services().Len() {
			sd := fd.Services().Get(i)
			for j := range sd.Methods().Len() {
				md := sd.Methods().Get(j)
				r := rpc{full: "/" + string(sd.FullName()) + "/" + string(md.Name()), streaming: md.IsStreamingServer()}
				if rule, ok := proto.GetExtension(md.Options(), annotations.E_Http).(*annotations.HttpRule); ok && rule != nil {
					switch p := rule.GetPattern().(type) {
					case *annotations.HttpRule_Get:
						r.method, r.path = http.MethodGet, p.Get
					case *annotations.HttpRule_Post:
						r.method, r.path = http.MethodPost, p.Post
					case *annotations.HttpRule_Put:
						r.method, r.path = http.MethodPut, p.Put
					case *annotations.HttpRule_Delete:
						r.method, r.path = http.MethodDelete, p.Delete
					case *annotations.HttpRule_Patch:
						r.method, r.path = http.MethodPatch, p.Patch
					}
					r.path = pathParam.ReplaceAllString(r.path, "x1")
					r.body = rule.GetBody() != ""
				}
				out = append(out, r)
			}
		}
		return true
	})
	if len(out) < 20 {
		t.Fatalf("only %d RPCs found", len(out))
	}
	return out
}

// The whole matrix, every RPC × every role and no token, over gRPC and over
// REST through the real grpc-gateway handlers: the frame's interceptors enforce the
// table in pkg/auth. The handlers are the generated Unimplemented ones, so
// a call the table allows answers UNIMPLEMENTED (HTTP 501), or
// INVALID_ARGUMENT (400) where the empty request breaks a contract rule —
// validation runs only after authorization — and any other answer is the
// authorization layer's.
func TestRoleMatrix(t *testing.T) {
	t.Parallel()
	tokens := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(tokens, []byte("ops tok-admin admin\nboard tok-viewer viewer\nfleet tok-crawler crawler\nsvc tok-service service\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := New(ctx, Options{Name: "matrix", GRPCListen: "127.0.0.1:0", HTTPListen: "127.0.0.1:0", LogLevel: "error",
		ShutdownTimeout: 5 * time.Second, Auth: &auth.Config{TokenFile: tokens}})
	if err != nil {
		t.Fatal(err)
	}
	proxyv1.RegisterProxyServiceServer(s.GRPC, proxyv1.UnimplementedProxyServiceServer{})
	proxyv1.RegisterProxyPoolServiceServer(s.GRPC, proxyv1.UnimplementedProxyPoolServiceServer{})
	leasev1.RegisterLeaseServiceServer(s.GRPC, leasev1.UnimplementedLeaseServiceServer{})
	healthv1.RegisterHealthServiceServer(s.GRPC, healthv1.UnimplementedHealthServiceServer{})
	provisionerv1.RegisterProvisionerServiceServer(s.GRPC, provisionerv1.UnimplementedProvisionerServiceServer{})
	gatewayv1.RegisterGatewayServiceServer(s.GRPC, gatewayv1.UnimplementedGatewayServiceServer{})
	s.MountREST(proxyv1.RegisterProxyServiceHandler)
	s.MountREST(proxyv1.RegisterProxyPoolServiceHandler)
	s.MountREST(leasev1.RegisterLeaseServiceHandler)
	s.MountREST(healthv1.RegisterHealthServiceHandler)
	s.MountREST(gatewayv1.RegisterGatewayServiceHandler)
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
	callGRPC := func(r rpc, token string) error {
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		defer ccancel()
		opts := []grpc.CallOption{grpc.WaitForReady(true)}
		if token != "" {
			opts = append(opts, grpc.PerRPCCredentials(auth.BearerToken(token)))
		}
		// An empty message is a valid encoding of every request.
		if !r.streaming {
			return conn.Invoke(cctx, r.full, &emptypb.Empty{}, &emptypb.Empty{}, opts...)
		}
		st, err := conn.NewStream(cctx, &grpc.StreamDesc{ServerStreams: true}, r.full, opts...)
		if err != nil {
			return err
		}
		if err := st.SendMsg(&emptypb.Empty{}); err != nil {
			return err
		}
		if err := st.CloseSend(); err != nil {
			return err
		}
		return st.RecvMsg(&emptypb.Empty{})
	}
	callREST := func(r rpc, token string) (int, string) {
		var body io.Reader
		if r.body {
			body = strings.NewReader("{}")
		}
		req, err := http.NewRequestWithContext(ctx, r.method, "http://"+s.HTTPAddr()+r.path, body)
		if err != nil {
			t.Fatal(err)
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", r.method, r.path, err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		var st struct {
			Message string `json:"message"`
			Error   struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		_ = json.Unmarshal(raw, &st)
		return resp.StatusCode, st.Message + st.Error.Message
	}

	roles := map[string]auth.Role{"tok-admin": auth.Admin, "tok-viewer": auth.Viewer, "tok-crawler": auth.Crawler, "tok-service": auth.Service}
	rest := 0
	for _, r := range suiteRPCs(t) {
		rule, ok := auth.RuleFor(r.full)
		if !ok {
			t.Errorf("%s is not in the role table", r.full)
			continue
		}
		if err := callGRPC(r, ""); status.Code(err) != codes.Unauthenticated {
			t.Errorf("gRPC %s without a token = %v, want UNAUTHENTICATED", r.full, err)
		}
		if r.method != "" {
			rest++
			if code, _ := callREST(r, ""); code != http.StatusUnauthorized {
				t.Errorf("REST %s %s without a token = %d, want 401", r.method, r.path, code)
			}
		}
		// GetIdentity is the one RPC pkg/service itself implements.
		served := r.full == identityv1.IdentityService_GetIdentity_FullMethodName
		for token, role := range roles {
			allowed := slices.Contains(rule.Roles, role)
			err := callGRPC(r, token)
			switch {
			case allowed && served && err == nil:
			case allowed && status.Code(err) != codes.Unimplemented && status.Code(err) != codes.InvalidArgument:
				t.Errorf("gRPC %s as %s = %v, want it let through (UNIMPLEMENTED, or INVALID_ARGUMENT from validation)", r.full, role, err)
			case !allowed && (status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), "needs the role")):
				t.Errorf("gRPC %s as %s = %v, want PERMISSION_DENIED naming the role", r.full, role, err)
			}
			if r.method == "" {
				continue
			}
			code, msg := callREST(r, token)
			switch {
			case allowed && served && code == http.StatusOK:
			case allowed && code != http.StatusNotImplemented && code != http.StatusBadRequest:
				t.Errorf("REST %s %s as %s = %d %q, want 501 (or 400 from validation)", r.method, r.path, role, code, msg)
			case !allowed && (code != http.StatusForbidden || !strings.Contains(msg, "needs the role "+string(rule.Roles[0]))):
				t.Errorf("REST %s %s as %s = %d %q, want 403 naming the role", r.method, r.path, role, code, msg)
			}
		}
	}
	if rest < 15 {
		t.Errorf("only %d REST routes exercised", rest)
	}
}

// gRPC reflection is off unless asked for, and a service whose gRPC server
// has a method the role table lacks refuses to run.
func TestReflectionFlagAndUncoveredMethods(t *testing.T) {
	t.Parallel()
	tokens := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(tokens, []byte("ops tok-admin admin\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, on := range []bool{false, true} {
		s, err := New(context.Background(), Options{Name: "refl", GRPCListen: "127.0.0.1:0", HTTPListen: "127.0.0.1:0",
			LogLevel: "error", Reflection: on, Auth: &auth.Config{TokenFile: tokens}})
		if err != nil {
			t.Fatal(err)
		}
		_, has := s.GRPC.GetServiceInfo()["grpc.reflection.v1.ServerReflection"]
		if has != on {
			t.Errorf("--grpc-reflection=%v: reflection served = %v", on, has)
		}
		_ = s.grpcLis.Close()
		_ = s.httpLis.Close()
	}

	s, err := New(context.Background(), Options{Name: "uncovered", GRPCListen: "127.0.0.1:0", HTTPListen: "127.0.0.1:0",
		LogLevel: "error", ShutdownTimeout: time.Second, Auth: &auth.Config{TokenFile: tokens}})
	if err != nil {
		t.Fatal(err)
	}
	testgrpc.RegisterTestServiceServer(s.GRPC, testgrpc.UnimplementedTestServiceServer{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Run(ctx); err == nil || !strings.Contains(err.Error(), "/grpc.testing.TestService/EmptyCall") {
		t.Errorf("Run with a method missing from the role table = %v, want a refusal naming it", err)
	}
}
