package kvm

import (
	"context"
	"errors"
	"os"
	"strings"

	libvirt "github.com/digitalocean/go-libvirt"
	"golang.org/x/crypto/ssh/knownhosts"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
)

// classify gives err its class, once, at the edge (docs/provisioner-kvm.md
// has the table):
//
//   - already classified here (bad placement, key material, checksum) → kept
//   - libvirt: no domain (42), no volume (50) → NotFound; no pool (49),
//     unsupported configuration (67), XML error (27), invalid argument (8),
//     unsupported (3, 84), auth failed (45), access denied (88) → Permanent;
//     any other libvirt error → Transient
//   - SSH: host key unknown or changed, key not authorised → Permanent;
//     dial failures, a refused socket forward, a dropped link → Transient
//
// libvirt reports no quota signal, so nothing is QuotaExceeded.
func classify(err error) error {
	if err == nil || isClassified(err) {
		return err
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	var lerr libvirt.Error
	if errors.As(err, &lerr) {
		switch libvirt.ErrorNumber(lerr.Code) {
		case libvirt.ErrNoDomain, libvirt.ErrNoStorageVol:
			return errclass.Wrap(errclass.NotFound, err)
		case libvirt.ErrNoStoragePool, libvirt.ErrConfigUnsupported, libvirt.ErrXMLError, libvirt.ErrInvalidArg,
			libvirt.ErrNoSupport, libvirt.ErrOperationUnsupported, libvirt.ErrAuthFailed, libvirt.ErrAccessDenied:
			return errclass.Wrap(errclass.Permanent, err)
		default:
			return errclass.Wrap(errclass.Transient, err)
		}
	}
	if isHostKeyError(err) || isAuthError(err) {
		return errclass.Wrap(errclass.Permanent, err)
	}
	return errclass.Wrap(errclass.Transient, err)
}

func isHostKeyError(err error) bool {
	var ke *knownhosts.KeyError
	var re *knownhosts.RevokedError
	return errors.As(err, &ke) || errors.As(err, &re)
}

// isAuthError recognises x/crypto/ssh's authentication failure, which has
// no type of its own.
func isAuthError(err error) bool {
	var de *dialError
	return errors.As(err, &de) && de.stage == stageSSHHandshake && strings.Contains(err.Error(), "unable to authenticate")
}

func isLibvirtError(err error) bool {
	var lerr libvirt.Error
	return errors.As(err, &lerr)
}

// isClassified reports whether err already carries a class given here, a
// verdict rather than a transport failure.
func isClassified(err error) bool {
	var e *errclass.Error
	return errors.As(err, &e)
}

func hasCode(err error, code libvirt.ErrorNumber) bool {
	var lerr libvirt.Error
	return errors.As(err, &lerr) && libvirt.ErrorNumber(lerr.Code) == code
}

// checkReason names where a failed check broke. The dial stage wins over a
// timeout, except for a handshake that ran out of time: a host that
// accepts the connection and then says nothing is hung (Timeout), not
// refusing our keys or socket, and the message still names the stage.
func checkReason(err error) string {
	var de *dialError
	if errors.As(err, &de) {
		timedOut := errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded)
		switch {
		case de.stage == stageSSHMaterial:
			return provisioner.ReasonSSHMaterialUnavailable
		case (de.stage == stageSSHHandshake || de.stage == stageLibvirtConnect) && timedOut:
			return provisioner.ReasonTimeout
		case de.stage == stageSSHHandshake:
			return provisioner.ReasonSSHHandshakeFailed
		case de.stage == stageLibvirtConnect:
			return provisioner.ReasonLibvirtConnectFailed
		default:
			return provisioner.ReasonUnreachable
		}
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled), errors.Is(err, errProbeBusy):
		return provisioner.ReasonTimeout
	case hasCode(err, libvirt.ErrNoStoragePool):
		return provisioner.ReasonPoolNotFound
	case isLibvirtError(err):
		return provisioner.ReasonLibvirtError
	default:
		return provisioner.ReasonUnreachable
	}
}
