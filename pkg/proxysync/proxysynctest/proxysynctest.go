// Package proxysynctest is an orchestrator's paged ListProxies held in
// memory, for measuring a consumer's resync (lease, health) apart from the
// orchestrator.
package proxysynctest

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/proxysync"
)

// Listing answers ListProxies a page of proxysync.PageSize at a time, as
// the orchestrator does. Each page is kept in its wire encoding and
// decoded per call, so a consumer's resync pays for decoding as it would
// over gRPC.
type Listing struct {
	pages    [][]byte
	revision atomic.Int64
}

// NewListing holds proxies, listed at revision.
func NewListing(proxies []*proxyv1.Proxy, revision int64) (*Listing, error) {
	l := &Listing{}
	l.revision.Store(revision)
	for from := 0; from < len(proxies); from += proxysync.PageSize {
		to := min(from+proxysync.PageSize, len(proxies))
		resp := &proxyv1.ListProxiesResponse{Proxies: proxies[from:to]}
		if to < len(proxies) {
			resp.NextPageToken = strconv.Itoa(len(l.pages) + 1)
		}
		raw, err := proto.Marshal(resp)
		if err != nil {
			return nil, err
		}
		l.pages = append(l.pages, raw)
	}
	return l, nil
}

// SetRevision makes later listings reflect revision (the same proxies at
// a newer state of the orchestrator).
func (l *Listing) SetRevision(revision int64) { l.revision.Store(revision) }

// ListProxies implements proxysync.Lister.
func (l *Listing) ListProxies(_ context.Context, req *proxyv1.ListProxiesRequest, _ ...grpc.CallOption) (*proxyv1.ListProxiesResponse, error) {
	page := 0
	if t := req.GetPageToken(); t != "" {
		var err error
		if page, err = strconv.Atoi(t); err != nil || page < 0 || page >= len(l.pages) {
			return nil, fmt.Errorf("page token %q: no such page", t)
		}
	}
	resp := &proxyv1.ListProxiesResponse{}
	if len(l.pages) > 0 {
		if err := proto.Unmarshal(l.pages[page], resp); err != nil {
			return nil, err
		}
	}
	resp.Revision = l.revision.Load()
	return resp, nil
}

// Server serves a Listing as the orchestrator's ProxyService (ListProxies
// only), for a consumer running as a process of its own.
type Server struct {
	proxyv1.UnimplementedProxyServiceServer
	Listing *Listing
}

// ListProxies implements proxyv1.ProxyServiceServer.
func (s Server) ListProxies(ctx context.Context, req *proxyv1.ListProxiesRequest) (*proxyv1.ListProxiesResponse, error) {
	return s.Listing.ListProxies(ctx, req)
}

// BenchSizes are the pool sizes a resync benchmark runs at: the positive
// numbers in BENCH_RESYNC_SIZES, or 10,000.
func BenchSizes(tb testing.TB) []int {
	v := os.Getenv("BENCH_RESYNC_SIZES")
	if v == "" {
		return []int{10000}
	}
	var sizes []int
	for _, f := range strings.Fields(v) {
		n, err := strconv.Atoi(f)
		if err != nil || n <= 0 {
			tb.Fatalf("BENCH_RESYNC_SIZES: %q is not a positive number", f)
		}
		sizes = append(sizes, n)
	}
	return sizes
}

// HeapInUse is the live Go heap after a collection.
func HeapInUse() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapInuse)
}
