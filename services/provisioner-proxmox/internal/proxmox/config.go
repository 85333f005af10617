// Package proxmox is the Proxmox VE backend of the provisioner runtime:
// each proxy is a full clone of a template, booted with a NoCloud seed ISO
// built in-process, on a cluster reached through its REST API with an API
// token. docs/provisioner-proxmox.md describes the behaviour.
package proxmox

import (
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"time"
)

// Config is the proxmox block of a provider in the providers YAML.
type Config struct {
	URL                   string                 `yaml:"url"`
	TokenFile             string                 `yaml:"tokenFile"`
	CAFile                string                 `yaml:"caFile"`
	InsecureSkipTLSVerify bool                   `yaml:"insecureSkipTLSVerify"`
	Nodes                 []string               `yaml:"nodes"`
	ISOStorage            string                 `yaml:"isoStorage"`
	Storage               string                 `yaml:"storage"`
	Bridge                string                 `yaml:"bridge"`
	VLANTag               int                    `yaml:"vlanTag"`
	VMIDRange             VMIDRange              `yaml:"vmidRange"`
	Templates             map[string]Template    `yaml:"templates"`
	MachineTypes          map[string]MachineType `yaml:"machineTypes"`
	RequestTimeoutSeconds int                    `yaml:"requestTimeoutSeconds"`
	VendorData            string                 `yaml:"vendorData"`
	InstallGuestAgent     *bool                  `yaml:"installGuestAgent"`
	// CloneWhileNodesUnreachable lets Create clone while a VM in
	// vmidRange sits on a node that does not answer (it may be this
	// proxy's VM, unseen); off by default.
	CloneWhileNodesUnreachable bool `yaml:"cloneWhileNodesUnreachable"`
}

// VMIDRange is where VMIDs are allocated.
type VMIDRange struct {
	Min int `yaml:"min"`
	Max int `yaml:"max"`
}

// Template names a template VM.
type Template struct {
	VMID int `yaml:"vmid"`
}

// MachineType is a size profile.
type MachineType struct {
	Cores     int `yaml:"cores"`
	MemoryMiB int `yaml:"memoryMiB"`
	DiskGiB   int `yaml:"diskGiB"`
}

// Defaults.
const (
	DefaultVMIDMin        = 100000
	DefaultVMIDMax        = 199999
	DefaultRequestTimeout = 30 * time.Second
)

var nodeRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]*[a-z0-9])?$`)
var storageRE = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9_.-]*$`)
var bridgeRE = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9_.-]{0,14}$`)

// WithDefaults returns c with the defaults applied.
func (c Config) WithDefaults() Config {
	if c.VMIDRange.Min == 0 && c.VMIDRange.Max == 0 {
		c.VMIDRange = VMIDRange{DefaultVMIDMin, DefaultVMIDMax}
	}
	if c.RequestTimeoutSeconds == 0 {
		c.RequestTimeoutSeconds = int(DefaultRequestTimeout / time.Second)
	}
	if c.InstallGuestAgent == nil {
		t := true
		c.InstallGuestAgent = &t
	}
	c.URL = strings.TrimRight(c.URL, "/")
	return c
}

// Validate checks a config with its defaults applied; the error names the
// field.
func (c Config) Validate() error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	u, err := url.Parse(c.URL)
	switch {
	case c.URL == "":
		add("url is required")
	case err != nil || u.Scheme != "https" || u.Host == "":
		add("url %q: want https://<host>:8006", c.URL)
	case u.Path != "" && u.Path != "/":
		add("url %q: give no path (the client appends /api2/json)", c.URL)
	}
	if c.TokenFile == "" {
		add("tokenFile is required")
	}
	if len(c.Nodes) == 0 {
		add("nodes: at least one node is required")
	}
	seen := map[string]bool{}
	for i, n := range c.Nodes {
		if !nodeRE.MatchString(n) {
			add("nodes[%d] %q: lowercase letters, digits and dashes only", i, n)
		}
		if seen[n] {
			add("nodes[%d] %q is listed twice", i, n)
		}
		seen[n] = true
	}
	if c.ISOStorage == "" {
		add("isoStorage is required")
	} else if !storageRE.MatchString(c.ISOStorage) {
		add("isoStorage %q is not a storage id", c.ISOStorage)
	}
	if c.Storage != "" && !storageRE.MatchString(c.Storage) {
		add("storage %q is not a storage id", c.Storage)
	}
	if c.Bridge != "" && !bridgeRE.MatchString(c.Bridge) {
		add("bridge %q is not a bridge name", c.Bridge)
	}
	if c.VLANTag != 0 && (c.VLANTag < 1 || c.VLANTag > 4094) {
		add("vlanTag %d: want 1 to 4094", c.VLANTag)
	}
	r := c.VMIDRange
	if r.Min < 100 || r.Max > 999999999 || r.Min >= r.Max {
		add("vmidRange %d-%d: want 100 <= min < max <= 999999999", r.Min, r.Max)
	}
	if len(c.Templates) == 0 {
		add("templates: at least one template is required")
	}
	for k, t := range c.Templates {
		if t.VMID < 100 {
			add("templates.%s.vmid %d: want at least 100", k, t.VMID)
		}
	}
	if len(c.MachineTypes) == 0 {
		add("machineTypes: at least one machine type is required")
	}
	for k, m := range c.MachineTypes {
		if m.Cores <= 0 {
			add("machineTypes.%s.cores: want above zero", k)
		}
		if m.MemoryMiB <= 0 {
			add("machineTypes.%s.memoryMiB: want above zero", k)
		}
		if m.DiskGiB < 0 {
			add("machineTypes.%s.diskGiB: want zero (keep the template's) or above", k)
		}
	}
	if c.RequestTimeoutSeconds < 0 {
		add("requestTimeoutSeconds: want above zero")
	}
	return errors.Join(errs...)
}

// Budgets bound every request and wait (docs/provisioner-proxmox.md, Budgets).
type Budgets struct {
	Connect, TLSHandshake, Request time.Duration
	Clone, Upload, Resize, Start   time.Duration
	Stop, Destroy, SeedDelete      time.Duration
	Running, Poll                  time.Duration
	Check                          time.Duration
}

// DefaultBudgets are the documented budgets.
func DefaultBudgets(requestTimeout time.Duration) Budgets {
	return Budgets{
		Connect: 10 * time.Second, TLSHandshake: 10 * time.Second, Request: requestTimeout,
		Clone: 10 * time.Minute, Upload: 2 * time.Minute, Resize: 2 * time.Minute, Start: 2 * time.Minute,
		Stop: 2 * time.Minute, Destroy: 5 * time.Minute, SeedDelete: time.Minute,
		Running: 60 * time.Second, Poll: time.Second, Check: 15 * time.Second,
	}
}
