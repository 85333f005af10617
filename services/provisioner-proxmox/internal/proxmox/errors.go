package proxmox

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// classify gives err its class, once, by the error-class table in
// docs/provisioner-proxmox.md.
// Errors that carry a class from their source (validation, the token and
// CA files, the ownership check) keep it.
//
//   - Permanent: any 4xx (401 the token, 403 a missing privilege, 400
//     parameter errors), a TLS verification failure;
//   - NotFound: 500 `Configuration file '...' does not exist` (callers
//     other than Get turn it into what they need);
//   - Transient: everything else — network errors and cancellation, 500
//     `VM is locked (...)`, every other 5xx including 595 and 596, failed
//     or overlong tasks.
func classify(err error) error {
	if err == nil {
		return nil
	}
	var ce *errclass.Error
	if errors.As(err, &ce) && ce.Class != 0 {
		return err
	}
	if isTLSVerify(err) {
		return &errclass.Error{Class: errclass.Permanent, Message: fmt.Sprintf("TLS verification failed (the url's host must be in the node certificate, signed by caFile): %v", err), Err: err}
	}
	var ae *APIError
	if errors.As(err, &ae) {
		md := []string{"httpStatus", fmt.Sprint(ae.Status)}
		switch {
		case ae.Status == 500 && isMissingConfig(ae.Message):
			return (&errclass.Error{Class: errclass.NotFound, Message: ae.Error(), Err: err}).WithMetadata(md...)
		case ae.Status >= 400 && ae.Status < 500:
			return (&errclass.Error{Class: errclass.Permanent, Message: ae.Error(), Err: err}).WithMetadata(md...)
		default:
			return (&errclass.Error{Class: errclass.Transient, Message: ae.Error(), Err: err}).WithMetadata(md...)
		}
	}
	return &errclass.Error{Class: errclass.Transient, Message: err.Error(), Err: err}
}

// notFoundAsTransient is for Create, which must never answer NotFound.
func notFoundAsTransient(err error) error {
	err = classify(err)
	if errclass.Is(err, errclass.NotFound) {
		return &errclass.Error{Class: errclass.Transient, Message: err.Error(), Err: err}
	}
	return err
}

func isMissingConfig(msg string) bool {
	return strings.HasPrefix(msg, "Configuration file ") && strings.HasSuffix(strings.TrimSpace(msg), "does not exist")
}

func isTLSVerify(err error) bool {
	var cv *tls.CertificateVerificationError
	var ua x509.UnknownAuthorityError
	var he x509.HostnameError
	var ci x509.CertificateInvalidError
	return errors.As(err, &cv) || errors.As(err, &ua) || errors.As(err, &he) || errors.As(err, &ci)
}

func apiStatus(err error) int {
	var ae *APIError
	if errors.As(err, &ae) {
		return ae.Status
	}
	return 0
}

func apiMessage(err error) string {
	var ae *APIError
	if errors.As(err, &ae) {
		return ae.Message
	}
	return ""
}

// isTimeout reports a request or wait that ran out of time.
func isTimeout(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// TaskError is a task that stopped with an exitstatus other than OK or
// WARNINGS, or did not stop within its budget.
type TaskError struct {
	UPID       string
	ExitStatus string
	TimedOut   bool
}

func (e *TaskError) Error() string {
	if e.TimedOut {
		return fmt.Sprintf("task %s did not finish within its budget; it keeps running on Proxmox", e.UPID)
	}
	return fmt.Sprintf("task %s failed: %s", e.UPID, e.ExitStatus)
}
