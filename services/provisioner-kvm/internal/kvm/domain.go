package kvm

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"path"
	"regexp"
	"strings"
	"time"

	"libvirt.org/go/libvirtxml"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// Names, IDs and the mark.
const (
	namePrefix = "proxy-"
	// metadataURI is the namespace of the mark in a domain's <metadata>;
	// libvirt has no labels, so the mark is how List and adoption tell the
	// system's domains from everyone else's.
	metadataURI    = "https://egress-proxies.dev/xmlns/kvm-instance/1"
	metadataPrefix = "egress"
)

var nonName = regexp.MustCompile(`[^a-z0-9-]+`)

// instanceName is the proxy's deterministic domain name, proxy-<uid>.
func instanceName(uid string) (string, error) {
	n := namePrefix + strings.Trim(nonName.ReplaceAllString(strings.ToLower(uid), "-"), "-")
	if len(n) > 63 {
		n = strings.TrimRight(n[:63], "-")
	}
	if n == namePrefix {
		return "", errclass.New(errclass.Permanent, "proxy UID %q yields no domain name", uid)
	}
	return n, nil
}

func overlayName(name string) string { return name + ".qcow2" }
func seedName(name string) string    { return name + "-seed.iso" }

// providerID is hosts/<host>/domains/<name>.
func providerID(host, name string) string { return "hosts/" + host + "/domains/" + name }

func parseProviderID(id string) (host, name string, err error) {
	parts := strings.Split(id, "/")
	if len(parts) == 4 && parts[0] == "hosts" && parts[2] == "domains" &&
		identifier.MatchString(parts[1]) && strings.HasPrefix(parts[3], namePrefix) {
		return parts[1], parts[3], nil
	}
	return "", "", errclass.New(errclass.Permanent, "providerID %q is not hosts/<host>/domains/%s<uid>", id, namePrefix)
}

// mark is what the metadata element records.
type mark struct {
	Managed string `xml:"managed"`
	// Provider is the name of the provider that made the domain; marks
	// written before it was recorded have none (legacy marks).
	Provider string `xml:"provider"`
	// Installation is the installation (pkg/installation) the domain is
	// for; marks written before it was recorded have none.
	Installation string `xml:"installation"`
	UID          string `xml:"uid"`
	CreatedAt    string `xml:"createdAt"`
}

func (m mark) managed() bool { return m.Managed == "true" }

// ownership is whose a domain is, by its mark, to one provider.
type ownership int

const (
	// foreignUnmarked: no mark, or one that does not parse.
	foreignUnmarked ownership = iota
	// foreignProvider: marked by another provider (on a host they share).
	foreignProvider
	// legacy: marked before marks named their provider; the UID decides.
	legacy
	// owned: marked by this provider.
	owned
)

func (m mark) ownedBy(provider string) ownership {
	switch {
	case !m.managed():
		return foreignUnmarked
	case m.Provider == "":
		return legacy
	case m.Provider == provider:
		return owned
	default:
		return foreignProvider
	}
}

// isFor reports whether the mark is provider's and, when uid is set, that
// proxy's. A legacy mark counts as provider's: the UID it carries is
// unique across providers, and the proxy asking for it is the one that
// owns it.
func (m mark) isFor(provider, installation, uid string) bool {
	o := m.ownedBy(provider)
	return (o == owned || o == legacy) && (uid == "" || m.UID == uid) && !m.foreignInstallation(installation)
}

// foreignInstallation reports whether the mark names an installation
// other than installation: another installation's domain, left alone.
func (m mark) foreignInstallation(installation string) bool {
	return m.Installation != "" && m.Installation != installation
}

// needsClaim reports whether the mark, the proxy's, lacks its provider or
// installation, which the proxy's Get or Create then writes.
func (m mark) needsClaim(provider, installation string) bool {
	return m.ownedBy(provider) == legacy || (m.Installation == "" && installation != "")
}

// describe says whose the mark is, for messages.
func (m mark) describe() string {
	switch {
	case !m.managed():
		return "no mark"
	case m.Provider == "":
		return fmt.Sprintf("a mark without provider, uid %q", m.UID)
	case m.Installation != "":
		return fmt.Sprintf("provider %q's mark, installation %q, uid %q", m.Provider, m.Installation, m.UID)
	default:
		return fmt.Sprintf("provider %q's mark, uid %q", m.Provider, m.UID)
	}
}

func (m mark) createdAt() time.Time {
	t, _ := time.Parse(time.RFC3339, m.CreatedAt)
	return t
}

// markXML is the element stored in the domain's <metadata>, in the
// system's namespace under its own prefix.
func markXML(provider, installation, uid string, created time.Time) string {
	return buildMark(metadataPrefix+":", fmt.Sprintf(" xmlns:%s=%q", metadataPrefix, metadataURI), provider, installation, uid, created)
}

// markElement is the mark without namespace, as virDomainSetMetadata
// takes it: libvirt puts it (and its children) in the namespace it is
// given, and refuses an element that declares that namespace itself.
func markElement(provider, installation, uid string, created time.Time) string {
	return buildMark("", "", provider, installation, uid, created)
}

func buildMark(p, decl, provider, installation, uid string, created time.Time) string {
	var b bytes.Buffer
	esc := func(s string) string {
		var e bytes.Buffer
		_ = xml.EscapeText(&e, []byte(s))
		return e.String()
	}
	fmt.Fprintf(&b, `<%sinstance%s>`, p, decl)
	fmt.Fprintf(&b, `<%smanaged>true</%smanaged>`, p, p)
	fmt.Fprintf(&b, `<%sprovider>%s</%sprovider>`, p, esc(provider), p)
	if installation != "" {
		fmt.Fprintf(&b, `<%sinstallation>%s</%sinstallation>`, p, esc(installation), p)
	}
	fmt.Fprintf(&b, `<%suid>%s</%suid>`, p, esc(uid), p)
	fmt.Fprintf(&b, `<%screatedAt>%s</%screatedAt>`, p, created.UTC().Format(time.RFC3339), p)
	fmt.Fprintf(&b, `</%sinstance>`, p)
	return b.String()
}

// parseMark reads the element DomainGetMetadata returns; libvirt
// re-serialises it with or without a prefix, so only local names count.
func parseMark(s string) (mark, error) {
	var raw struct {
		XMLName xml.Name `xml:"instance"`
		mark
	}
	if err := xml.Unmarshal([]byte(s), &raw); err != nil {
		return mark{}, fmt.Errorf("parsing domain metadata: %w", err)
	}
	return raw.mark, nil
}

// domainSpec is everything the domain XML is built from.
type domainSpec struct {
	Name        string
	Type        string
	VCPUs       int
	MemoryMiB   int
	Firmware    string
	OverlayPath string
	SeedPath    string
	Bridge      string
	ConsoleLog  string
	Mark        string
}

// domainXML builds the domain: UEFI (with NVRAM, secure boot off) unless
// the image needs BIOS, the overlay as a virtio disk, the seed as a
// read-only CD-ROM, the bridge NIC, the serial console written to a file,
// the guest-agent channel, a virtio RNG, no graphics, and the mark.
func domainXML(s domainSpec) (string, error) {
	port := uint(0)
	d := libvirtxml.Domain{
		Type:     s.Type,
		Name:     s.Name,
		Metadata: &libvirtxml.DomainMetadata{XML: s.Mark},
		Memory:   &libvirtxml.DomainMemory{Value: uint(s.MemoryMiB), Unit: "MiB"},
		VCPU:     &libvirtxml.DomainVCPU{Value: uint(s.VCPUs)},
		OS: &libvirtxml.DomainOS{
			Type:        &libvirtxml.DomainOSType{Arch: "x86_64", Machine: "q35", Type: "hvm"},
			BootDevices: []libvirtxml.DomainBootDevice{{Dev: "hd"}},
		},
		Features:   &libvirtxml.DomainFeatureList{ACPI: &libvirtxml.DomainFeature{}, APIC: &libvirtxml.DomainFeatureAPIC{}},
		OnPoweroff: "destroy",
		OnReboot:   "restart",
		OnCrash:    "destroy",
		Devices: &libvirtxml.DomainDeviceList{
			Disks: []libvirtxml.DomainDisk{
				{
					Device: "disk",
					Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: FormatQcow2},
					Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: s.OverlayPath}},
					Target: &libvirtxml.DomainDiskTarget{Dev: "vda", Bus: "virtio"},
				},
				{
					Device:   "cdrom",
					Driver:   &libvirtxml.DomainDiskDriver{Name: "qemu", Type: FormatRaw},
					Source:   &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: s.SeedPath}},
					Target:   &libvirtxml.DomainDiskTarget{Dev: "sda", Bus: "sata"},
					ReadOnly: &libvirtxml.DomainDiskReadOnly{},
				},
			},
			Interfaces: []libvirtxml.DomainInterface{{
				Source: &libvirtxml.DomainInterfaceSource{Bridge: &libvirtxml.DomainInterfaceSourceBridge{Bridge: s.Bridge}},
				Model:  &libvirtxml.DomainInterfaceModel{Type: "virtio"},
			}},
			Serials: []libvirtxml.DomainSerial{{
				Source: &libvirtxml.DomainChardevSource{File: &libvirtxml.DomainChardevSourceFile{Path: s.ConsoleLog, Append: "on"}},
				Target: &libvirtxml.DomainSerialTarget{Port: &port},
			}},
			Consoles: []libvirtxml.DomainConsole{{
				Source: &libvirtxml.DomainChardevSource{File: &libvirtxml.DomainChardevSourceFile{Path: s.ConsoleLog, Append: "on"}},
				Target: &libvirtxml.DomainConsoleTarget{Type: "serial", Port: &port},
			}},
			Channels: []libvirtxml.DomainChannel{{
				Source: &libvirtxml.DomainChardevSource{UNIX: &libvirtxml.DomainChardevSourceUNIX{Mode: "bind"}},
				Target: &libvirtxml.DomainChannelTarget{VirtIO: &libvirtxml.DomainChannelTargetVirtIO{Name: "org.qemu.guest_agent.0"}},
			}},
			RNGs: []libvirtxml.DomainRNG{{
				Model:   "virtio",
				Backend: &libvirtxml.DomainRNGBackend{Random: &libvirtxml.DomainRNGBackendRandom{Device: "/dev/urandom"}},
			}},
			Videos: []libvirtxml.DomainVideo{{Model: libvirtxml.DomainVideoModel{Type: "none"}}},
		},
	}
	if s.Firmware == FirmwareUEFI {
		d.OS.Firmware = "efi"
		d.OS.FirmwareInfo = &libvirtxml.DomainOSFirmwareInfo{Features: []libvirtxml.DomainOSFirmwareFeature{
			{Name: "secure-boot", Enabled: "no"},
		}}
	}
	if s.Type == DomainKVM {
		d.CPU = &libvirtxml.DomainCPU{Mode: "host-passthrough"}
	}
	x, err := d.Marshal()
	if err != nil {
		return "", errclass.Wrap(errclass.Permanent, fmt.Errorf("domain %s: %w", s.Name, err))
	}
	return x, nil
}

// consoleLogPath is where a domain's serial console is written.
func consoleLogPath(h Host, name string) string { return path.Join(h.ConsoleLogDir, name+".log") }

// domainMACs returns the MAC addresses of a domain's NICs from its XML.
func domainMACs(x string) []string {
	var d libvirtxml.Domain
	if err := d.Unmarshal(x); err != nil || d.Devices == nil {
		return nil
	}
	var out []string
	for _, i := range d.Devices.Interfaces {
		if i.MAC != nil && i.MAC.Address != "" {
			out = append(out, strings.ToLower(i.MAC.Address))
		}
	}
	return out
}
