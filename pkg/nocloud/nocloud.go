// Package nocloud builds cloud-init NoCloud seed images: an ISO 9660 volume
// labelled "cidata" holding user-data, meta-data and, when there is any,
// vendor-data. The Proxmox and KVM provisioners attach it to a VM as a
// CD-ROM; cloud-init's NoCloud datasource finds it by its label.
//
// user-data is the proxy's cloud-init byte for byte: it is never parsed or
// re-rendered. meta-data carries the instance id, the hostname and, when
// the proxy has credentials, MetaKeyProxyUser and MetaKeyProxyPassword. vendor-data carries the guest-agent install script (a shell
// script, so a proxy's own packages: cannot shadow it) and, when both are
// set, the operator's extra vendor-data joined with it as a MIME multipart.
//
// The image is staged in a private temporary directory that is removed
// before BuildSeedISO returns, and built in memory. Nothing here logs.
package nocloud

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	"github.com/kdomanski/iso9660"
	"go.yaml.in/yaml/v3"
)

// Label is the volume label cloud-init's NoCloud datasource looks for.
const Label = "cidata"

// Seed is what goes on one seed image.
type Seed struct {
	// InstanceID becomes meta-data's instance-id; cloud-init runs its
	// per-instance modules once per id.
	InstanceID string
	// Hostname becomes meta-data's local-hostname.
	Hostname string
	// UserData is written byte for byte as user-data.
	UserData []byte
	// InstallGuestAgent adds GuestAgentScript to vendor-data.
	InstallGuestAgent bool
	// VendorData is extra vendor-data (any cloud-init format). With
	// InstallGuestAgent it becomes the second part of a MIME multipart.
	VendorData []byte
	// ProxyUser and ProxyPassword are the proxy's credentials, which its
	// Squid must demand; empty: it has none. They become meta-data's
	// MetaKeyProxyUser and MetaKeyProxyPassword. Secret: never logged.
	ProxyUser, ProxyPassword string
}

// The meta-data keys of a proxy's credentials, which the proxy's
// cloud-init reads: in a `## template: jinja` user-data as
// {{ ds.meta_data.egress_proxy_user }} and
// {{ ds.meta_data.egress_proxy_password }}. The GCE backend uses the same
// names for its instance metadata keys. Absent when the proxy has no
// credentials.
const (
	MetaKeyProxyUser     = "egress_proxy_user"
	MetaKeyProxyPassword = "egress_proxy_password"
)

// GuestAgentScript installs and starts qemu-guest-agent with whatever
// package manager and init system the guest has. It is idempotent: a guest
// that already runs the agent is left as it is.
const GuestAgentScript = `#!/bin/sh
# Installs and starts qemu-guest-agent (egress-proxies vendor-data).
if ! command -v qemu-ga >/dev/null 2>&1 && [ ! -x /usr/bin/qemu-ga ] && [ ! -x /usr/sbin/qemu-ga ]; then
  if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -y || true
    apt-get install -y qemu-guest-agent
  elif command -v dnf >/dev/null 2>&1; then
    dnf install -y qemu-guest-agent
  elif command -v yum >/dev/null 2>&1; then
    yum install -y qemu-guest-agent
  elif command -v zypper >/dev/null 2>&1; then
    zypper --non-interactive install qemu-guest-agent
  elif command -v apk >/dev/null 2>&1; then
    apk add --no-cache qemu-guest-agent
  else
    echo "qemu-guest-agent: no known package manager" >&2
    exit 1
  fi
fi
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  systemctl enable qemu-guest-agent >/dev/null 2>&1 || true
  systemctl start qemu-guest-agent
elif command -v rc-service >/dev/null 2>&1; then
  rc-update add qemu-guest-agent default >/dev/null 2>&1 || true
  rc-service qemu-guest-agent start || rc-service qemu-guest-agent status
fi
`

// MetaData renders the meta-data document of s: instance-id,
// local-hostname and, when s has credentials, MetaKeyProxyUser and
// MetaKeyProxyPassword as YAML double-quoted strings (every character
// other than a printable ASCII one, '"' and '\\' escaped), so that any
// value reads back as itself.
func MetaData(s Seed) []byte {
	out := fmt.Appendf(nil, "instance-id: %s\nlocal-hostname: %s\n", s.InstanceID, s.Hostname)
	if s.ProxyUser != "" || s.ProxyPassword != "" {
		out = fmt.Appendf(out, "%s: %s\n%s: %s\n", MetaKeyProxyUser, yamlQuote(s.ProxyUser), MetaKeyProxyPassword, yamlQuote(s.ProxyPassword))
	}
	return out
}

// yamlQuote is v as a YAML double-quoted scalar.
func yamlQuote(v string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range v {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r >= 0x20 && r < 0x7f:
			b.WriteRune(r)
		case r <= 0xffff:
			fmt.Fprintf(&b, "\\u%04x", r)
		default:
			fmt.Fprintf(&b, "\\U%08x", r)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// VendorData renders the vendor-data document, or nil when there is none:
// the agent script alone, the extra vendor-data alone, or both as a MIME
// multipart (boundary random, so it cannot occur in either part).
func VendorData(installGuestAgent bool, extra []byte) ([]byte, error) {
	switch {
	case installGuestAgent && len(extra) > 0:
		var b [16]byte
		if _, err := rand.Read(b[:]); err != nil {
			return nil, err
		}
		boundary := "==egress-proxies-" + hex.EncodeToString(b[:]) + "=="
		var out bytes.Buffer
		fmt.Fprintf(&out, "Content-Type: multipart/mixed; boundary=\"%s\"\nMIME-Version: 1.0\n\n", boundary)
		fmt.Fprintf(&out, "--%s\nContent-Type: text/x-shellscript; charset=\"utf-8\"\nMIME-Version: 1.0\nContent-Disposition: attachment; filename=\"install-guest-agent.sh\"\n\n%s\n", boundary, GuestAgentScript)
		fmt.Fprintf(&out, "--%s\nContent-Type: %s; charset=\"utf-8\"\nMIME-Version: 1.0\nContent-Disposition: attachment; filename=\"vendor-data\"\n\n%s\n", boundary, partType(extra), extra)
		fmt.Fprintf(&out, "--%s--\n", boundary)
		return out.Bytes(), nil
	case installGuestAgent:
		return []byte(GuestAgentScript), nil
	case len(extra) > 0:
		return extra, nil
	}
	return nil, nil
}

// partType guesses the MIME type cloud-init expects for a vendor-data part
// from its first line, as cloud-init itself does for a bare document.
func partType(b []byte) string {
	first, _, _ := strings.Cut(string(b), "\n")
	first = strings.TrimSpace(first)
	switch {
	case strings.HasPrefix(first, "#cloud-config"):
		return "text/cloud-config"
	case strings.HasPrefix(first, "#!"):
		return "text/x-shellscript"
	case strings.HasPrefix(first, "#cloud-boothook"):
		return "text/cloud-boothook"
	case strings.HasPrefix(first, "#include"):
		return "text/x-include-url"
	}
	return "text/plain"
}

// BuildSeedISO returns the seed image for s.
func BuildSeedISO(s Seed) ([]byte, error) {
	if s.InstanceID == "" {
		return nil, errors.New("nocloud: the instance id is empty")
	}
	vendor, err := VendorData(s.InstallGuestAgent, s.VendorData)
	if err != nil {
		return nil, fmt.Errorf("nocloud: vendor-data: %w", err)
	}
	w, err := iso9660.NewWriter()
	if err != nil {
		return nil, fmt.Errorf("nocloud: staging: %w", err)
	}
	defer func() { _ = w.Cleanup() }()
	files := []struct {
		name string
		data []byte
	}{
		{"user-data", s.UserData},
		{"meta-data", MetaData(s)},
	}
	if vendor != nil {
		files = append(files, struct {
			name string
			data []byte
		}{"vendor-data", vendor})
	}
	for _, f := range files {
		if err := w.AddFile(bytes.NewReader(f.data), f.name); err != nil {
			return nil, fmt.Errorf("nocloud: staging %s: %w", f.name, err)
		}
	}
	var out bytes.Buffer
	if err := w.WriteTo(&out, Label); err != nil {
		return nil, fmt.Errorf("nocloud: writing the image: %w", err)
	}
	return out.Bytes(), nil
}

// ReadSeedISO reads an image built by BuildSeedISO back: its label and its
// files by name. Tests (and fakes) use it to check what a VM would see.
func ReadSeedISO(image []byte) (label string, files map[string][]byte, err error) {
	img, err := iso9660.OpenImage(bytes.NewReader(image))
	if err != nil {
		return "", nil, err
	}
	label, err = img.Label()
	if err != nil {
		return "", nil, err
	}
	root, err := img.RootDir()
	if err != nil {
		return "", nil, err
	}
	children, err := root.GetChildren()
	if err != nil {
		return "", nil, err
	}
	files = map[string][]byte{}
	for _, c := range children {
		if c.IsDir() {
			continue
		}
		var b bytes.Buffer
		if _, err := b.ReadFrom(c.Reader()); err != nil {
			return "", nil, err
		}
		files[c.Name()] = b.Bytes()
	}
	return label, files, nil
}

// SeedCredentials reads the proxy's credentials back from a seed image:
// the values of MetaKeyProxyUser and MetaKeyProxyPassword in its
// meta-data, as cloud-init's YAML reading sees them ("" when absent).
// Tests use it to check what a VM would receive.
func SeedCredentials(image []byte) (user, password string, err error) {
	_, files, err := ReadSeedISO(image)
	if err != nil {
		return "", "", err
	}
	var md map[string]any
	if err := yaml.Unmarshal(files["meta-data"], &md); err != nil {
		return "", "", fmt.Errorf("nocloud: meta-data is not YAML: %w", err)
	}
	user, _ = md[MetaKeyProxyUser].(string)
	password, _ = md[MetaKeyProxyPassword].(string)
	return user, password, nil
}
