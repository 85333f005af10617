package proxmox

import (
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// providerIDs come back from the orchestrator's store: parse them safely.
func FuzzParseProviderID(f *testing.F) {
	for _, s := range []string{"vms/100/proxy-a", "vms/x/y", "", "vms/100/", "vms//a", "vms/99999999999999999999/a"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		vmid, name, err := parseProviderID(s)
		if err != nil {
			if errclass.Of(err) != errclass.Permanent {
				t.Fatalf("%q: class %v", s, errclass.Of(err))
			}
			return
		}
		if vmid < 100 || name == "" || strings.Contains(name, "/") {
			t.Fatalf("%q parsed to %d %q", s, vmid, name)
		}
		if got := providerID(vmid, name); got != s {
			// Only a canonical form round-trips (leading zeros, "+" do not).
			if v2, n2, err := parseProviderID(got); err != nil || v2 != vmid || n2 != name {
				t.Fatalf("%q -> %q does not parse back", s, got)
			}
		}
	})
}

// Descriptions are written by anyone with VM.Config.Options.
func FuzzParseMark(f *testing.F) {
	f.Add(markLines("u1", "", time.Unix(1700000000, 0)))
	f.Add("admin\nproxy-operator-managed=true\r\nproxy-operator-uid= spaced \n")
	f.Add("=\n==\nproxy-operator-created-at=not-a-time")
	f.Fuzz(func(t *testing.T, desc string) {
		m := parseMark(desc)
		if m.managed && !strings.Contains(desc, "proxy-operator-managed") {
			t.Fatalf("managed without the line: %q", desc)
		}
		// Appending our own mark always wins for the fields it sets.
		m2 := parseMark(desc + "\n" + markLines("uid-x", "", time.Unix(1700000000, 0)))
		if !m2.managed || m2.uid != "uid-x" || m2.createdAt.Unix() != 1700000000 {
			t.Fatalf("appended mark not read: %+v from %q", m2, desc)
		}
	})
}

// Template configs are whatever an admin made.
func FuzzBootDisk(f *testing.F) {
	f.Add("order=scsi0;ide2", "scsi0", "local-lvm:vm-1-disk-0,size=32G")
	f.Add("order=", "virtio0", "x,size=")
	f.Add("c", "sata0", "a,size=1.5T,media=cdrom")
	f.Fuzz(func(t *testing.T, boot, key, val string) {
		slot, size, ok := bootDisk(map[string]string{"boot": boot, key: val})
		if ok && (slot == "" || size < 0) {
			t.Fatalf("boot %q %s=%q: %q %v", boot, key, val, slot, size)
		}
		_ = setOption(val, "tag", "4")
	})
}
