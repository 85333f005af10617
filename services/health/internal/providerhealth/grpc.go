package providerhealth

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
)

// GRPCChecker checks a provider through its provisioner's
// ProvisionerService.CheckBackend.
type GRPCChecker struct {
	Provider string
	// Address of the provisioner, for the verdict when it cannot be
	// reached.
	Address string
	Client  provisionerv1.ProvisionerServiceClient
}

// NewGRPCChecker returns a checker over conn.
func NewGRPCChecker(provider, address string, conn grpc.ClientConnInterface) *GRPCChecker {
	return &GRPCChecker{Provider: provider, Address: address, Client: provisionerv1.NewProvisionerServiceClient(conn)}
}

// Check asks the provisioner. UNIMPLEMENTED means the backend has no check.
// When the provisioner itself cannot answer, the verdict is one target,
// "provisioner", not ready: the backend cannot be checked, which an
// operator must see as clearly as a dead backend.
func (c *GRPCChecker) Check(ctx context.Context) ([]TargetStatus, error) {
	start := time.Now()
	resp, err := c.Client.CheckBackend(ctx, &provisionerv1.CheckBackendRequest{Provider: c.Provider})
	if err != nil {
		st, _ := status.FromError(err)
		if st.Code() == codes.Unimplemented {
			return nil, ErrNotImplemented
		}
		reason := "Unreachable"
		switch {
		case st.Code() == codes.DeadlineExceeded || errors.Is(ctx.Err(), context.DeadlineExceeded):
			reason = "Timeout"
		case st.Code() == codes.Unavailable:
			reason = "Unreachable"
		default:
			reason = "APIError"
		}
		return []TargetStatus{{
			Name: "provisioner", Address: c.Address, Reason: reason,
			Message: "CheckBackend: " + st.Message(), Latency: time.Since(start),
		}}, nil
	}
	out := make([]TargetStatus, 0, len(resp.GetTargets()))
	for _, t := range resp.GetTargets() {
		out = append(out, TargetStatus{
			Name: t.GetName(), Address: t.GetAddress(), Ready: t.GetReady(), Reason: t.GetReason(),
			Message: t.GetMessage(), Latency: t.GetLatency().AsDuration(), Details: t.GetDetails(),
		})
	}
	return out, nil
}
