package kvm

import (
	"strings"
	"testing"
	"time"

	"libvirt.org/go/libvirtxml"
)

func TestInstanceNameAndProviderID(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ uid, want string }{
		{"5f0c-AB_cd", "proxy-5f0c-ab-cd"},
		{strings.Repeat("a", 80), "proxy-" + strings.Repeat("a", 57)},
	} {
		if got, err := instanceName(tc.uid); err != nil || got != tc.want {
			t.Errorf("instanceName(%q) = %q, %v; want %q", tc.uid, got, err, tc.want)
		}
	}
	if _, err := instanceName("///"); err == nil {
		t.Error("a UID without name characters was accepted")
	}
	h, n, err := parseProviderID(providerID("nas1.lan", "proxy-x"))
	if err != nil || h != "nas1.lan" || n != "proxy-x" {
		t.Errorf("round trip = %q %q %v", h, n, err)
	}
	for _, bad := range []string{"", "hosts/a/domains", "hosts/a/b/domains/proxy-x", "vms/1/proxy-x", "hosts/a/domains/other", "hosts//domains/proxy-x"} {
		if _, _, err := parseProviderID(bad); err == nil {
			t.Errorf("parseProviderID(%q) accepted", bad)
		}
	}
}

func FuzzParseProviderID(f *testing.F) {
	f.Add("hosts/nas1/domains/proxy-abc")
	f.Add("hosts/../domains/proxy-")
	f.Fuzz(func(t *testing.T, id string) {
		h, n, err := parseProviderID(id)
		if err == nil && providerID(h, n) != id {
			t.Errorf("%q parsed to %q %q, which does not round-trip", id, h, n)
		}
	})
}

func TestMark(t *testing.T) {
	t.Parallel()
	created := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	tests := []struct {
		name, in     string
		wantUID      string
		wantProvider string
		managed      bool
		wantErr      bool
	}{
		{"as written", markXML("kvm-<a>", "", "uid-<1>", created), "uid-<1>", "kvm-<a>", true, false},
		{"as claimed", markElement("kvm-<a>", "", "uid-<1>", created), "uid-<1>", "kvm-<a>", true, false},
		{"libvirt bare form", `<instance><managed>true</managed><provider>p</provider><uid>u2</uid><createdAt>2026-12-03T10:00:00Z</createdAt></instance>`, "u2", "p", true, false},
		{"other prefix", `<x:instance xmlns:x="` + metadataURI + `"><x:managed>true</x:managed><x:provider>p</x:provider><x:uid>u3</x:uid><x:createdAt>2026-12-03T10:00:00Z</x:createdAt></x:instance>`, "u3", "p", true, false},
		{"legacy, no provider", `<egress:instance xmlns:egress="` + metadataURI + `"><egress:managed>true</egress:managed><egress:uid>u4</egress:uid><egress:createdAt>2026-12-03T10:00:00Z</egress:createdAt></egress:instance>`, "u4", "", true, false},
		{"not managed", `<instance><managed>false</managed><uid>u</uid></instance>`, "u", "", false, false},
		{"foreign element", `<foo><managed>true</managed></foo>`, "", "", false, true},
		{"garbage", `<<`, "", "", false, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			m, err := parseMark(tc.in)
			if (err != nil) != tc.wantErr || m.UID != tc.wantUID || m.Provider != tc.wantProvider || m.managed() != tc.managed {
				t.Fatalf("parseMark = %+v, %v", m, err)
			}
			if tc.managed && !m.createdAt().Equal(created) {
				t.Errorf("createdAt = %v", m.createdAt())
			}
		})
	}
}

// Whose a domain is, to provider "a", by its mark.
func TestMarkOwnership(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		m     mark
		own   ownership
		isFor map[string]bool // uid asked → the domain is the proxy's
	}{
		{"this provider's", mark{Managed: "true", Provider: "a", UID: "u"}, owned, map[string]bool{"": true, "u": true, "v": false}},
		{"another provider's", mark{Managed: "true", Provider: "b", UID: "u"}, foreignProvider, map[string]bool{"": false, "u": false}},
		{"legacy", mark{Managed: "true", UID: "u"}, legacy, map[string]bool{"": true, "u": true, "v": false}},
		{"unmarked", mark{}, foreignUnmarked, map[string]bool{"": false, "u": false}},
		{"not managed", mark{Managed: "false", Provider: "a", UID: "u"}, foreignUnmarked, map[string]bool{"u": false}},
	}
	for _, tc := range tests {
		if got := tc.m.ownedBy("a"); got != tc.own {
			t.Errorf("%s: ownedBy = %v, want %v", tc.name, got, tc.own)
		}
		for uid, want := range tc.isFor {
			if got := tc.m.isFor("a", "", uid); got != want {
				t.Errorf("%s: isFor(a, %q) = %v, want %v", tc.name, uid, got, want)
			}
		}
	}
}

func FuzzParseMark(f *testing.F) {
	f.Add(markXML("p", "", "u", time.Unix(0, 0)))
	f.Add(`<instance><uid>x</uid></instance>`)
	f.Fuzz(func(t *testing.T, s string) { _, _ = parseMark(s) })
}

func TestDomainXML(t *testing.T) {
	t.Parallel()
	spec := domainSpec{Name: "proxy-a", Type: DomainKVM, VCPUs: 2, MemoryMiB: 2048, Firmware: FirmwareUEFI,
		OverlayPath: "/p/proxy-a.qcow2", SeedPath: "/p/proxy-a-seed.iso", Bridge: "br0", ConsoleLog: "/log/proxy-a.log", Mark: markXML("kvm-test", "", "a", time.Unix(0, 0))}
	for _, tc := range []struct {
		name    string
		mod     func(*domainSpec)
		uefi    bool
		hostCPU bool
	}{
		{"uefi on kvm", func(*domainSpec) {}, true, true},
		{"bios on qemu", func(s *domainSpec) { s.Firmware = FirmwareBIOS; s.Type = DomainQEMU }, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := spec
			tc.mod(&s)
			x, err := domainXML(s)
			if err != nil {
				t.Fatal(err)
			}
			var d libvirtxml.Domain
			if err := d.Unmarshal(x); err != nil {
				t.Fatal(err)
			}
			dev := d.Devices
			if d.Type != s.Type || d.Name != "proxy-a" || d.VCPU.Value != 2 || d.Memory.Value != 2048 || d.Memory.Unit != "MiB" {
				t.Errorf("basics = %s %s %+v %+v", d.Type, d.Name, d.VCPU, d.Memory)
			}
			if (d.OS.Firmware == "efi") != tc.uefi || (tc.uefi && d.OS.FirmwareInfo.Features[0] != libvirtxml.DomainOSFirmwareFeature{Name: "secure-boot", Enabled: "no"}) {
				t.Errorf("firmware = %q %+v", d.OS.Firmware, d.OS.FirmwareInfo)
			}
			if (d.CPU != nil && d.CPU.Mode == "host-passthrough") != tc.hostCPU {
				t.Errorf("cpu = %+v", d.CPU)
			}
			if len(dev.Disks) != 2 || dev.Disks[0].Source.File.File != s.OverlayPath || dev.Disks[0].Target.Bus != "virtio" ||
				dev.Disks[1].Device != "cdrom" || dev.Disks[1].Source.File.File != s.SeedPath || dev.Disks[1].ReadOnly == nil {
				t.Errorf("disks = %+v", dev.Disks)
			}
			if len(dev.Interfaces) != 1 || dev.Interfaces[0].Source.Bridge.Bridge != "br0" || dev.Interfaces[0].Model.Type != "virtio" {
				t.Errorf("interfaces = %+v", dev.Interfaces)
			}
			if len(dev.Serials) != 1 || dev.Serials[0].Source.File.Path != "/log/proxy-a.log" {
				t.Errorf("serial = %+v", dev.Serials)
			}
			if len(dev.Channels) != 1 || dev.Channels[0].Target.VirtIO.Name != "org.qemu.guest_agent.0" {
				t.Errorf("channels = %+v", dev.Channels)
			}
			if len(dev.RNGs) != 1 || dev.RNGs[0].Backend.Random.Device != "/dev/urandom" || len(dev.Graphics) != 0 || dev.Videos[0].Model.Type != "none" {
				t.Errorf("rng/graphics/video = %+v %+v %+v", dev.RNGs, dev.Graphics, dev.Videos)
			}
			if m, err := parseMark(strings.TrimSpace(d.Metadata.XML)); err != nil || m.UID != "a" {
				t.Errorf("mark = %+v, %v", m, err)
			}
		})
	}
}
