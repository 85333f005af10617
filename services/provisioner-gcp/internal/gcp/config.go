// Package gcp is the Google Compute Engine backend of the provisioner
// runtime: each proxy is one Compute Engine instance booted from a public
// or custom image with the proxy's cloud-init as its user-data metadata,
// reached through the Compute REST API (cloud.google.com/go/compute/apiv1).
// docs/provisioner-gcp.md describes the behaviour.
package gcp

import (
	"errors"
	"fmt"
	"maps"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"time"
)

// Config is the gcp block of a provider in the providers YAML.
type Config struct {
	Project         string            `yaml:"project"`
	CredentialsFile string            `yaml:"credentialsFile"`
	Zones           []string          `yaml:"zones"`
	MachineTypes    []string          `yaml:"machineTypes"`
	Images          map[string]string `yaml:"images"`
	Network         string            `yaml:"network"`
	Subnetwork      string            `yaml:"subnetwork"`
	ExternalIP      *bool             `yaml:"externalIP"`
	Address         string            `yaml:"address"`
	ServiceAccount  *ServiceAccount   `yaml:"serviceAccount"`
	NetworkTags     []string          `yaml:"networkTags"`
	Labels          map[string]string `yaml:"labels"`
	DiskSizeGB      int               `yaml:"diskSizeGb"`
	DiskType        string            `yaml:"diskType"`
	Preemptible     bool              `yaml:"preemptible"`
	Spot            bool              `yaml:"spot"`

	// OperationWaitSeconds bounds how long Create and Delete watch their
	// zone operation before answering; 0 answers at once (the instance's
	// state is then observed by Get).
	OperationWaitSeconds  *int `yaml:"operationWaitSeconds"`
	RequestTimeoutSeconds int  `yaml:"requestTimeoutSeconds"`

	// Endpoint replaces https://compute.googleapis.com (tests, emulators,
	// private endpoints); WithoutAuthentication sends no credentials and is
	// only accepted together with Endpoint.
	Endpoint              string `yaml:"endpoint"`
	WithoutAuthentication bool   `yaml:"withoutAuthentication"`
}

// ServiceAccount is the identity the instances run as.
type ServiceAccount struct {
	Email  string   `yaml:"email"`
	Scopes []string `yaml:"scopes"`
}

// Defaults.
const (
	DefaultNetwork        = "global/networks/default"
	DefaultDiskSizeGB     = 10
	DefaultDiskType       = "pd-balanced"
	DefaultOperationWait  = 10 * time.Second
	DefaultRequestTimeout = 30 * time.Second
	AddressExternal       = "external"
	AddressInternal       = "internal"
	maxUserDataBytes      = 256 * 1024 // Compute's limit for one metadata value
	defaultServiceScope   = "https://www.googleapis.com/auth/cloud-platform"
)

var (
	projectRE  = regexp.MustCompile(`^[a-z][a-z0-9-]{4,28}[a-z0-9]$|^[a-z][a-z0-9.-]*:[a-z][a-z0-9-]{4,28}[a-z0-9]$`)
	zoneRE     = regexp.MustCompile(`^[a-z]+-[a-z]+[0-9]+-[a-z]$`)
	resourceRE = regexp.MustCompile(`^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$`)
	labelKeyRE = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,62}$`)
	labelValRE = regexp.MustCompile(`^[a-z0-9_-]{0,63}$`)
	tagRE      = regexp.MustCompile(`^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$`)
)

// WithDefaults returns c with the defaults applied.
func (c Config) WithDefaults() Config {
	if c.Network == "" {
		c.Network = DefaultNetwork
	}
	if c.ExternalIP == nil {
		t := true
		c.ExternalIP = &t
	}
	if c.Address == "" {
		if *c.ExternalIP {
			c.Address = AddressExternal
		} else {
			c.Address = AddressInternal
		}
	}
	if c.DiskSizeGB == 0 {
		c.DiskSizeGB = DefaultDiskSizeGB
	}
	if c.DiskType == "" {
		c.DiskType = DefaultDiskType
	}
	if c.ServiceAccount != nil && c.ServiceAccount.Email != "" && len(c.ServiceAccount.Scopes) == 0 {
		sa := *c.ServiceAccount
		sa.Scopes = []string{defaultServiceScope}
		c.ServiceAccount = &sa
	}
	if c.OperationWaitSeconds == nil {
		n := int(DefaultOperationWait / time.Second)
		c.OperationWaitSeconds = &n
	}
	if c.RequestTimeoutSeconds == 0 {
		c.RequestTimeoutSeconds = int(DefaultRequestTimeout / time.Second)
	}
	c.Endpoint = strings.TrimRight(c.Endpoint, "/")
	return c
}

// Validate checks a config with its defaults applied; every error names
// its field.
func (c Config) Validate() error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Project == "" {
		add("project is required")
	} else if !projectRE.MatchString(c.Project) {
		add("project %q is not a project ID", c.Project)
	}
	if len(c.Zones) == 0 {
		add("zones: at least one zone is required")
	}
	seen := map[string]bool{}
	for i, z := range c.Zones {
		if !zoneRE.MatchString(z) {
			add("zones[%d] %q is not a zone such as europe-west1-b", i, z)
		}
		if seen[z] {
			add("zones[%d] %q is listed twice", i, z)
		}
		seen[z] = true
	}
	if len(c.MachineTypes) == 0 {
		add("machineTypes: at least one machine type is required")
	}
	for i, m := range c.MachineTypes {
		if !resourceRE.MatchString(m) {
			add("machineTypes[%d] %q is not a machine type name", i, m)
		}
	}
	if len(c.Images) == 0 {
		add("images: at least one image is required")
	}
	for k, v := range c.Images {
		if !strings.HasPrefix(v, "projects/") && !strings.HasPrefix(v, "global/images/") && !strings.HasPrefix(v, "https://") {
			add("images.%s %q: want projects/<p>/global/images/<name>, projects/<p>/global/images/family/<family> or a URL", k, v)
		}
	}
	if !strings.Contains(c.Network, "networks/") {
		add("network %q: want global/networks/<name> or projects/<p>/global/networks/<name>", c.Network)
	}
	if c.Subnetwork != "" && !strings.Contains(c.Subnetwork, "/subnetworks/") {
		add("subnetwork %q: want regions/<region>/subnetworks/<name>", c.Subnetwork)
	}
	switch c.Address {
	case AddressExternal:
		if !*c.ExternalIP {
			add("address external needs externalIP: true")
		}
	case AddressInternal:
	default:
		add("address %q: want external or internal", c.Address)
	}
	if c.ServiceAccount != nil {
		if c.ServiceAccount.Email == "" {
			add("serviceAccount.email is required when serviceAccount is given")
		} else if !strings.Contains(c.ServiceAccount.Email, "@") {
			add("serviceAccount.email %q is not an email address", c.ServiceAccount.Email)
		}
		for i, s := range c.ServiceAccount.Scopes {
			if !strings.HasPrefix(s, "https://www.googleapis.com/auth/") {
				add("serviceAccount.scopes[%d] %q: want https://www.googleapis.com/auth/<scope>", i, s)
			}
		}
	}
	for i, t := range c.NetworkTags {
		if !tagRE.MatchString(t) {
			add("networkTags[%d] %q: lowercase letters, digits and dashes, starting with a letter, at most 63", i, t)
		}
	}
	for k, v := range c.Labels {
		switch {
		case !labelKeyRE.MatchString(k):
			add("labels.%s: a label key is lowercase letters, digits, '_' and '-', starting with a letter", k)
		case strings.HasPrefix(k, labelPrefix):
			add("labels.%s: keys starting with %s are the provisioner's own", k, labelPrefix)
		case !labelValRE.MatchString(v):
			add("labels.%s %q: a label value is lowercase letters, digits, '_' and '-', at most 63", k, v)
		}
	}
	if len(c.Labels) > 60 {
		add("labels: at most 60 (Compute allows 64, the provisioner sets four)")
	}
	if c.DiskSizeGB < 10 || c.DiskSizeGB > 65536 {
		add("diskSizeGb %d: want 10 to 65536", c.DiskSizeGB)
	}
	if !resourceRE.MatchString(c.DiskType) {
		add("diskType %q is not a disk type name such as pd-balanced", c.DiskType)
	}
	if c.Preemptible && c.Spot {
		add("preemptible and spot: set one of them")
	}
	if *c.OperationWaitSeconds < 0 || *c.OperationWaitSeconds > 600 {
		add("operationWaitSeconds %d: want 0 to 600", *c.OperationWaitSeconds)
	}
	if c.RequestTimeoutSeconds < 0 {
		add("requestTimeoutSeconds: want above zero")
	}
	if c.Endpoint != "" {
		u, err := url.Parse(c.Endpoint)
		if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
			add("endpoint %q: want an http(s) URL", c.Endpoint)
		}
	}
	if c.WithoutAuthentication && c.Endpoint == "" {
		add("withoutAuthentication needs endpoint: it is for tests and emulators")
	}
	if c.WithoutAuthentication && c.CredentialsFile != "" {
		add("credentialsFile and withoutAuthentication: set one of them")
	}
	return errors.Join(errs...)
}

// zoneFor picks the placement's zone: the one asked for, which must be
// configured, or the only configured one.
func (c Config) zoneFor(zone string) (string, error) {
	if zone == "" {
		if len(c.Zones) == 1 {
			return c.Zones[0], nil
		}
		return "", fmt.Errorf("placement.zone is required: the provider has zones %v", c.Zones)
	}
	for _, z := range c.Zones {
		if z == zone {
			return z, nil
		}
	}
	return "", fmt.Errorf("placement.zone %q is not one of the provider's zones %v", zone, c.Zones)
}

func (c Config) machineTypeFor(mt string) (string, error) {
	if mt == "" {
		if len(c.MachineTypes) == 1 {
			return c.MachineTypes[0], nil
		}
		return "", fmt.Errorf("placement.machineType is required: the provider allows %v", c.MachineTypes)
	}
	for _, m := range c.MachineTypes {
		if m == mt {
			return m, nil
		}
	}
	return "", fmt.Errorf("placement.machineType %q is not one of the provider's machine types %v", mt, c.MachineTypes)
}

func (c Config) imageFor(key string) (string, error) {
	if key == "" {
		if len(c.Images) == 1 {
			for _, v := range c.Images {
				return v, nil
			}
		}
		return "", fmt.Errorf("placement.image is required: the provider has images %v", imageKeys(c.Images))
	}
	if v, ok := c.Images[key]; ok {
		return v, nil
	}
	return "", fmt.Errorf("placement.image %q is not one of the provider's images %v", key, imageKeys(c.Images))
}

func imageKeys(m map[string]string) []string { return slices.Sorted(maps.Keys(m)) }
