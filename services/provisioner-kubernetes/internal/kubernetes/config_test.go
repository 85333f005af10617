package kubernetes

import (
	"strings"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/providers"
)

func TestConfigRejectsUnknownKeysWithTheirPath(t *testing.T) {
	t.Parallel()
	cases := map[string]struct{ block, want string }{
		"top level":           {"namespace: p\nnamespase: q\n", "providers[0].kubernetes.namespase: unknown field"},
		"zone scheduling":     {"namespace: p\nzones:\n  a: {nodeSelectr: {x: y}}\n", "providers[0].kubernetes.zones.a.nodeSelectr: unknown field"},
		"inside a toleration": {"namespace: p\ntolerations:\n  - {key: a, operater: Exists}\n", `tolerations[0]: unknown field "operater"`},
		"inside affinity":     {"namespace: p\naffinity: {nodeAffinity: {requiredDuringScheduling: {}}}\n", `affinity: unknown field "requiredDuringScheduling"`},
		"inside resources":    {"namespace: p\nresources: {request: {cpu: 1}}\n", `resources: unknown field "request"`},
		"zone affinity":       {"namespace: p\nzones:\n  a:\n    affinity: {podAffinty: {}}\n", `zones.a.affinity: unknown field "podAffinty"`},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := fromYAML(t, tc.block)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func fromYAML(t *testing.T, block string) (*Backend, error) {
	t.Helper()
	indented := "      " + strings.ReplaceAll(strings.TrimRight(block, "\n"), "\n", "\n      ")
	cfg, err := providers.Parse([]byte("providers:\n  - name: k8s\n    type: kubernetes\n    kubernetes:\n" + indented + "\n"))
	if err != nil {
		return nil, err
	}
	p, _ := cfg.Get("k8s")
	return FromProvider(p, nil, Options{})
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	cases := map[string]struct{ block, want string }{
		"no namespace":     {"image: squid\n", "namespace is required"},
		"bad namespace":    {"namespace: Proxies\n", `namespace "Proxies"`},
		"pull policy":      {"namespace: p\nimagePullPolicy: Sometimes\n", "imagePullPolicy \"Sometimes\""},
		"fd cap":           {"namespace: p\nmaxFileDescriptors: 10\n", "maxFileDescriptors 10"},
		"cidr":             {"namespace: p\nallowedClients: [10.0.0.0]\n", `allowedClients[0] "10.0.0.0"`},
		"own label":        {"namespace: p\nlabels: {app.kubernetes.io/managed-by: me}\n", "labels.app.kubernetes.io/managed-by: this key is the provisioner's own"},
		"bad label value":  {"namespace: p\nlabels: {team: 'a b'}\n", `labels.team "a b"`},
		"context alone":    {"namespace: p\ncontext: prod\n", "context needs kubeconfig"},
		"bad quantity":     {"namespace: p\nresources: {limits: {memory: lots}}\n", "resources:"},
		"bad machine type": {"namespace: p\nmachineTypes: {big: {limits: {cpu: many}}}\n", "machineTypes.big:"},
		"selector value":   {"namespace: p\nnodeSelector: {zone: 'a b'}\n", `nodeSelector.zone "a b"`},
		"zone label":       {"namespace: p\nzoneLabel: 'no spaces allowed'\n", "zoneLabel"},
		"request timeout":  {"namespace: p\nrequestTimeoutSeconds: -1\n", "requestTimeoutSeconds -1"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := fromYAML(t, tc.block)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
	b, err := fromYAML(t, "namespace: proxies\nkubeconfig: /nonexistent\nzones:\n  fra:\n    nodeSelector: {uplink: fra}\n    tolerations: [{key: egress, operator: Exists}]\n"+
		"machineTypes:\n  big: {requests: {cpu: 500m, memory: 256Mi}}\nimages: {debug: 'example.com/squid:debug'}\n")
	if err != nil {
		t.Fatalf("a valid block: %v", err)
	}
	if b.s.cfg.Image != DefaultImage || b.s.cfg.MaxFileDescriptors != DefaultMaxFileDescriptors || len(b.s.allowed) != len(DefaultAllowedClients) {
		t.Errorf("defaults not applied: %+v", b.s.cfg)
	}
}

func TestPlacementResolution(t *testing.T) {
	t.Parallel()
	zoned := mustSettings(t, Config{Namespace: "p", Scheduling: Scheduling{NodeSelector: map[string]string{"egress": "yes"}},
		Zones: map[string]Scheduling{"fra": {NodeSelector: map[string]string{"uplink": "fra"},
			Affinity: map[string]any{"nodeAffinity": map[string]any{"requiredDuringSchedulingIgnoredDuringExecution": map[string]any{
				"nodeSelectorTerms": []any{map[string]any{"matchExpressions": []any{map[string]any{"key": "isp", "operator": "In", "values": []any{"a", "b"}}}}}}}}}},
		MachineTypes: map[string]map[string]any{"big": {"requests": map[string]any{"cpu": "1"}}},
		Images:       map[string]string{"debug": "example.com/squid:debug"}})
	sch, img, res, err := zoned.forPlacement("", "fra", "big", "debug")
	if err != nil {
		t.Fatal(err)
	}
	if sch.nodeSelector["egress"] != "yes" || sch.nodeSelector["uplink"] != "fra" || sch.nodeSelector[DefaultZoneLabel] != "" {
		t.Errorf("nodeSelector %v: want the base's and the zone's, no topology label", sch.nodeSelector)
	}
	terms := sch.affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms
	if len(terms) != 1 || terms[0].MatchExpressions[0].Key != "isp" || len(terms[0].MatchExpressions[0].Values) != 2 {
		t.Errorf("affinity %+v", sch.affinity)
	}
	if img != "example.com/squid:debug" || res.Requests.Cpu().String() != "1" {
		t.Errorf("image %q resources %v", img, res)
	}
	// The base selector is not changed by a placement.
	if _, ok := zoned.base.nodeSelector["uplink"]; ok {
		t.Error("a zone's selector leaked into the base")
	}
	for _, bad := range []struct{ region, zone, mt, image, want string }{
		{"", "ber", "", "", `placement.zone "ber" is not one of the provider's zones [fra]`},
		{"", "", "huge", "", `placement.machineType "huge"`},
		{"", "", "", "nightly", `placement.image "nightly"`},
		{"a b", "", "", "", `placement.region "a b"`},
	} {
		if _, _, _, err := zoned.forPlacement(bad.region, bad.zone, bad.mt, bad.image); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("placement %+v: %v, want %q", bad, err, bad.want)
		}
	}
	plain := mustSettings(t, Config{Namespace: "p"})
	sch, _, _, err = plain.forPlacement("europe-west", "europe-west-b", "", "")
	if err != nil {
		t.Fatal(err)
	}
	if sch.nodeSelector[DefaultRegionLabel] != "europe-west" || sch.nodeSelector[DefaultZoneLabel] != "europe-west-b" {
		t.Errorf("without zones, region and zone select on the topology labels: %v", sch.nodeSelector)
	}
}
