package chart

import (
	"slices"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
)

// TestConsole: the console's Deployment reaches the three APIs by their
// Services, mounts only its session keys (the chart's own random Secret,
// or the one given), and its optional Ingress and NetworkPolicy rule
// expose the pages only.
func TestConsole(t *testing.T) {
	t.Parallel()
	r := render(t, []string{"all-kinds.yaml"})
	d := typed[*appsv1.Deployment](r.Objects)[relName+"-console"]
	if d == nil {
		t.Fatal("no console Deployment")
	}
	env := map[string]string{}
	for _, e := range d.Spec.Template.Spec.Containers[0].Env {
		env[e.Name] = e.Value
	}
	for k, want := range map[string]string{
		"EGRESS_ORCHESTRATOR_ADDR": relName + "-orchestrator:8100", "EGRESS_LEASE_ADDR": relName + "-lease:8110",
		"EGRESS_HEALTH_ADDR": relName + "-health:8120", "EGRESS_SESSION_KEY_FILE": "/etc/egress/console/session-keys",
		"EGRESS_SECURE_COOKIES": "auto", "EGRESS_HTTP_LISTEN": ":8090",
	} {
		if env[k] != want {
			t.Errorf("console %s = %q, want %q", k, env[k], want)
		}
	}
	if _, ok := env["EGRESS_AUTH_TOKEN_FILE"]; ok {
		t.Error("the console reads a token file; it must call with the users' tokens only")
	}
	sec := typed[*corev1.Secret](r.Objects)[relName+"-console-session"]
	if sec == nil || len(sec.Data["session-keys"]) < 40 {
		t.Fatalf("the chart's session key Secret: %v", sec)
	}
	if len(typed[*networkingv1.Ingress](r.Objects)) != 0 {
		t.Error("an Ingress without console.ingress.enabled")
	}

	r = render(t, []string{"all-kinds.yaml"}, map[string]any{"console": map[string]any{
		"sessionKeySecret": "console-keys", "secureCookies": "true", "gatewayMetricsURL": "http://gw:8181/metrics",
		"ingress": map[string]any{"enabled": true, "className": "nginx", "host": "console.example",
			"tls": []any{map[string]any{"secretName": "console-tls", "hosts": []any{"console.example"}}}},
	}, "networkPolicy": map[string]any{"enabled": true, "consoleClients": []any{
		map[string]any{"namespaceSelector": map[string]any{"matchLabels": map[string]any{"name": "ingress"}}}}}})
	if _, ok := typed[*corev1.Secret](r.Objects)[relName+"-console-session"]; ok {
		t.Error("the chart made a session key Secret although one is given")
	}
	d = typed[*appsv1.Deployment](r.Objects)[relName+"-console"]
	var vols []string
	for _, v := range d.Spec.Template.Spec.Volumes {
		if v.Secret != nil {
			vols = append(vols, v.Secret.SecretName)
		}
	}
	if !slices.Equal(vols, []string{"console-keys"}) {
		t.Errorf("console Secrets %v, want [console-keys]", vols)
	}
	ing := typed[*networkingv1.Ingress](r.Objects)[relName+"-console"]
	if ing == nil || *ing.Spec.IngressClassName != "nginx" || ing.Spec.Rules[0].Host != "console.example" ||
		ing.Spec.Rules[0].HTTP.Paths[0].Backend.Service.Name != relName+"-console" || ing.Spec.TLS[0].SecretName != "console-tls" {
		t.Errorf("console Ingress %+v", ing)
	}
	pol := typed[*networkingv1.NetworkPolicy](r.Objects)[relName+"-console"]
	if pol == nil {
		t.Fatal("no console NetworkPolicy")
	}
	found := false
	for _, rule := range pol.Spec.Ingress {
		if len(rule.From) == 1 && rule.From[0].NamespaceSelector != nil && rule.From[0].NamespaceSelector.MatchLabels["name"] == "ingress" {
			found = true
			if len(rule.Ports) != 1 || rule.Ports[0].Port.String() != "http" {
				t.Errorf("console clients reach %v, want the http port only", rule.Ports)
			}
		}
	}
	if !found {
		t.Errorf("console NetworkPolicy lets no console client in: %+v", pol.Spec.Ingress)
	}
	for name, p := range typed[*networkingv1.NetworkPolicy](r.Objects) {
		for _, rule := range p.Spec.Ingress {
			for _, from := range rule.From {
				if name != relName+"-console" && from.NamespaceSelector != nil && from.NamespaceSelector.MatchLabels["name"] == "ingress" {
					t.Errorf("%s lets the console's clients in", name)
				}
			}
		}
	}
}
