package mirror_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	lt "github.com/egress-proxies/egress-proxies/services/lease/internal/leasetest"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/metrics"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/mirror"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/store"
)

const (
	uidA = "aaaaaaaa-0000-4000-8000-000000000001"
	uidB = "bbbbbbbb-0000-4000-8000-000000000002"
)

// listing is an orchestrator whose ListProxies answers one page.
type listing []*proxyv1.Proxy

func (l listing) ListProxies(context.Context, *proxyv1.ListProxiesRequest, ...grpc.CallOption) (*proxyv1.ListProxiesResponse, error) {
	return &proxyv1.ListProxiesResponse{Proxies: l, Revision: 10}, nil
}

// TestRunWaitsOutNATS: the syncer starting while NATS is down does not
// stop the service: it resyncs from the orchestrator without waiting for
// NATS, keeps setting up its consumers, and once NATS is back follows the
// events.
func TestRunWaitsOutNATS(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	nsrv := natstest.New(t)
	names := bus.Names{Prefix: "pooltest"}
	js := nsrv.JetStream(t)
	if err := bus.EnsureStreams(ctx, js, names); err != nil {
		t.Fatal(err)
	}
	db, err := pgxpool.New(ctx, lt.Database(t))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	st := store.New(db, store.Config{DefaultMaxLeases: 1})
	var logs logtest.Buffer
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the syncer's log:\n%s", logs.String())
		}
	})
	log := slog.New(slog.NewTextHandler(&logs, nil))
	syncer := mirror.New(st, js, mirror.Config{Names: names, Lister: listing{lt.Proxy(uidA, "proxy-a")}},
		metrics.New(prometheus.NewRegistry(), st, log), log)

	nsrv.Stop()
	done := make(chan error, 1)
	go func() { done <- syncer.Run(ctx) }()
	// Setting up the consumers fails once the JetStream request times out.
	waittest.For(t, 30*time.Second, "the failed set-up is logged", func() bool {
		return strings.Contains(logs.String(), "consuming the proxy mirror's event streams failed") || len(done) > 0
	})
	if len(done) > 0 {
		t.Fatalf("Run returned %v while NATS was down, want it to wait", <-done)
	}
	leasable := func(uid string) bool {
		var ok bool
		_ = db.QueryRow(ctx, `SELECT leasable FROM lease.proxies WHERE uid = $1`, uid).Scan(&ok)
		return ok
	}
	waittest.For(t, 30*time.Second, "the mirror resynced while NATS is down", func() bool {
		return syncer.Resyncs() > 0 && leasable(uidA)
	})
	nsrv.Start(t)
	lt.PublishProxy(t, nsrv, names.Prefix, proxyv1.ChangeType_CHANGE_TYPE_CREATED, lt.Proxy(uidB, "proxy-b"), 11)
	waittest.For(t, 30*time.Second, "proxy-b's event applied", func() bool { return leasable(uidB) })
	if len(done) > 0 {
		t.Fatalf("Run returned %v after NATS came back, want it to keep running", <-done)
	}
}

// A resync applies each listed proxy at the revision of its own last
// change: one stored at that revision is left as it is, whatever the
// listing's revision, and one whose revision the orchestrator does not
// say is applied at the listing's.
func TestResyncAppliesEachProxyAtItsOwnRevision(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := pgxpool.New(ctx, lt.Database(t))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	st := store.New(db, store.Config{DefaultMaxLeases: 1})
	a := lt.Proxy(uidA, "proxy-a")
	a.Revision = 5
	state, err := mirror.FromProxy(a, false)
	if err != nil {
		t.Fatal(err)
	}
	if applied, err := st.ApplyProxy(ctx, state, 5); err != nil || !applied {
		t.Fatalf("storing proxy-a at revision 5: %v, %v", applied, err)
	}
	log := slog.New(slog.DiscardHandler)
	syncer := mirror.New(st, nil, mirror.Config{Lister: listing{a, lt.Proxy(uidB, "proxy-b")}},
		metrics.New(prometheus.NewRegistry(), st, log), log)
	if err := syncer.Resync(ctx); err != nil {
		t.Fatal(err)
	}
	stored := func(uid string) (revision int64, xact string) {
		if err := db.QueryRow(ctx, `SELECT revision, applied_xact::text FROM lease.proxies WHERE uid = $1`, uid).Scan(&revision, &xact); err != nil {
			t.Fatal(err)
		}
		return revision, xact
	}
	revA, xactA := stored(uidA)
	if revA != 5 {
		t.Errorf("proxy-a, unchanged since revision 5: stored at %d after a resync at 10", revA)
	}
	if revB, _ := stored(uidB); revB != 10 {
		t.Errorf("proxy-b, listed without its own revision: stored at %d, want the listing's 10", revB)
	}
	if err := syncer.Resync(ctx); err != nil {
		t.Fatal(err)
	}
	if _, again := stored(uidA); again != xactA {
		t.Errorf("proxy-a was written again by a second resync (transaction %s, then %s)", xactA, again)
	}
}
