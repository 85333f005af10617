// Package installation is the identity of one installation of the suite:
// the value every provisioner writes into its instances' marks so that two
// installations sharing a backend (a staging and a production suite, one
// Proxmox cluster) never list, adopt or collect each other's instances.
//
// An identity is short and label-safe: lowercase letters, digits and
// dashes, starting and ending with a letter or digit, at most MaxLen
// characters, so that it is a valid GCE label value, Kubernetes label
// value, Proxmox tag and libvirt metadata attribute as it is.
package installation

import (
	"crypto/sha256"
	"encoding/base32"
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

// MaxLen is the longest identity.
const MaxLen = 32

// pattern is the proto's rule for the installation fields
// (egress.provisioner.v1), kept in step with it.
var pattern = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$`)

// Valid returns nil when id is a usable identity, else an error that says
// what is wrong with it.
func Valid(id string) error {
	if id == "" {
		return fmt.Errorf("installation id is empty")
	}
	if len(id) > MaxLen {
		return fmt.Errorf("installation id %q is %d characters long; at most %d", id, len(id), MaxLen)
	}
	if !pattern.MatchString(id) {
		return fmt.Errorf("installation id %q: only lowercase letters, digits and dashes, starting and ending with a letter or digit", id)
	}
	return nil
}

// Derive is the default identity of the installation whose database is
// dbName on the PostgreSQL cluster with systemID (pg_control_system()'s
// system_identifier): stable for the life of that database, different for
// two databases of one server and for two servers. It is "i" followed by
// 16 base32 characters of a SHA-256 of both.
func Derive(systemID uint64, dbName string) string {
	sum := sha256.Sum256([]byte(strconv.FormatUint(systemID, 10) + "/" + dbName))
	enc := base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(sum[:10])
	return "i" + strings.ToLower(enc)
}
