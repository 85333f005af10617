package kubernetes

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// classify turns an error of an API call (verb on resource in the
// provider's namespace) into the taxonomy, once, here:
//
//   - the context ending → Transient (a context error still matches);
//   - 404 → NotFound;
//   - 403 "exceeded quota" (a ResourceQuota) → QuotaExceeded;
//   - any other 403 → Permanent, naming the verb and resource the account
//     needs (RBAC), or the admission rule that refused (PodSecurity …);
//   - 401 → Permanent: the credentials are refused;
//   - 400, 422 (the pod is invalid), 405 → Permanent;
//   - 429, 5xx, server and client timeouts, 409 conflicts, 410 expired
//     list continuations, network errors, everything else → Transient.
func (b *Backend) classify(err error, verb, resource string) error {
	if err == nil {
		return nil
	}
	ns := b.s.cfg.Namespace
	md := []string{"verb", verb, "resource", resource, "namespace", ns}
	msg := oneLine(err.Error())
	var status apierrors.APIStatus
	if errors.As(err, &status) {
		md = append(md, "httpStatus", fmt.Sprint(status.Status().Code), "apiReason", string(apierrors.ReasonForError(err)))
	}
	class := errclass.Transient
	switch {
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return errclass.Wrap(errclass.Transient, err)
	case apierrors.IsNotFound(err):
		class = errclass.NotFound
	case apierrors.IsForbidden(err) && strings.Contains(msg, "exceeded quota"):
		class = errclass.QuotaExceeded
		msg = fmt.Sprintf("%s %s in namespace %s: a ResourceQuota is used up: %s", verb, resource, ns, msg)
	case apierrors.IsForbidden(err):
		class = errclass.Permanent
		if strings.Contains(msg, "cannot "+verb+" resource") {
			msg = fmt.Sprintf("RBAC: the provisioner's account may not %s %s in namespace %s (grant the verb in its Role): %s", verb, resource, ns, msg)
		} else {
			msg = fmt.Sprintf("%s %s in namespace %s was refused: %s", verb, resource, ns, msg)
		}
	case apierrors.IsUnauthorized(err):
		class = errclass.Permanent
		msg = "the API server refused the provisioner's credentials (401): " + msg
	case apierrors.IsInvalid(err), apierrors.IsBadRequest(err), apierrors.IsMethodNotSupported(err):
		class = errclass.Permanent
		msg = fmt.Sprintf("%s %s in namespace %s: the API server rejected the request: %s", verb, resource, ns, msg)
	case apierrors.IsTooManyRequests(err), apierrors.IsServerTimeout(err), apierrors.IsTimeout(err),
		apierrors.IsInternalError(err), apierrors.IsServiceUnavailable(err), apierrors.IsUnexpectedServerError(err),
		apierrors.IsConflict(err), apierrors.IsResourceExpired(err), apierrors.IsGone(err):
		class = errclass.Transient
	default:
		var ne net.Error
		if errors.As(err, &ne) || status == nil {
			msg = fmt.Sprintf("%s %s in namespace %s: the API server did not answer: %s", verb, resource, ns, msg)
		}
	}
	return (&errclass.Error{Class: class, Message: msg, Err: err}).WithMetadata(md...)
}
