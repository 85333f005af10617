package api

import (
	"log/slog"
	"slices"
	"sync"

	"github.com/nats-io/nats.go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/store"
)

// WatchReadyHeader is the response header a WatchLeases stream sends once
// it is in place: every change committed after it is delivered, so a
// client lists after it has arrived and misses nothing.
const WatchReadyHeader = "x-egress-watch-ready"

// watchBuffer is how many changes a watcher may fall behind before its
// stream ends (RESOURCE_EXHAUSTED: list again and watch anew).
const watchBuffer = 4096

// Feed carries the lease changes every replica commits to every replica's
// WatchLeases streams, over core NATS: Publish sends this replica's
// changes, and one subscription per replica fans everyone's out to the
// local watchers. Nothing is stored, so a watcher that misses a message
// (NATS disconnected, or it fell behind) is ended and lists again.
type Feed struct {
	nc      *nats.Conn
	subject string
	log     *slog.Logger

	mu       sync.Mutex
	watchers map[*watcher]struct{}
	sub      *nats.Subscription
}

// NewFeed returns a feed on subject of nc; Start subscribes it.
func NewFeed(nc *nats.Conn, subject string, log *slog.Logger) *Feed {
	return &Feed{nc: nc, subject: subject, log: log, watchers: map[*watcher]struct{}{}}
}

// Start subscribes to the changes of every replica.
func (f *Feed) Start() error {
	sub, err := f.nc.Subscribe(f.subject, f.deliver)
	if err != nil {
		return err
	}
	// The slow watchers are cut by the feed itself; the subscription's
	// own buffer must not drop messages first.
	if err := sub.SetPendingLimits(-1, 64<<20); err != nil {
		return err
	}
	f.mu.Lock()
	f.sub = sub
	f.mu.Unlock()
	return nil
}

// Publish sends changes this replica committed. It runs on the commit
// path and never blocks on the network: the NATS client buffers.
func (f *Feed) Publish(cs []store.Change) {
	ev := &busv1.LeaseChangesEvent{Changes: make([]*leasev1.WatchLeasesResponse, 0, len(cs))}
	for _, c := range cs {
		ev.Changes = append(ev.Changes, change(c))
	}
	data, err := proto.Marshal(ev)
	if err == nil {
		err = f.nc.Publish(f.subject, data)
	}
	if err != nil {
		// Watchers everywhere miss these changes: end them, so they list
		// again rather than show a stale set.
		f.log.Warn("WARNING: publishing lease changes failed; ending the WatchLeases streams", "error", err)
		f.Broken("publishing lease changes failed")
	}
}

func (f *Feed) deliver(m *nats.Msg) {
	var ev busv1.LeaseChangesEvent
	if err := proto.Unmarshal(m.Data, &ev); err != nil {
		f.log.Warn("WARNING: a lease changes message does not decode; ending the WatchLeases streams", "error", err)
		f.Broken("a lease changes message could not be decoded")
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for w := range f.watchers {
		for _, c := range ev.GetChanges() {
			if !w.wants(c) {
				continue
			}
			select {
			case w.ch <- c:
				continue
			default:
			}
			w.end(status.Error(codes.ResourceExhausted, "the watch fell too far behind the lease changes; list the leases again and watch anew"))
			delete(f.watchers, w)
			break
		}
	}
}

// Broken ends every watch with UNAVAILABLE: changes were (or may have
// been) missed.
func (f *Feed) Broken(why string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for w := range f.watchers {
		w.end(status.Errorf(codes.Unavailable, "lease changes were missed (%s); list the leases again and watch anew", why))
		delete(f.watchers, w)
	}
}

type watcher struct {
	ch   chan *leasev1.WatchLeasesResponse
	done chan struct{}
	err  error
	// types and clientID are the watch's filters; empty: every change.
	types    []leasev1.LeaseChangeType
	clientID string
}

// wants reports whether c passes the watcher's filters. They apply
// before its buffer, so changes the watcher does not want never count
// against it.
func (w *watcher) wants(c *leasev1.WatchLeasesResponse) bool {
	if w.clientID != "" && c.GetLease().GetClientId() != w.clientID {
		return false
	}
	return len(w.types) == 0 || slices.Contains(w.types, c.GetType())
}

func (w *watcher) end(err error) {
	w.err = err
	close(w.done)
}

func (f *Feed) watch(req *leasev1.WatchLeasesRequest) (*watcher, error) {
	if !f.nc.IsConnected() {
		return nil, status.Error(codes.Unavailable, "lease changes are unavailable: this replica is not connected to NATS; retry")
	}
	w := &watcher{ch: make(chan *leasev1.WatchLeasesResponse, watchBuffer), done: make(chan struct{}),
		types: req.GetTypes(), clientID: req.GetClientId()}
	f.mu.Lock()
	f.watchers[w] = struct{}{}
	f.mu.Unlock()
	return w, nil
}

func (f *Feed) unwatch(w *watcher) {
	f.mu.Lock()
	delete(f.watchers, w)
	f.mu.Unlock()
}

// WatchLeases implements leasev1.LeaseServiceServer.
func (s *Server) WatchLeases(req *leasev1.WatchLeasesRequest, stream leasev1.LeaseService_WatchLeasesServer) error {
	if s.Feed == nil {
		return status.Error(codes.Unavailable, "lease changes are unavailable on this replica")
	}
	w, err := s.Feed.watch(req)
	if err != nil {
		return err
	}
	defer s.Feed.unwatch(w)
	if err := stream.SendHeader(metadata.Pairs(WatchReadyHeader, "true")); err != nil {
		return err
	}
	ctx := stream.Context()
	for {
		select {
		case <-ctx.Done():
			return nil
		case c := <-w.ch:
			if err := stream.Send(c); err != nil {
				return err
			}
		case <-w.done:
			// Deliver what arrived before the end, then say why.
			for {
				select {
				case c := <-w.ch:
					if err := stream.Send(c); err != nil {
						return err
					}
				default:
					return w.err
				}
			}
		}
	}
}

var changeTypes = map[store.ChangeType]leasev1.LeaseChangeType{
	store.Acquired: leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_ACQUIRED,
	store.Renewed:  leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RENEWED,
	store.Released: leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RELEASED,
	store.Expired:  leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_EXPIRED,
	store.Reported: leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_REPORTED,
}

func change(c store.Change) *leasev1.WatchLeasesResponse {
	l := &leasev1.Lease{LeaseId: c.Lease.ID, ClientId: c.Lease.ClientID, ProxyUid: c.Lease.ProxyUID}
	if c.Type == store.Acquired || c.Type == store.Renewed {
		l = lease(c.Lease)
	} else if !c.Lease.ExpireTime.IsZero() {
		l.ExpireTime = timestamppb.New(c.Lease.ExpireTime)
	}
	out := &leasev1.WatchLeasesResponse{Type: changeTypes[c.Type], Lease: l, ChangeTime: timestamppb.New(c.Time)}
	if c.Cooldown != nil {
		out.Cooldown = &leasev1.ProxyCooldown{ProxyUid: c.Cooldown.ProxyUID, Cooldown: cooldown(*c.Cooldown)}
	}
	return out
}
