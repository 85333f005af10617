package gcp

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"strconv"
	"strings"
	"time"

	"cloud.google.com/go/compute/apiv1/computepb"
	"github.com/googleapis/gax-go/v2"
	"google.golang.org/api/googleapi"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// quotaReasons are the error reasons (synchronous errors[].reason) and
// codes (operation error codes) that mean "out of quota or capacity":
// QuotaExceeded, so the orchestrator retries with its slower backoff.
var quotaReasons = map[string]bool{
	"QUOTA_EXCEEDED":                            true,
	"quotaExceeded":                             true,
	"rateLimitExceeded":                         true,
	"userRateLimitExceeded":                     true,
	"RESOURCE_EXHAUSTED":                        true,
	"ZONE_RESOURCE_POOL_EXHAUSTED":              true,
	"ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS": true,
}

// transientReasons are 4xx reasons that clear by themselves.
var transientReasons = map[string]bool{
	"resourceNotReady":               true,
	"RESOURCE_NOT_READY":             true,
	"resourceInUseByAnotherResource": true,
}

// classify gives an API error its class, once, from the HTTP code and the
// error reasons the SDK's googleapi.Error carries (apierror.APIError wraps
// it; its own Reason is empty for Compute):
//
//   - 404 → NotFound;
//   - a quota or capacity reason (quotaExceeded, rateLimitExceeded,
//     QUOTA_EXCEEDED, ZONE_RESOURCE_POOL_EXHAUSTED, …) or 429 →
//     QuotaExceeded;
//   - resourceNotReady, resourceInUseByAnotherResource, 409 (other than
//     alreadyExists, which Create handles) and 412 → Transient: another
//     operation holds the resource;
//   - any other 4xx (400 bad request, 401 credentials, 403 permission or
//     a disabled API) → Permanent;
//   - 5xx, network errors and everything unrecognised → Transient.
//
// Context cancellation and deadlines keep their own errors; an error that
// already has a class keeps it.
func classify(err error) error {
	if err == nil {
		return nil
	}
	var ce *errclass.Error
	if errors.As(err, &ce) && ce.Class != 0 {
		return err
	}
	if errors.Is(err, context.Canceled) {
		return err
	}
	var gerr *googleapi.Error
	if !errors.As(err, &gerr) {
		if errors.Is(err, context.DeadlineExceeded) {
			return &errclass.Error{Class: errclass.Transient, Message: "gcp request timed out: " + err.Error(), Err: err}
		}
		return &errclass.Error{Class: errclass.Transient, Message: err.Error(), Err: err}
	}
	reasons := make([]string, 0, len(gerr.Errors))
	for _, e := range gerr.Errors {
		reasons = append(reasons, e.Reason)
	}
	return classOf(gerr.Code, reasons, apiMessage(gerr), err)
}

func classOf(code int, reasons []string, msg string, cause error) error {
	md := []string{"httpStatus", strconv.Itoa(code)}
	if len(reasons) > 0 {
		md = append(md, "reason", strings.Join(reasons, ","))
	}
	class := errclass.Transient
	switch {
	case anyIn(reasons, quotaReasons):
		class = errclass.QuotaExceeded
	case code == http.StatusNotFound:
		class = errclass.NotFound
	case code == http.StatusTooManyRequests:
		class = errclass.QuotaExceeded
	case anyIn(reasons, transientReasons), code == http.StatusConflict, code == http.StatusPreconditionFailed:
		class = errclass.Transient
	case code >= 400 && code < 500:
		class = errclass.Permanent
	}
	return (&errclass.Error{Class: class, Message: msg, Err: cause}).WithMetadata(md...)
}

func anyIn(reasons []string, set map[string]bool) bool {
	for _, r := range reasons {
		if set[r] {
			return true
		}
	}
	return false
}

// apiMessage is the API's own text with its code, never the request.
func apiMessage(gerr *googleapi.Error) string {
	msg := gerr.Message
	if msg == "" && len(gerr.Errors) > 0 {
		msg = gerr.Errors[0].Message
	}
	if msg == "" {
		msg = http.StatusText(gerr.Code)
	}
	return fmt.Sprintf("gcp: %d %s", gerr.Code, msg)
}

// operationError classifies a finished operation's failure from its error
// codes (QUOTA_EXCEEDED, ZONE_RESOURCE_POOL_EXHAUSTED, …) and its HTTP
// status; nil when the operation did not fail.
func operationError(op *computepb.Operation) error {
	if op.GetError() == nil || len(op.GetError().GetErrors()) == 0 {
		if code := op.GetHttpErrorStatusCode(); code >= 400 {
			return classOf(int(code), nil, fmt.Sprintf("gcp: operation %s failed: %d %s", op.GetName(), code, op.GetHttpErrorMessage()), nil)
		}
		return nil
	}
	var codes, msgs []string
	for _, e := range op.GetError().GetErrors() {
		codes = append(codes, e.GetCode())
		msgs = append(msgs, e.GetCode()+": "+e.GetMessage())
	}
	code := int(op.GetHttpErrorStatusCode())
	if code == 0 {
		code = http.StatusBadRequest
	}
	err := classOf(code, codes, fmt.Sprintf("gcp: operation %s (%s) failed: %s", op.GetName(), op.GetOperationType(), strings.Join(msgs, "; ")), nil)
	var ce *errclass.Error
	if errors.As(err, &ce) {
		return ce.WithMetadata("operation", op.GetName())
	}
	return err
}

// notFoundAsTransient is for Create, which must never answer NotFound.
// The API's status and reason stay in the metadata.
func notFoundAsTransient(err error) error {
	err = classify(err)
	var ce *errclass.Error
	if errors.As(err, &ce) && ce.Class == errclass.NotFound {
		out := *ce
		out.Class, out.Metadata, out.Err = errclass.Transient, maps.Clone(ce.Metadata), err
		return &out
	}
	return err
}

// retried runs one read of Compute (a Get, an operation poll), which the
// SDK retries on 503 and 504 until the request's deadline, and classifies
// its error. A read that its deadline ended while retrying says what
// Compute last answered, with that answer's status and reason.
func (be *Backend) retried(ctx context.Context, read func(ctx context.Context, opt gax.CallOption) error) error {
	cctx, cancel := be.call(ctx)
	defer cancel()
	var last error
	opt := gax.WithRetry(func() gax.Retryer {
		return &recorder{inner: readRetryer(), last: &last}
	})
	err := read(cctx, opt)
	if err == nil {
		return nil
	}
	if last == nil || !errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil {
		return classify(err)
	}
	var ce *errclass.Error
	if !errors.As(classify(last), &ce) {
		return classify(err)
	}
	return &errclass.Error{Class: errclass.Transient, Message: "gcp request timed out retrying; Compute last answered " + ce.Message,
		Metadata: maps.Clone(ce.Metadata), Err: err}
}

// readRetryer is the SDK's own retry policy for Compute's reads.
func readRetryer() gax.Retryer {
	return gax.OnHTTPCodes(gax.Backoff{Initial: 100 * time.Millisecond, Max: time.Minute, Multiplier: 1.3},
		http.StatusGatewayTimeout, http.StatusServiceUnavailable)
}

// recorder is a Retryer that keeps the last error it was asked about.
type recorder struct {
	inner gax.Retryer
	last  *error
}

func (r *recorder) Retry(err error) (time.Duration, bool) {
	*r.last = err
	return r.inner.Retry(err)
}
