package main

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/proxytest"
)

// orchestrator serves ListProxies from a set the test changes, checking
// the bearer token; one page per call of at most pageSize proxies.
type orchestrator struct {
	proxyv1.UnimplementedProxyServiceServer
	token string

	mu       sync.Mutex
	revision int64
	proxies  []*proxyv1.Proxy
	calls    int
}

func (o *orchestrator) ListProxies(ctx context.Context, req *proxyv1.ListProxiesRequest) (*proxyv1.ListProxiesResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer "+o.token {
		return nil, status.Error(codes.Unauthenticated, "invalid bearer token")
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.calls++
	return &proxyv1.ListProxiesResponse{Proxies: o.proxies, Revision: o.revision}, nil
}

func (o *orchestrator) set(revision int64, proxies ...*proxyv1.Proxy) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.revision, o.proxies = revision, proxies
}

func (o *orchestrator) callCount() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.calls
}

// TestResyncFromTheOrchestrator: health learns proxies from the
// orchestrator's listing as well as from events, and stops probing those
// the listing no longer has, even after a reset of the orchestrator's
// database (the listing's revisions start again far below the events').
func TestResyncFromTheOrchestrator(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := proxytest.StartProxy(t, proxytest.Behaviour{})
	b := proxytest.StartProxy(t, proxytest.Behaviour{})
	c := proxytest.StartProxy(t, proxytest.Behaviour{})

	orch := &orchestrator{token: "orchestrator-token-for-health"}
	orch.set(500, external(t, "uid-listed", "listed", a.Addr()))
	gs := grpc.NewServer()
	proxyv1.RegisterProxyServiceServer(gs, orch)
	orchAddr := grpctest.Serve(t, gs)
	tokenFile := filepath.Join(e.dir, "orchestrator-token")
	if err := os.WriteFile(tokenFile, []byte(orch.token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	_, addrs := servicetest.Start(t, ".", e.args("replica-a",
		"--orchestrator-addr="+orchAddr, "--orchestrator-token-file="+tokenFile, "--resync-interval=1s"))
	base := "http://" + addrs.HTTP
	probed := func(name string) bool {
		var one struct {
			Health struct {
				VerdictKnown bool `json:"verdictKnown"`
			} `json:"health"`
		}
		return getJSON(t, base+"/v1/health/proxies/"+name, &one) == http.StatusOK && one.Health.VerdictKnown
	}
	// Learnt from the listing alone, no event for it.
	waittest.For(t, 30*time.Second, "the listed proxy probed", func() bool { return probed("listed") })
	// Learnt from its event, and in the listing too.
	e.publish(t, proxyv1.ChangeType_CHANGE_TYPE_CREATED, external(t, "uid-evented", "evented", b.Addr()))
	orch.set(501, external(t, "uid-listed", "listed", a.Addr()), external(t, "uid-evented", "evented", b.Addr()))
	waittest.For(t, 30*time.Second, "the proxy from its event probed", func() bool { return probed("evented") })

	// The orchestrator's database is reset: one new proxy, revision 2.
	orch.set(2, external(t, "uid-after-reset", "after-reset", c.Addr()))
	waittest.For(t, 30*time.Second, "the proxy created after the reset probed", func() bool { return probed("after-reset") })
	waittest.For(t, 30*time.Second, "the proxies the orchestrator no longer has are no longer probed", func() bool {
		return getJSON(t, base+"/v1/health/proxies/listed", nil) == http.StatusNotFound &&
			getJSON(t, base+"/v1/health/proxies/evented", nil) == http.StatusNotFound
	})
	// The first call is the resync at start; the reset was seen by a
	// periodic one.
	if n := orch.callCount(); n < 2 {
		t.Errorf("%d ListProxies calls, want the periodic resyncs", n)
	}
}
