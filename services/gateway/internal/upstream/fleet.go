package upstream

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
)

// WatchReadyHeader is the header a WatchLeases stream sends once it is in
// place (the lease service's contract): what is listed after it arrived
// misses no change.
const WatchReadyHeader = "x-egress-watch-ready"

// Cooldowns is the fleet's cooldowns as the gateway knows them: proxy uid
// → target host ("" for every target) → when the cooldown ends.
type Cooldowns struct {
	mu sync.Mutex
	m  map[string]map[string]time.Time
}

// normHost is a target host as the lease service compares it.
func normHost(h string) string { return strings.TrimSuffix(strings.ToLower(h), ".") }

// Set records a cooldown of proxy uid for target ("": every target) until
// until; a longer one already known stays.
func (c *Cooldowns) Set(uid, target string, until time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]map[string]time.Time{}
	}
	byTarget := c.m[uid]
	if byTarget == nil {
		byTarget = map[string]time.Time{}
		c.m[uid] = byTarget
	}
	target = normHost(target)
	if until.After(byTarget[target]) {
		byTarget[target] = until
	}
}

// Cooling reports whether proxy uid cools down at now for target or for
// every target.
func (c *Cooldowns) Cooling(uid, target string, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	byTarget := c.m[uid]
	if byTarget == nil {
		return false
	}
	return now.Before(byTarget[""]) || target != "" && now.Before(byTarget[normHost(target)])
}

// prune forgets the cooldowns over at now.
func (c *Cooldowns) prune(now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for uid, byTarget := range c.m {
		for t, until := range byTarget {
			if !now.Before(until) {
				delete(byTarget, t)
			}
		}
		if len(byTarget) == 0 {
			delete(c.m, uid)
		}
	}
}

// setFrom records the cooldown of a report or a listing.
func (c *Cooldowns) setFrom(pc *leasev1.ProxyCooldown) {
	cd := pc.GetCooldown()
	if pc.GetProxyUid() == "" || cd.GetExpireTime() == nil {
		return
	}
	c.Set(pc.GetProxyUid(), cd.GetTargetHost(), cd.GetExpireTime().AsTime())
}

// Fleet is the gateway's view of the fleet, fed by two WatchLeases
// streams: every client's reports (the cooldowns they start) and the
// gateway's own leases that ended elsewhere (a session moved by another
// replica, a lease swept at its expiry). It is trusted only while both
// streams are in place; a stream that ends makes it untrusted until it is
// open again and the cooldowns are listed anew.
type Fleet struct {
	Client leasev1.LeaseServiceClient
	// CallTimeout bounds each listing call.
	CallTimeout time.Duration
	Log         *slog.Logger
	// Ended is told of each of the gateway's leases that ended.
	Ended func(leaseID string)

	Cooldowns Cooldowns

	reportsUp atomic.Bool
	endsUp    atomic.Bool
	// trustedSince is when the view last became trusted (unix nanos): a
	// lease confirmed before it may have ended while a stream was down.
	trustedSince atomic.Int64
	clientID     chan string
	clientOnce   sync.Once
	knownClient  atomic.Bool
}

// NewFleet returns a fleet view on client; Run feeds it.
func NewFleet(client leasev1.LeaseServiceClient, callTimeout time.Duration, log *slog.Logger) *Fleet {
	return &Fleet{Client: client, CallTimeout: callTimeout, Log: log, clientID: make(chan string, 1)}
}

// Trusted reports whether both streams are in place, and since when.
func (f *Fleet) Trusted() (bool, time.Time) {
	if !f.reportsUp.Load() || !f.endsUp.Load() {
		return false, time.Time{}
	}
	return true, time.Unix(0, f.trustedSince.Load())
}

// LearnClient tells the fleet the client id the lease service knows the
// gateway by (from a lease it granted): the stream of ended leases
// follows that client's.
func (f *Fleet) LearnClient(id string) {
	if id == "" || f.knownClient.Load() {
		return
	}
	f.clientOnce.Do(func() {
		f.knownClient.Store(true)
		f.clientID <- id
	})
}

// Run keeps both streams open until ctx ends, reconnecting with backoff.
func (f *Fleet) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() {
		f.keep(ctx, "reports", &f.reportsUp, &leasev1.WatchLeasesRequest{
			Types: []leasev1.LeaseChangeType{leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_REPORTED},
		}, f.listCooldowns, func(c *leasev1.WatchLeasesResponse) {
			if c.GetCooldown() != nil {
				f.Cooldowns.setFrom(c.GetCooldown())
			}
		})
	})
	wg.Go(func() {
		var id string
		select {
		case <-ctx.Done():
			return
		case id = <-f.clientID:
		}
		f.keep(ctx, "ended leases", &f.endsUp, &leasev1.WatchLeasesRequest{
			ClientId: id,
			Types: []leasev1.LeaseChangeType{
				leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RELEASED, leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_EXPIRED,
			},
		}, nil, func(c *leasev1.WatchLeasesResponse) {
			if f.Ended != nil {
				f.Ended(c.GetLease().GetLeaseId())
			}
		})
	})
	wg.Go(func() {
		t := time.NewTicker(time.Minute)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case now := <-t.C:
				f.Cooldowns.prune(now)
			}
		}
	})
	wg.Wait()
}

// keep holds one stream open: watch, wait for the ready header, list
// (when list is set), mark it up, apply its changes; when it ends, mark it
// down and open it again after a backoff.
func (f *Fleet) keep(ctx context.Context, name string, up *atomic.Bool, req *leasev1.WatchLeasesRequest,
	list func(context.Context) error, apply func(*leasev1.WatchLeasesResponse)) {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := f.follow(ctx, up, req, list, apply, func() { backoff = 100 * time.Millisecond })
		up.Store(false)
		if ctx.Err() != nil {
			return
		}
		f.Log.Warn("WARNING: a lease watch of the gateway's fleet view ended; leasing per request until it is back",
			"watch", name, "error", status.Convert(err).Message(), "retry_in", backoff)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

func (f *Fleet) follow(ctx context.Context, up *atomic.Bool, req *leasev1.WatchLeasesRequest,
	list func(context.Context) error, apply func(*leasev1.WatchLeasesResponse), healthy func()) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := f.Client.WatchLeases(wctx, req)
	if err != nil {
		return err
	}
	hdr, err := stream.Header()
	if err != nil {
		return err
	}
	if len(hdr.Get(WatchReadyHeader)) == 0 {
		// The stream ended before it was in place: its status says why.
		_, err := stream.Recv()
		if err == nil {
			err = status.Error(codes.Unavailable, "the watch sent no ready header")
		}
		return err
	}
	if list != nil {
		if err := list(ctx); err != nil {
			return err
		}
	}
	f.trustedSince.Store(time.Now().UnixNano())
	up.Store(true)
	healthy()
	for {
		c, err := stream.Recv()
		if err != nil {
			return err
		}
		apply(c)
	}
}

// listCooldowns reads every cooldown in force, page by page.
func (f *Fleet) listCooldowns(ctx context.Context) error {
	token := ""
	for {
		cctx, cancel := context.WithTimeout(ctx, f.CallTimeout)
		resp, err := f.Client.ListCooldowns(cctx, &leasev1.ListCooldownsRequest{PageSize: 1000, PageToken: token})
		cancel()
		if err != nil {
			return err
		}
		for _, pc := range resp.GetCooldowns() {
			f.Cooldowns.setFrom(pc)
		}
		if token = resp.GetNextPageToken(); token == "" {
			return nil
		}
	}
}
