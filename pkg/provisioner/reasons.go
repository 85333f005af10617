package provisioner

import (
	"slices"
	"strings"
)

// The reasons of a backend check's verdict (TargetStatus.reason), declared
// here once for every backend: health, dashboards and alerts read them as
// they are, so a backend names a failure with one of these, never with a
// literal of its own. A new reason is added here, to CheckReasons and to
// the table in docs/provisioner-runtime.md.
const (
	// ReasonReachable: the check passed (the only reason of a ready target).
	ReasonReachable = "Reachable"
	// ReasonUnreachable: nothing answered (connection refused, no route,
	// the link died mid-check).
	ReasonUnreachable = "Unreachable"
	// ReasonTimeout: no answer within the check's time, the caller's
	// deadline included.
	ReasonTimeout = "Timeout"
	// ReasonUnauthorized: the backend refused the credentials.
	ReasonUnauthorized = "Unauthorized"
	// ReasonForbidden: the credentials lack a permission the check needs.
	ReasonForbidden = "Forbidden"
	// ReasonAPIError: the backend answered with an error nothing else
	// names.
	ReasonAPIError = "APIError"
	// ReasonCredentialsUnavailable: the credentials file is missing,
	// unreadable or not what it must be (Proxmox token, GCP key).
	ReasonCredentialsUnavailable = "CredentialsUnavailable"
	// ReasonConfigUnavailable: the client configuration (a kubeconfig, the
	// in-cluster account) cannot be loaded.
	ReasonConfigUnavailable = "ConfigUnavailable"
	// ReasonCertificateInvalid: the backend's TLS certificate does not
	// verify against the configured CA (Proxmox).
	ReasonCertificateInvalid = "CertificateInvalid"
	// ReasonStorageNotFound: the storage the seeds go to is missing,
	// inactive or holds no ISO content (Proxmox).
	ReasonStorageNotFound = "StorageNotFound"
	// ReasonTemplateNotFound: a configured template does not exist
	// (Proxmox).
	ReasonTemplateNotFound = "TemplateNotFound"
	// ReasonSSHMaterialUnavailable: the SSH key or known_hosts file is
	// missing or not parseable (KVM).
	ReasonSSHMaterialUnavailable = "SSHMaterialUnavailable"
	// ReasonSSHHandshakeFailed: the host key is unknown or changed, or the
	// key is not authorised (KVM).
	ReasonSSHHandshakeFailed = "SSHHandshakeFailed"
	// ReasonLibvirtConnectFailed: SSH worked, libvirtd's socket did not
	// (KVM).
	ReasonLibvirtConnectFailed = "LibvirtConnectFailed"
	// ReasonLibvirtError: any other libvirt error (KVM).
	ReasonLibvirtError = "LibvirtError"
	// ReasonPoolNotFound: the storage pool does not exist (KVM).
	ReasonPoolNotFound = "PoolNotFound"
	// ReasonPoolNotActive: the storage pool exists but does not run (KVM).
	ReasonPoolNotActive = "PoolNotActive"
	// ReasonStateDirNotWritable: the state directory cannot be written
	// (local).
	ReasonStateDirNotWritable = "StateDirNotWritable"
	// ReasonProxyMissing: the proxy program is not there (local).
	ReasonProxyMissing = "ProxyMissing"
)

// CheckReasons are every declared reason, in the order above.
var CheckReasons = []string{
	ReasonReachable, ReasonUnreachable, ReasonTimeout, ReasonUnauthorized, ReasonForbidden, ReasonAPIError,
	ReasonCredentialsUnavailable, ReasonConfigUnavailable, ReasonCertificateInvalid, ReasonStorageNotFound,
	ReasonTemplateNotFound, ReasonSSHMaterialUnavailable, ReasonSSHHandshakeFailed, ReasonLibvirtConnectFailed,
	ReasonLibvirtError, ReasonPoolNotFound, ReasonPoolNotActive, ReasonStateDirNotWritable, ReasonProxyMissing,
}

// IsCheckReason reports whether reason is declared above.
func IsCheckReason(reason string) bool { return slices.Contains(CheckReasons, reason) }

// MaxCheckMessage bounds TargetStatus.message, in characters; the runtime
// cuts a longer one.
const MaxCheckMessage = 1024

// truncateMessage cuts s to MaxCheckMessage characters, ending in "..."
// when it cut, and makes it valid UTF-8: a backend's text is copied as it
// came, and an invalid sequence would make the whole answer fail to encode.
func truncateMessage(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	r := []rune(s)
	if len(r) <= MaxCheckMessage {
		return s
	}
	return string(r[:MaxCheckMessage-3]) + "..."
}
