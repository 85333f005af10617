package upstream

import (
	"context"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
)

// watchServer speaks WatchLeases and ListCooldowns as the lease service
// does: the ready header first, then the changes; a stream ended with
// the code the test sends on its end channel.
type watchServer struct {
	leasev1.UnimplementedLeaseServiceServer

	mu       sync.Mutex
	listed   int
	cooldown []*leasev1.ProxyCooldown
	reqs     []*leasev1.WatchLeasesRequest
	streams  map[leasev1.LeaseChangeType]chan *leasev1.WatchLeasesResponse
	end      map[leasev1.LeaseChangeType]chan codes.Code
}

func (s *watchServer) ListCooldowns(context.Context, *leasev1.ListCooldownsRequest) (*leasev1.ListCooldownsResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.listed++
	return &leasev1.ListCooldownsResponse{Cooldowns: s.cooldown}, nil
}

func (s *watchServer) WatchLeases(req *leasev1.WatchLeasesRequest, stream leasev1.LeaseService_WatchLeasesServer) error {
	s.mu.Lock()
	s.reqs = append(s.reqs, req)
	ch := s.streams[req.GetTypes()[0]]
	end := s.end[req.GetTypes()[0]]
	s.mu.Unlock()
	if err := stream.SendHeader(metadata.Pairs(WatchReadyHeader, "true")); err != nil {
		return err
	}
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case c := <-ch:
			if err := stream.Send(c); err != nil {
				return err
			}
		case code := <-end:
			return status.Error(code, "changes were missed")
		}
	}
}

func (s *watchServer) listCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.listed
}

func cooldownOf(uid, target string) *leasev1.ProxyCooldown {
	return &leasev1.ProxyCooldown{ProxyUid: uid, Cooldown: &leasev1.Cooldown{
		TargetHost: target, ExpireTime: timestamppb.New(time.Now().Add(time.Minute))}}
}

// The fleet view lists the cooldowns after its watch is in place, applies
// every report, follows the gateway's own ended leases once it knows its
// client id, and is untrusted from the moment a stream ends until it is
// back and listed again.
func TestFleetFollowsTheWatches(t *testing.T) {
	t.Parallel()
	srv := &watchServer{
		cooldown: []*leasev1.ProxyCooldown{cooldownOf("uid-1", "listed.example")},
		streams: map[leasev1.LeaseChangeType]chan *leasev1.WatchLeasesResponse{
			leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_REPORTED: make(chan *leasev1.WatchLeasesResponse),
			leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RELEASED: make(chan *leasev1.WatchLeasesResponse),
		},
		end: map[leasev1.LeaseChangeType]chan codes.Code{
			leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_REPORTED: make(chan codes.Code),
			leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RELEASED: make(chan codes.Code),
		},
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	leasev1.RegisterLeaseServiceServer(gs, srv)
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	f := NewFleet(leasev1.NewLeaseServiceClient(conn), time.Second, slog.New(slog.DiscardHandler))
	ended := make(chan string, 1)
	f.Ended = func(id string) { ended <- id }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f.Run(ctx) }()
	defer func() { cancel(); <-done }()

	waitFor(t, "the reports watch and the listing", func() bool { return f.reportsUp.Load() })
	if ok, _ := f.Trusted(); ok {
		t.Fatal("trusted before the watch of ended leases is in place")
	}
	if !f.Cooldowns.Cooling("uid-1", "listed.example", time.Now()) {
		t.Error("a listed cooldown is not in the table")
	}
	f.LearnClient("gw")
	waitFor(t, "the view to be trusted", func() bool { ok, _ := f.Trusted(); return ok })
	srv.mu.Lock()
	for _, r := range srv.reqs {
		if r.GetTypes()[0] == leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RELEASED && r.GetClientId() != "gw" {
			t.Errorf("the ended-leases watch asked for client %q, want gw", r.GetClientId())
		}
	}
	srv.mu.Unlock()

	srv.streams[leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_REPORTED] <- &leasev1.WatchLeasesResponse{
		Type: leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_REPORTED, Cooldown: cooldownOf("uid-2", "")}
	waitFor(t, "the watched global cooldown", func() bool { return f.Cooldowns.Cooling("uid-2", "any.example", time.Now()) })
	if f.Cooldowns.Cooling("uid-1", "other.example", time.Now()) {
		t.Error("a cooldown for one target applies to another")
	}
	srv.streams[leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RELEASED] <- &leasev1.WatchLeasesResponse{
		Type: leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_RELEASED, Lease: &leasev1.Lease{LeaseId: "lease-9"}}
	if id := <-ended; id != "lease-9" {
		t.Errorf("ended %q, want lease-9", id)
	}

	// The reports stream ends (the lease service's watcher fell behind):
	// trusted again only after a reconnect and a new listing.
	_, before := f.Trusted()
	listed := srv.listCount()
	srv.end[leasev1.LeaseChangeType_LEASE_CHANGE_TYPE_REPORTED] <- codes.ResourceExhausted
	waitFor(t, "the view to be untrusted and trusted again after a new listing", func() bool {
		ok, since := f.Trusted()
		return ok && since.After(before) && srv.listCount() > listed
	})
}
