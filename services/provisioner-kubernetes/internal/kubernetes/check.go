package kubernetes

import (
	"context"
	"errors"
	"net"
	"strconv"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
)

// CheckTarget is the one target's name.
const CheckTarget = "apiserver"

// Check lists at most one of this provider's pods: one request with
// limit 1, the same verb, resource and namespace List and orphan GC rely
// on, so a pass means the API server answers and the account's RBAC
// still covers them (it does not prove create or delete rights). The
// server's version goes into the details when it answers. One target:
// apiserver. The runtime bounds it (the caller's deadline less a margin,
// or provisioner.DefaultCheckTimeout).
func (b *Backend) Check(ctx context.Context) []*provisionerv1.TargetStatus {
	start := time.Now()
	ts := &provisionerv1.TargetStatus{Name: CheckTarget, Details: map[string]string{"namespace": b.s.cfg.Namespace}}
	cs, err := b.clientset()
	if err == nil {
		ts.Address = b.apiHost()
		cctx, cancel := b.call(ctx)
		_, err = cs.CoreV1().Pods(b.s.cfg.Namespace).List(cctx, metav1.ListOptions{LabelSelector: b.selector(), Limit: 1})
		cancel()
	}
	ts.Latency = durationpb.New(time.Since(start))
	if err != nil {
		ts.Reason = checkReason(ctx, err)
		ts.Message = oneLine(err.Error())
		var status apierrors.APIStatus
		if errors.As(err, &status) {
			ts.Details["httpStatus"] = strconv.Itoa(int(status.Status().Code))
		}
		b.log.DebugContext(ctx, "kubernetes check failed", "reason", ts.Reason, "error", ts.Message)
		return []*provisionerv1.TargetStatus{ts}
	}
	ts.Ready, ts.Reason = true, provisioner.ReasonReachable
	// The version endpoint is open to every authenticated client; a
	// failure here does not change the verdict.
	if v, err := cs.Discovery().ServerVersion(); err == nil {
		ts.Details["serverVersion"] = v.GitVersion
	}
	return []*provisionerv1.TargetStatus{ts}
}

// checkReason maps a failed check to a reason.
func checkReason(ctx context.Context, err error) string {
	var status apierrors.APIStatus
	var ce *errclass.Error
	var ne net.Error
	switch {
	case ctx.Err() != nil, errors.Is(err, context.DeadlineExceeded),
		apierrors.IsTimeout(err), apierrors.IsServerTimeout(err), errors.As(err, &ne) && ne.Timeout():
		return provisioner.ReasonTimeout
	case apierrors.IsUnauthorized(err):
		return provisioner.ReasonUnauthorized
	case apierrors.IsForbidden(err):
		return provisioner.ReasonForbidden
	case errors.As(err, &status):
		return provisioner.ReasonAPIError
	case errors.As(err, &ce):
		return provisioner.ReasonConfigUnavailable
	default:
		return provisioner.ReasonUnreachable
	}
}
