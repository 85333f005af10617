package chart

import (
	"strings"
	"testing"
)

// TestBadValuesRefused: values the chart must refuse, each with the error
// naming the field, before anything reaches a cluster.
func TestBadValuesRefused(t *testing.T) {
	t.Parallel()
	pve := map[string]any{"name": "pve-home", "type": "proxmox", "existingSecret": "pve-home-credentials"}
	with := func(k string, v any) map[string]any {
		out := map[string]any{}
		for a, b := range pve {
			out[a] = b
		}
		if v == nil {
			delete(out, k)
		} else {
			out[k] = v
		}
		return out
	}
	tests := []struct {
		name      string
		overrides map[string]any
		want      string
	}{
		{"no database secret", map[string]any{"database": map[string]any{"existingSecret": ""}}, "/database/existingSecret"},
		{"database URL in values", map[string]any{"database": map[string]any{"url": "postgres://u:pw@db/egress"}}, "url"},
		{"no auth secret", map[string]any{"auth": map[string]any{"existingSecret": ""}}, "/auth/existingSecret"},
		{"no service credentials", map[string]any{"serviceCredentials": map[string]any{"existingSecret": ""}}, "/serviceCredentials/existingSecret"},
		{"http probe target", map[string]any{"health": map[string]any{"probeTarget": "http://probe.example/"}}, "/health/probeTarget"},
		{"unknown top-level key", map[string]any{"components": map[string]any{}}, "components"},
		{"gateway service type", map[string]any{"gateway": map[string]any{"service": map[string]any{"type": "ExternalName"}}}, "/gateway/service/type"},
		{"gateway ports shared", map[string]any{"gateway": map[string]any{"socksPort": 8080}}, "gateway.socksPort: port 8080 is already gateway.proxyPort"},
		{"gateway autoscaling min above max", map[string]any{"gateway": map[string]any{"autoscaling": map[string]any{
			"enabled": true, "minReplicas": 5, "maxReplicas": 2}}}, "gateway.autoscaling: minReplicas 5 is above maxReplicas 2"},
		{"gateway proxy port", map[string]any{"gateway": map[string]any{"proxyPort": 0}}, "/gateway/proxyPort"},
		{"console cookie mode", map[string]any{"console": map[string]any{"secureCookies": "yes"}}, "/console/secureCookies"},
		{"console gateway URL", map[string]any{"console": map[string]any{"gatewayMetricsURL": "gateway:8181"}}, "/console/gatewayMetricsURL"},
		{"console ingress TLS without secret", map[string]any{"console": map[string]any{"ingress": map[string]any{"tls": []any{map[string]any{"hosts": []any{"c.example"}}}}}}, "secretName"},
		{"unknown provisioner key", map[string]any{"provisioners": []any{with("replica", 2)}}, "replica"},
		{"provisioner type", map[string]any{"provisioners": []any{with("type", "vsphere")}}, "/provisioners/0/type"},
		{"provisioner name", map[string]any{"provisioners": []any{with("name", "PVE_home")}}, "/provisioners/0/name"},
		{"zero replicas", map[string]any{"provisioners": []any{with("replicas", 0)}}, "/provisioners/0/replicas"},
		{"proxmox without secret", map[string]any{"provisioners": []any{with("existingSecret", nil)}}, "existingSecret"},
		{"autoscaling without bounds", map[string]any{"provisioners": []any{with("autoscaling", map[string]any{"enabled": true})}}, "minReplicas"},
		{"autoscaling min above max", map[string]any{"provisioners": []any{with("autoscaling", map[string]any{
			"enabled": true, "minReplicas": 5, "maxReplicas": 2, "targetCPUUtilizationPercentage": 50})}}, "provisioners[0].autoscaling: minReplicas 5 is above maxReplicas 2"},
		{"provisioner for unknown provider", map[string]any{"provisioners": []any{with("name", "pve-away")}}, `provisioners[0].name: "pve-away" is not a provider in providers (it has pve-home)`},
		{"provisioner type differs from provider", map[string]any{"provisioners": []any{map[string]any{"name": "pve-home", "type": "kvm", "existingSecret": "k"}}}, `provisioners[0].type: "kvm", but provider "pve-home" is of type "proxmox"`},
		{"provider listed twice", map[string]any{"provisioners": []any{pve, pve}}, `provisioners[1].name: "pve-home" already has provisioners`},
		{"port out of range", map[string]any{"lease": map[string]any{"grpcPort": 70000}}, "/lease/grpcPort"},
		{"nats URL", map[string]any{"nats": map[string]any{"url": "http://nats:4222"}}, "/nats/url"},
		{"no stream replicas", map[string]any{"nats": map[string]any{"streamReplicas": 0}}, "/nats/streamReplicas"},
		{"more stream replicas than JetStream allows", map[string]any{"nats": map[string]any{"streamReplicas": 7}}, "/nats/streamReplicas"},
		{"log level", map[string]any{"log": map[string]any{"level": "verbose"}}, "/log/level"},
		{"network peer", map[string]any{"networkPolicy": map[string]any{"crawlers": []any{map[string]any{"pods": "all"}}}}, "pods"},
		{"env name", map[string]any{"orchestrator": map[string]any{"env": map[string]any{"bad name": "x"}}}, "'bad name'"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			vals, err := Values([]string{"minimal.yaml"}, tc.overrides)
			if err != nil {
				t.Fatal(err)
			}
			_, err = Render(relName, relNS, vals)
			if err == nil {
				t.Fatalf("values %v rendered; want an error naming %q", tc.overrides, tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not name %q", err, tc.want)
			}
		})
	}
}
