package main_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
)

// errBackOff tells the crawler to wait before trying the target again.
var errBackOff = errors.New("no proxy available for this target now")

// fetch is one crawler request through a leased proxy: acquire for the
// target, fetch, report how the target answered, release.
func fetch(ctx context.Context, leases leasev1.LeaseServiceClient, target, page string) (*http.Response, error) {
	resp, err := leases.AcquireLease(ctx, &leasev1.AcquireLeaseRequest{
		TargetHost: target,
		Ttl:        durationpb.New(2 * time.Minute),
	})
	if status.Code(err) == codes.ResourceExhausted {
		return nil, errBackOff // every matching proxy is busy or cooling down for target
	}
	if err != nil {
		return nil, err
	}
	l := resp.GetLease()
	defer func() {
		_, _ = leases.ReleaseLease(context.WithoutCancel(ctx), &leasev1.ReleaseLeaseRequest{LeaseId: l.GetLeaseId()})
	}()

	a := l.GetAddress()
	proxy := &url.URL{Scheme: a.GetScheme(), Host: net.JoinHostPort(a.GetHost(), strconv.Itoa(int(a.GetPort())))}
	client := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(proxy)}, Timeout: 30 * time.Second}
	res, err := client.Get(page)

	outcome := leasev1.Outcome_OUTCOME_SUCCESS
	var timeout interface{ Timeout() bool }
	switch {
	case errors.As(err, &timeout) && timeout.Timeout():
		outcome = leasev1.Outcome_OUTCOME_TIMEOUT
	case err != nil:
		outcome = leasev1.Outcome_OUTCOME_ERROR
	case res.StatusCode == http.StatusForbidden:
		outcome = leasev1.Outcome_OUTCOME_BLOCKED
	case res.StatusCode == http.StatusTooManyRequests:
		outcome = leasev1.Outcome_OUTCOME_BANNED
	}
	// The default cooldown for the outcome keeps this proxy away from the
	// target (or from every target) for a while.
	_, _ = leases.ReportOutcome(ctx, &leasev1.ReportOutcomeRequest{LeaseId: l.GetLeaseId(), Outcome: outcome})
	return res, err
}

// A crawler talking to the lease service over gRPC with its bearer token.
// (Compiled, not run: it needs a lease service and proxies.)
func Example_crawler() {
	conn, err := grpc.NewClient("lease:8110",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(auth.BearerToken(os.Getenv("LEASE_TOKEN"))),
		// Fixed flow-control windows: no bandwidth-probing pings between
		// the thousands of small calls a fleet makes.
		grpc.WithInitialWindowSize(1<<20), grpc.WithInitialConnWindowSize(1<<20))
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	leases := leasev1.NewLeaseServiceClient(conn)

	res, err := fetch(context.Background(), leases, "shop.example.com", "https://shop.example.com/catalog")
	if err == nil {
		res.Body.Close()
	}
}
