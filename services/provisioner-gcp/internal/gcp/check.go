package gcp

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	compute "cloud.google.com/go/compute/apiv1"
	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/api/googleapi"
	"google.golang.org/api/iterator"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
)

// Check asks the project for one page of at most one managed instance:
// exactly one request whatever the project's size, exercising the
// credentials, the Compute API being enabled and compute.instances.list,
// which orphan GC needs. One target: the project. The runtime bounds it
// (the caller's deadline less a margin, or provisioner.DefaultCheckTimeout).
func (be *Backend) Check(ctx context.Context) []*provisionerv1.TargetStatus {
	start := time.Now()
	ts := &provisionerv1.TargetStatus{Name: be.cfg.Project, Address: be.address(), Details: map[string]string{}}
	// The SDK's aggregated list ignores the context (only the client's
	// request timeout ends it), so the check stops waiting on its own.
	done := make(chan error, 1)
	be.probes.Add(1)
	go func() {
		defer be.probes.Done()
		done <- be.probe(ctx)
	}()
	var err error
	select {
	case err = <-done:
	case <-ctx.Done():
		err = ctx.Err()
	}
	ts.Latency = durationpb.New(time.Since(start))
	if err != nil {
		ts.Reason = checkReason(ctx, err)
		ts.Message = err.Error()
		var gerr *googleapi.Error
		if errors.As(err, &gerr) {
			ts.Details["httpStatus"] = strconv.Itoa(gerr.Code)
			for _, e := range gerr.Errors {
				if e.Reason != "" {
					ts.Details["reason"] = e.Reason
					break
				}
			}
		}
		be.log.DebugContext(ctx, "gcp check failed", "reason", ts.Reason, "error", err.Error())
		return []*provisionerv1.TargetStatus{ts}
	}
	ts.Ready, ts.Reason = true, provisioner.ReasonReachable
	return []*provisionerv1.TargetStatus{ts}
}

func (be *Backend) address() string {
	if be.cfg.Endpoint != "" {
		return be.cfg.Endpoint
	}
	return "compute.googleapis.com"
}

// probe fetches the first page only: the iterator would follow
// nextPageToken through the whole project, since maxResults is only the
// page size.
func (be *Backend) probe(ctx context.Context) error {
	c, err := be.client(ctx)
	if err != nil {
		return err
	}
	it := c.instances.AggregatedList(ctx, &computepb.AggregatedListInstancesRequest{
		Project:    be.cfg.Project,
		Filter:     proto.String(managedFilter),
		MaxResults: proto.Uint32(1),
	})
	var page []compute.InstancesScopedListPair
	_, err = iterator.NewPager(it, 1, "").NextPage(&page)
	return err
}

// checkReason maps a failed probe to a reason: the context ending is
// Timeout; an API answer 401 Unauthorized, 403 Forbidden (a missing
// permission or the Compute API disabled in the project), any other
// APIError; credentials that could not be loaded CredentialsUnavailable;
// anything else, a token that could not be fetched included, Unreachable.
func checkReason(ctx context.Context, err error) string {
	var gerr *googleapi.Error
	var ce *errclass.Error
	switch {
	case ctx.Err() != nil, errors.Is(err, context.DeadlineExceeded):
		return provisioner.ReasonTimeout
	case errors.As(err, &gerr):
		switch gerr.Code {
		case http.StatusUnauthorized:
			return provisioner.ReasonUnauthorized
		case http.StatusForbidden:
			return provisioner.ReasonForbidden
		}
		return provisioner.ReasonAPIError
	case errors.As(err, &ce):
		return provisioner.ReasonCredentialsUnavailable
	default:
		return provisioner.ReasonUnreachable
	}
}
