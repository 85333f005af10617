package proxmox

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
)

// API requests are child spans of the operation's span, and none is
// started outside one; no span carries the token.
func TestAPIRequestsAreTracedUnderTheOperation(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	b := testBudgets()
	be, err := New("pve", e.cfg, slog.New(slog.DiscardHandler), Options{Budgets: &b, TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	in, err := be.Create(context.Background(), createReq("7ace0000-0000-4000-8000-000000000001"))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(rec.Ended()); n != 0 {
		t.Fatalf("%d spans without a parent", n)
	}
	ctx, parent := tp.Tracer("test").Start(context.Background(), "provisioner.get")
	if _, err := be.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: in.GetProxyUid()}); err != nil {
		t.Fatal(err)
	}
	parent.End()
	var children int
	for _, s := range rec.Ended() {
		if s.Name() == "provisioner.get" {
			continue
		}
		if !strings.HasPrefix(s.Name(), "HTTP ") && !strings.HasPrefix(s.Name(), "GET") {
			t.Errorf("unexpected span %q", s.Name())
		}
		if s.Parent().SpanID() != parent.SpanContext().SpanID() {
			t.Errorf("span %q is not a child of the operation", s.Name())
		}
		for _, a := range s.Attributes() {
			if strings.Contains(a.Value.Emit(), tokenSecret) {
				t.Errorf("span %q attribute %s carries the token", s.Name(), a.Key)
			}
		}
		children++
	}
	if children != 4 {
		t.Errorf("%d request spans under a Get, want 4", children)
	}
}
