// Package kubernetes is the Kubernetes backend of the provisioner runtime:
// each proxy is one bare Pod running Squid on the host network of a
// cluster node, created through the API server with client-go.
// docs/provisioner-kubernetes.md describes the behaviour.
package kubernetes

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
)

// Config is the kubernetes block of a provider in the providers YAML.
type Config struct {
	// Kubeconfig is a kubeconfig file; empty uses the in-cluster config
	// (the pod's service account).
	Kubeconfig string `yaml:"kubeconfig"`
	// Context is the kubeconfig context; empty uses its current context.
	Context string `yaml:"context"`
	// Namespace holds the proxies' pods. Required.
	Namespace string `yaml:"namespace"`
	// Image is the Squid image (DefaultImage when empty).
	Image string `yaml:"image"`
	// Images are further images a placement may pick by key
	// (placement.image); the empty key is Image.
	Images map[string]string `yaml:"images"`
	// ImagePullPolicy is Always, IfNotPresent or Never (IfNotPresent).
	ImagePullPolicy string `yaml:"imagePullPolicy"`
	// ImagePullSecrets name Secrets of the namespace.
	ImagePullSecrets []string `yaml:"imagePullSecrets"`
	// Resources are the Squid container's requests and limits, as in a
	// Pod (DefaultResources when empty).
	Resources map[string]any `yaml:"resources"`
	// MachineTypes are resource profiles a placement may pick by key
	// (placement.machineType), each like Resources.
	MachineTypes map[string]map[string]any `yaml:"machineTypes"`
	// MaxFileDescriptors caps Squid's descriptor table, and with it the
	// memory Squid reserves at start (DefaultMaxFileDescriptors).
	MaxFileDescriptors int `yaml:"maxFileDescriptors"`
	// AuthHelper is Squid's basic_ncsa_auth in the image
	// (DefaultAuthHelper): the proxies with credentials check them with it.
	AuthHelper string `yaml:"authHelper"`
	// AllowedClients are the source networks Squid serves (CIDRs;
	// DefaultAllowedClients when empty). Everyone else is denied.
	AllowedClients []string `yaml:"allowedClients"`
	// Scheduling applies to every pod; a zone's own is added to it.
	Scheduling `yaml:",inline"`
	// Zones are the placements' zones, each with its own scheduling. When
	// empty, placement.zone and placement.region become node selectors on
	// ZoneLabel and RegionLabel.
	Zones map[string]Scheduling `yaml:"zones"`
	// RegionLabel and ZoneLabel are the node labels placement.region and
	// placement.zone select on (topology.kubernetes.io/region, /zone).
	RegionLabel string `yaml:"regionLabel"`
	ZoneLabel   string `yaml:"zoneLabel"`
	// Labels and Annotations are added to every pod.
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
	// ServiceAccountName runs the pods as this account (the namespace's
	// default when empty); its token is never mounted.
	ServiceAccountName string `yaml:"serviceAccountName"`
	// PriorityClassName is the pods' priority class.
	PriorityClassName string `yaml:"priorityClassName"`
	// ListPageSize is List's page size (DefaultListPageSize).
	ListPageSize int `yaml:"listPageSize"`
	// RequestTimeoutSeconds bounds each API request (30).
	RequestTimeoutSeconds int `yaml:"requestTimeoutSeconds"`
}

// Scheduling is where pods may run: node labels, taints they tolerate,
// and affinity rules, each written as in a Pod spec.
type Scheduling struct {
	NodeSelector map[string]string `yaml:"nodeSelector"`
	Tolerations  []map[string]any  `yaml:"tolerations"`
	Affinity     map[string]any    `yaml:"affinity"`
}

// Defaults.
const (
	// DefaultImage is Ubuntu's Squid image.
	DefaultImage              = "ubuntu/squid:6.6-24.04_edge"
	DefaultMaxFileDescriptors = 4096
	// DefaultAuthHelper is where Debian's and Ubuntu's squid packages
	// (and so DefaultImage) install basic_ncsa_auth.
	DefaultAuthHelper     = "/usr/lib/squid/basic_ncsa_auth"
	DefaultListPageSize   = 500
	DefaultRequestTimeout = 30 * time.Second
	DefaultRegionLabel    = corev1.LabelTopologyRegion
	DefaultZoneLabel      = corev1.LabelTopologyZone
)

// DefaultAllowedClients are the private and loopback ranges: a proxy on a
// node's address must not be open to the internet.
var DefaultAllowedClients = []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8", "fc00::/7", "::1/128"}

// DefaultResources keep a proxy small but give Squid room for its
// descriptor table.
var DefaultResources = map[string]any{
	"requests": map[string]any{"cpu": "50m", "memory": "64Mi"},
	"limits":   map[string]any{"memory": "256Mi"},
}

// settings is a validated Config in the API's own types.
type settings struct {
	cfg          Config
	images       map[string]string
	resources    corev1.ResourceRequirements
	machineTypes map[string]corev1.ResourceRequirements
	base         scheduling
	zones        map[string]scheduling
	allowed      []netip.Prefix
	timeout      time.Duration
}

type scheduling struct {
	nodeSelector map[string]string
	tolerations  []corev1.Toleration
	affinity     *corev1.Affinity
}

// WithDefaults returns c with the defaults applied.
func (c Config) WithDefaults() Config {
	if c.Image == "" {
		c.Image = DefaultImage
	}
	if c.ImagePullPolicy == "" {
		c.ImagePullPolicy = string(corev1.PullIfNotPresent)
	}
	if len(c.Resources) == 0 {
		c.Resources = DefaultResources
	}
	if c.MaxFileDescriptors == 0 {
		c.MaxFileDescriptors = DefaultMaxFileDescriptors
	}
	if len(c.AllowedClients) == 0 {
		c.AllowedClients = DefaultAllowedClients
	}
	if c.AuthHelper == "" {
		c.AuthHelper = DefaultAuthHelper
	}
	if c.RegionLabel == "" {
		c.RegionLabel = DefaultRegionLabel
	}
	if c.ZoneLabel == "" {
		c.ZoneLabel = DefaultZoneLabel
	}
	if c.ListPageSize == 0 {
		c.ListPageSize = DefaultListPageSize
	}
	if c.RequestTimeoutSeconds == 0 {
		c.RequestTimeoutSeconds = int(DefaultRequestTimeout / time.Second)
	}
	return c
}

// compile validates c (defaults applied) and converts its Pod-shaped
// parts into the API's types. Every error names its field.
func (c Config) compile() (*settings, error) {
	s := &settings{cfg: c, images: map[string]string{"": c.Image}, zones: map[string]scheduling{},
		machineTypes: map[string]corev1.ResourceRequirements{}}
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Namespace == "" {
		add("namespace is required")
	} else if msgs := validation.IsDNS1123Label(c.Namespace); len(msgs) > 0 {
		add("namespace %q: %s", c.Namespace, strings.Join(msgs, "; "))
	}
	if c.Context != "" && c.Kubeconfig == "" {
		add("context needs kubeconfig: the in-cluster config has no contexts")
	}
	for k, v := range c.Images {
		if k == "" || strings.TrimSpace(v) == "" || strings.ContainsAny(v, " \t\n") {
			add("images.%s %q: want a non-empty key and an image reference", k, v)
		}
		s.images[k] = v
	}
	if strings.ContainsAny(c.Image, " \t\n") {
		add("image %q is not an image reference", c.Image)
	}
	switch corev1.PullPolicy(c.ImagePullPolicy) {
	case corev1.PullAlways, corev1.PullIfNotPresent, corev1.PullNever:
	default:
		add("imagePullPolicy %q: want Always, IfNotPresent or Never", c.ImagePullPolicy)
	}
	for i, n := range c.ImagePullSecrets {
		if msgs := validation.IsDNS1123Subdomain(n); len(msgs) > 0 {
			add("imagePullSecrets[%d] %q: %s", i, n, strings.Join(msgs, "; "))
		}
	}
	if err := decodeStrict(c.Resources, &s.resources); err != nil {
		add("resources: %v", err)
	}
	for k, v := range c.MachineTypes {
		var r corev1.ResourceRequirements
		if err := decodeStrict(v, &r); err != nil {
			add("machineTypes.%s: %v", k, err)
		}
		s.machineTypes[k] = r
	}
	if c.MaxFileDescriptors < 64 || c.MaxFileDescriptors > 1<<20 {
		add("maxFileDescriptors %d: want 64 to 1048576", c.MaxFileDescriptors)
	}
	if !strings.HasPrefix(c.AuthHelper, "/") || strings.ContainsAny(c.AuthHelper, " \t\n\r\"'#") {
		add("authHelper %q: want the absolute path of basic_ncsa_auth in the image, without spaces or quotes", c.AuthHelper)
	}
	for i, a := range c.AllowedClients {
		p, err := netip.ParsePrefix(a)
		if err != nil {
			add("allowedClients[%d] %q is not a CIDR such as 10.0.0.0/8", i, a)
			continue
		}
		s.allowed = append(s.allowed, p.Masked())
	}
	var err error
	if s.base, err = c.Scheduling.compile(); err != nil {
		add("%v", err)
	}
	for _, z := range slices.Sorted(maps.Keys(c.Zones)) {
		if z == "" {
			add("zones: a zone needs a name")
			continue
		}
		zs, err := c.Zones[z].compile()
		if err != nil {
			add("zones.%s.%v", z, err)
		}
		s.zones[z] = zs
	}
	for _, l := range []struct{ field, v string }{{"regionLabel", c.RegionLabel}, {"zoneLabel", c.ZoneLabel}} {
		if msgs := validation.IsQualifiedName(l.v); len(msgs) > 0 {
			add("%s %q: %s", l.field, l.v, strings.Join(msgs, "; "))
		}
	}
	for k, v := range c.Labels {
		if msgs := validation.IsQualifiedName(k); len(msgs) > 0 {
			add("labels.%s: %s", k, strings.Join(msgs, "; "))
		} else if ownKey(k) {
			add("labels.%s: this key is the provisioner's own", k)
		} else if msgs := validation.IsValidLabelValue(v); len(msgs) > 0 {
			add("labels.%s %q: %s", k, v, strings.Join(msgs, "; "))
		}
	}
	for k := range c.Annotations {
		if msgs := validation.IsQualifiedName(k); len(msgs) > 0 {
			add("annotations.%s: %s", k, strings.Join(msgs, "; "))
		} else if ownKey(k) {
			add("annotations.%s: this key is the provisioner's own", k)
		}
	}
	if c.ServiceAccountName != "" {
		if msgs := validation.IsDNS1123Subdomain(c.ServiceAccountName); len(msgs) > 0 {
			add("serviceAccountName %q: %s", c.ServiceAccountName, strings.Join(msgs, "; "))
		}
	}
	if c.ListPageSize < 1 || c.ListPageSize > 5000 {
		add("listPageSize %d: want 1 to 5000", c.ListPageSize)
	}
	if c.RequestTimeoutSeconds < 1 || c.RequestTimeoutSeconds > 600 {
		add("requestTimeoutSeconds %d: want 1 to 600", c.RequestTimeoutSeconds)
	}
	s.timeout = time.Duration(c.RequestTimeoutSeconds) * time.Second
	return s, errors.Join(errs...)
}

func (sc Scheduling) compile() (scheduling, error) {
	out := scheduling{nodeSelector: sc.NodeSelector}
	var errs []error
	for k, v := range sc.NodeSelector {
		if msgs := validation.IsQualifiedName(k); len(msgs) > 0 {
			errs = append(errs, fmt.Errorf("nodeSelector.%s: %s", k, strings.Join(msgs, "; ")))
		} else if msgs := validation.IsValidLabelValue(v); len(msgs) > 0 {
			errs = append(errs, fmt.Errorf("nodeSelector.%s %q: %s", k, v, strings.Join(msgs, "; ")))
		}
	}
	for i, t := range sc.Tolerations {
		var tol corev1.Toleration
		if err := decodeStrict(t, &tol); err != nil {
			errs = append(errs, fmt.Errorf("tolerations[%d]: %v", i, err))
		}
		out.tolerations = append(out.tolerations, tol)
	}
	if len(sc.Affinity) > 0 {
		out.affinity = &corev1.Affinity{}
		if err := decodeStrict(sc.Affinity, out.affinity); err != nil {
			errs = append(errs, fmt.Errorf("affinity: %v", err))
		}
	}
	return out, errors.Join(errs...)
}

// decodeStrict converts a YAML value into an API type through its JSON
// form, refusing fields the type does not have.
func decodeStrict(v any, into any) error {
	if v == nil {
		return nil
	}
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(into); err != nil {
		return errors.New(strings.TrimPrefix(err.Error(), "json: "))
	}
	return nil
}

// forPlacement resolves a placement into the pod's scheduling, image and
// resources; an unknown key is an error naming the placement field.
func (s *settings) forPlacement(region, zone, machineType, image string) (scheduling, string, corev1.ResourceRequirements, error) {
	sch := scheduling{nodeSelector: maps.Clone(s.base.nodeSelector), tolerations: slices.Clone(s.base.tolerations), affinity: s.base.affinity}
	if sch.nodeSelector == nil {
		sch.nodeSelector = map[string]string{}
	}
	if region != "" {
		if msgs := validation.IsValidLabelValue(region); len(msgs) > 0 {
			return sch, "", corev1.ResourceRequirements{}, fmt.Errorf("placement.region %q is not a label value: %s", region, strings.Join(msgs, "; "))
		}
		sch.nodeSelector[s.cfg.RegionLabel] = region
	}
	switch {
	case zone == "":
	case len(s.zones) > 0:
		z, ok := s.zones[zone]
		if !ok {
			return sch, "", corev1.ResourceRequirements{}, fmt.Errorf("placement.zone %q is not one of the provider's zones %v", zone, slices.Sorted(maps.Keys(s.zones)))
		}
		maps.Copy(sch.nodeSelector, z.nodeSelector)
		sch.tolerations = append(sch.tolerations, z.tolerations...)
		if z.affinity != nil {
			sch.affinity = z.affinity
		}
	default:
		if msgs := validation.IsValidLabelValue(zone); len(msgs) > 0 {
			return sch, "", corev1.ResourceRequirements{}, fmt.Errorf("placement.zone %q is not a label value: %s", zone, strings.Join(msgs, "; "))
		}
		sch.nodeSelector[s.cfg.ZoneLabel] = zone
	}
	img, ok := s.images[image]
	if !ok {
		return sch, "", corev1.ResourceRequirements{}, fmt.Errorf("placement.image %q is not one of the provider's images %v", image, slices.Sorted(maps.Keys(s.cfg.Images)))
	}
	res := s.resources
	if machineType != "" {
		r, ok := s.machineTypes[machineType]
		if !ok {
			return sch, "", corev1.ResourceRequirements{}, fmt.Errorf("placement.machineType %q is not one of the provider's machine types %v", machineType, slices.Sorted(maps.Keys(s.machineTypes)))
		}
		res = r
	}
	return sch, img, res, nil
}
