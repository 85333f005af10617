// Package squid holds what every process that starts its own squid needs:
// a service name of its own for each instance.
//
// squid names its shared-memory segments after its service name (-n,
// "squid" by default), in /dev/shm as <name>-cf__queues.shm and the like.
// Two squids of one name on a host collide there ("shm_open … File
// exists", FATAL at start), and a squid that was killed leaves its
// segments behind for the next start of that name.
package squid

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
)

// ServiceName is the service name of the instance id: "egress" and 26 hex
// digits of id's SHA-256 (squid takes letters and digits, 32 at most).
func ServiceName(id string) string {
	sum := sha256.Sum256([]byte(id))
	return "egress" + hex.EncodeToString(sum[:])[:26]
}

// RemoveStaleSegments removes the shared-memory segments a squid of the
// service name left when it was killed. Call it only while no squid of
// that name runs.
func RemoveStaleSegments(name string) {
	stale, _ := filepath.Glob(filepath.Join("/dev/shm", name+"-*.shm"))
	for _, f := range stale {
		_ = os.Remove(f)
	}
}
