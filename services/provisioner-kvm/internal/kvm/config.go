// Package kvm is the KVM/libvirt backend of the provisioner runtime: each
// proxy is a libvirt domain on one of the configured hosts, reached over
// SSH with the host's libvirt unix socket forwarded through the
// connection. Its disk is a qcow2 overlay on a base image cached in the
// host's storage pool, and it boots with a NoCloud seed ISO built
// in-process. docs/provisioner-kvm.md describes it for operators.
package kvm

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"path"
	"regexp"
	"sort"
	"strings"
	"time"
)

// Config is the kvm block of a provider in the providers YAML.
type Config struct {
	Hosts        []Host                 `yaml:"hosts"`
	Images       map[string]Image       `yaml:"images"`
	MachineTypes map[string]MachineType `yaml:"machineTypes"`
	// DiskSizeGB is each overlay's capacity unless the machine type sets
	// its own; cloud-init's growpart grows the root filesystem into it.
	DiskSizeGB int `yaml:"diskSizeGb"`
	// DomainType is libvirt's domain type: kvm, or qemu (software
	// emulation) on a host without /dev/kvm.
	DomainType        string `yaml:"domainType"`
	InstallGuestAgent *bool  `yaml:"installGuestAgent"`
	VendorData        string `yaml:"vendorData"`
	// InsecureIgnoreHostKey skips host-key verification (logged as a
	// WARNING at start).
	InsecureIgnoreHostKey bool `yaml:"insecureIgnoreHostKey"`
	// MaxConcurrentPerHost bounds the operations that run at once against
	// one host, so a burst of creates cannot flood one hypervisor.
	MaxConcurrentPerHost int `yaml:"maxConcurrentPerHost"`
	// StepTimeout bounds each step of a Create but a base image's
	// download; a host connection whose call has not answered by then is
	// dropped and the step is Transient.
	StepTimeout time.Duration `yaml:"stepTimeout"`
}

// Host is one libvirt host.
type Host struct {
	// Name is what placement.zone selects; it is part of the providerID.
	Name    string `yaml:"name"`
	Address string `yaml:"address"`
	User    string `yaml:"user"`
	// KeyFile is the SSH private key; KnownHostsFile the OpenSSH
	// known_hosts its host key is verified against. Both are read on the
	// first connection.
	KeyFile        string `yaml:"keyFile"`
	KnownHostsFile string `yaml:"knownHostsFile"`
	// Socket is libvirtd's unix socket on the host.
	Socket string `yaml:"socket"`
	// Bridge is the host bridge every VM's NIC is attached to.
	Bridge string `yaml:"bridge"`
	// Pool is the libvirt storage pool holding base images, overlays and
	// seeds.
	Pool string `yaml:"pool"`
	// ConsoleLogDir is the host directory the VMs' serial consoles are
	// written to (<dir>/<vm>.log).
	ConsoleLogDir string `yaml:"consoleLogDir"`
}

// Image is a base image downloaded into each host's pool on first use.
type Image struct {
	URL      string `yaml:"url"`
	SHA256   string `yaml:"sha256"`
	Format   string `yaml:"format"`
	Firmware string `yaml:"firmware"`
}

// MachineType is a size profile.
type MachineType struct {
	VCPUs      int `yaml:"vcpus"`
	MemoryMiB  int `yaml:"memoryMiB"`
	DiskSizeGB int `yaml:"diskSizeGb"`
}

// Accepted values and defaults.
const (
	FormatQcow2  = "qcow2"
	FormatRaw    = "raw"
	FirmwareUEFI = "uefi"
	FirmwareBIOS = "bios"
	DomainKVM    = "kvm"
	DomainQEMU   = "qemu"

	DefaultDiskSizeGB           = 10
	DefaultSocket               = "/var/run/libvirt/libvirt-sock"
	DefaultPool                 = "default"
	DefaultConsoleLogDir        = "/var/log/libvirt/qemu"
	DefaultMaxConcurrentPerHost = 4
	DefaultStepTimeout          = 90 * time.Second
)

// identifier is the rule for names pasted into identifiers: a host name
// goes into the providerID hosts/<name>/domains/<vm>, split on "/" to
// parse, and an image key into the volume name base-<key>.<format>. A
// slash in either would make an ID or a path that never resolves again.
var identifier = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

var sha256Hex = regexp.MustCompile(`^[0-9a-fA-F]{64}$`)

// WithDefaults returns c with the defaults applied.
func (c Config) WithDefaults() Config {
	if c.DiskSizeGB == 0 {
		c.DiskSizeGB = DefaultDiskSizeGB
	}
	if c.DomainType == "" {
		c.DomainType = DomainKVM
	}
	if c.InstallGuestAgent == nil {
		t := true
		c.InstallGuestAgent = &t
	}
	if c.MaxConcurrentPerHost == 0 {
		c.MaxConcurrentPerHost = DefaultMaxConcurrentPerHost
	}
	if c.StepTimeout == 0 {
		c.StepTimeout = DefaultStepTimeout
	}
	hosts := make([]Host, len(c.Hosts))
	for i, h := range c.Hosts {
		if h.Socket == "" {
			h.Socket = DefaultSocket
		}
		if h.Pool == "" {
			h.Pool = DefaultPool
		}
		if h.ConsoleLogDir == "" {
			h.ConsoleLogDir = DefaultConsoleLogDir
		}
		hosts[i] = h
	}
	c.Hosts = hosts
	images := make(map[string]Image, len(c.Images))
	for k, img := range c.Images {
		images[k] = img.withDefaults()
	}
	c.Images = images
	return c
}

func (img Image) withDefaults() Image {
	if img.Format == "" {
		img.Format = FormatQcow2
	}
	if img.Firmware == "" {
		img.Firmware = FirmwareUEFI
	}
	img.SHA256 = strings.ToLower(img.SHA256)
	return img
}

// isHTTPURL reports whether s is an absolute http(s) URL with a host, the
// only image source the backend can fetch.
func isHTTPURL(s string) bool {
	u, err := url.Parse(s)
	return err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != ""
}

// Validate checks a config with its defaults applied. Every problem is
// reported, each naming its field.
func (c Config) Validate() error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if len(c.Hosts) == 0 {
		add("hosts: at least one host is required")
	}
	seen := map[string]bool{}
	for i, h := range c.Hosts {
		p := fmt.Sprintf("hosts[%d]", i)
		switch {
		case h.Name == "":
			add("%s.name is required", p)
		case !identifier.MatchString(h.Name):
			add("%s.name %q: letters, digits, dots, dashes and underscores only (it becomes part of the providerID hosts/<name>/domains/<vm>)", p, h.Name)
		case seen[h.Name]:
			add("%s.name %q is listed twice", p, h.Name)
		}
		seen[h.Name] = true
		if h.Address == "" {
			add("%s.address is required (host:port)", p)
		} else if _, port, err := net.SplitHostPort(h.Address); err != nil || port == "" {
			add("%s.address %q: want host:port", p, h.Address)
		}
		if h.User == "" {
			add("%s.user is required", p)
		}
		if h.KeyFile == "" {
			add("%s.keyFile is required", p)
		}
		if h.KnownHostsFile == "" && !c.InsecureIgnoreHostKey {
			add("%s.knownHostsFile is required unless insecureIgnoreHostKey is set", p)
		}
		if !path.IsAbs(h.Socket) {
			add("%s.socket %q: want an absolute path", p, h.Socket)
		}
		if h.Bridge == "" {
			add("%s.bridge is required", p)
		}
		if !identifier.MatchString(h.Pool) {
			add("%s.pool %q is not a pool name", p, h.Pool)
		}
		if !path.IsAbs(h.ConsoleLogDir) {
			add("%s.consoleLogDir %q: want an absolute path", p, h.ConsoleLogDir)
		}
	}
	for _, k := range sortedKeys(c.Images) {
		img := c.Images[k]
		p := fmt.Sprintf("images.%s", k)
		if !identifier.MatchString(k) {
			add("images[%q]: the key must be letters, digits, dots, dashes and underscores (it becomes the volume name base-<key>.<format>)", k)
			p = fmt.Sprintf("images[%q]", k)
		}
		if !isHTTPURL(img.URL) {
			add("%s.url %q: want an http(s) URL", p, img.URL)
		}
		if img.SHA256 != "" && !sha256Hex.MatchString(img.SHA256) {
			add("%s.sha256: want 64 hex characters", p)
		}
		if img.Format != FormatQcow2 && img.Format != FormatRaw {
			add("%s.format %q: want %s or %s", p, img.Format, FormatQcow2, FormatRaw)
		}
		if img.Firmware != FirmwareUEFI && img.Firmware != FirmwareBIOS {
			add("%s.firmware %q: want %s or %s", p, img.Firmware, FirmwareUEFI, FirmwareBIOS)
		}
	}
	if len(c.MachineTypes) == 0 {
		add("machineTypes: at least one machine type is required")
	}
	for _, k := range sortedKeys(c.MachineTypes) {
		m := c.MachineTypes[k]
		if m.VCPUs <= 0 {
			add("machineTypes.%s.vcpus: want above zero", k)
		}
		if m.MemoryMiB <= 0 {
			add("machineTypes.%s.memoryMiB: want above zero", k)
		}
		if m.DiskSizeGB < 0 {
			add("machineTypes.%s.diskSizeGb: want zero (use diskSizeGb) or above", k)
		}
	}
	if c.DiskSizeGB <= 0 {
		add("diskSizeGb: want above zero")
	}
	if c.DomainType != DomainKVM && c.DomainType != DomainQEMU {
		add("domainType %q: want %s or %s", c.DomainType, DomainKVM, DomainQEMU)
	}
	if c.MaxConcurrentPerHost <= 0 {
		add("maxConcurrentPerHost: want above zero")
	}
	if c.StepTimeout < time.Second || c.StepTimeout > 30*time.Minute {
		add("stepTimeout %s: want between 1s and 30m", c.StepTimeout)
	}
	return errors.Join(errs...)
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// host returns the configured host named name.
func (c Config) host(name string) (Host, bool) {
	for _, h := range c.Hosts {
		if h.Name == name {
			return h, true
		}
	}
	return Host{}, false
}
