// Package proxysync is how a service that keeps its own view of the proxies
// (lease, health) checks it against the orchestrator: the paged
// ProxyService.ListProxies listing and the loop that runs a resync at start, periodically and on
// request, retrying a failed one with backoff. Events keep a view current;
// a resync repairs what events missed (an outage, a reset of the
// orchestrator's database).
package proxysync

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// Lister is the part of the orchestrator's ProxyService a resync uses.
type Lister interface {
	ListProxies(ctx context.Context, req *proxyv1.ListProxiesRequest, opts ...grpc.CallOption) (*proxyv1.ListProxiesResponse, error)
}

// PageSize is how many proxies one ListProxies call asks for.
const PageSize = 1000

// Revision is the revision a listed proxy is applied at: that of its own
// last change when the orchestrator says it, so that a proxy unchanged
// since a consumer stored it is recognised as the one stored, and the
// page's otherwise.
func Revision(p *proxyv1.Proxy, page int64) int64 {
	if r := p.GetRevision(); r > 0 && r <= page {
		return r
	}
	return page
}

// List pages through every proxy the orchestrator holds, handing each page
// to page with the store revision that page reflects. It returns the
// lowest revision of all pages: a proxy missing from the listing whose
// state a consumer learnt at an older revision was deleted meanwhile.
func List(ctx context.Context, l Lister, page func(proxies []*proxyv1.Proxy, revision int64) error) (int64, error) {
	var lowest int64
	req := &proxyv1.ListProxiesRequest{PageSize: PageSize}
	for {
		resp, err := l.ListProxies(ctx, req)
		if err != nil {
			return 0, fmt.Errorf("listing proxies from the orchestrator: %s: %s", status.Code(err), status.Convert(err).Message())
		}
		if lowest == 0 || resp.GetRevision() < lowest {
			lowest = resp.GetRevision()
		}
		if err := page(resp.GetProxies(), resp.GetRevision()); err != nil {
			return 0, err
		}
		if resp.GetNextPageToken() == "" {
			return lowest, nil
		}
		req.PageToken = resp.GetNextPageToken()
	}
}

// Loop runs Resync at start, every Interval (0: never) and whenever
// Request is called, until its context ends; a failed resync is retried
// with backoff (1s doubling to 1m). Requests while one runs coalesce into
// one more.
type Loop struct {
	Resync   func(ctx context.Context) error
	Interval time.Duration
	// What names the view in logs ("the pool", "the probed proxies").
	What string
	Log  *slog.Logger

	once    sync.Once
	request chan struct{}

	mu   sync.Mutex
	done int
}

func (l *Loop) init() { l.once.Do(func() { l.request = make(chan struct{}, 1) }) }

// Request asks for a resync soon.
func (l *Loop) Request(reason string) {
	l.init()
	select {
	case l.request <- struct{}{}:
		l.Log.Info("resync requested", "of", l.What, "reason", reason)
	default:
	}
}

// Done is how many resyncs have succeeded.
func (l *Loop) Done() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.done
}

// Once runs one resync now (the one a service runs before it serves, or
// the loop's), counting it when it succeeds.
func (l *Loop) Once(ctx context.Context) error {
	if err := l.Resync(ctx); err != nil {
		return err
	}
	l.mu.Lock()
	l.done++
	l.mu.Unlock()
	return nil
}

// Run resyncs until ctx ends.
func (l *Loop) Run(ctx context.Context) {
	l.init()
	if l.Done() == 0 {
		l.Request("start")
	}
	var tick <-chan time.Time
	if l.Interval > 0 {
		t := time.NewTicker(l.Interval)
		defer t.Stop()
		tick = t.C
	}
	retryIn := &backoff.ExponentialBackOff{InitialInterval: time.Second, Multiplier: 2, MaxInterval: time.Minute}
	var retry <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick:
		case <-l.request:
		case <-retry:
		}
		retry = nil
		if err := l.Once(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			wait := retryIn.NextBackOff()
			l.Log.Warn("WARNING: resync from the orchestrator failed; retrying", "of", l.What, "error", err, "retry_in", wait)
			retry = time.After(wait)
			continue
		}
		retryIn.Reset()
	}
}
