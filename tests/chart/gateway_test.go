package chart

import (
	"encoding/json"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
)

// TestGateway: the gateway's Deployment leases from the lease Service with
// the service token, listens on both proxy ports and runs on one core
// unless gateway.env says otherwise; its Service carries
// them with the configured type; the HPA follows gateway.autoscaling; the
// console reads its metrics; gateway.enabled=false removes all of it.
func TestGateway(t *testing.T) {
	t.Parallel()
	name := relName + "-gateway"
	r := render(t, []string{"all-kinds.yaml"})
	d := typed[*appsv1.Deployment](r.Objects)[name]
	if d == nil {
		t.Fatal("no gateway Deployment")
	}
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 2 {
		t.Errorf("gateway replicas %v, want 2", d.Spec.Replicas)
	}
	c := d.Spec.Template.Spec.Containers[0]
	if !strings.HasPrefix(c.Image, "egress-proxies/gateway:") {
		t.Errorf("gateway image %s", c.Image)
	}
	for k, want := range map[string]string{
		"EGRESS_LEASE_ADDR": relName + "-lease:8110", "EGRESS_LEASE_TOKEN_FILE": "/etc/egress/credentials/service-token",
		"EGRESS_AUTH_TOKEN_FILE": "/etc/egress/auth/tokens", "EGRESS_PROXY_LISTEN": ":8080", "EGRESS_SOCKS_LISTEN": ":1080",
		"EGRESS_GRPC_LISTEN": ":8180", "EGRESS_HTTP_LISTEN": ":8181", "GOMAXPROCS": "1",
	} {
		if got, _ := envValue(c, k); got != want {
			t.Errorf("gateway %s = %q, want %q", k, got, want)
		}
	}
	if _, ok := envValue(c, "EGRESS_RULES_FILE"); ok {
		t.Error("EGRESS_RULES_FILE set without gateway.rules")
	}
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	if ports["proxy"] != 8080 || ports["socks"] != 1080 || ports["grpc"] != 8180 || ports["http"] != 8181 {
		t.Errorf("gateway container ports %v", ports)
	}
	svc := typed[*corev1.Service](r.Objects)[name]
	if svc == nil {
		t.Fatal("no gateway Service")
	}
	if svc.Spec.Type != corev1.ServiceTypeClusterIP {
		t.Errorf("gateway Service type %s, want ClusterIP by default", svc.Spec.Type)
	}
	if _, ok := typed[*autoscalingv2.HorizontalPodAutoscaler](r.Objects)[name]; ok {
		t.Error("gateway HPA without gateway.autoscaling.enabled")
	}
	if pdb := typed[*policyv1.PodDisruptionBudget](r.Objects)[name]; pdb == nil || pdb.Spec.MaxUnavailable.IntValue() != 1 {
		t.Errorf("gateway PDB %v, want maxUnavailable 1", pdb)
	}
	if got, _ := envValue(typed[*appsv1.Deployment](r.Objects)[relName+"-console"].Spec.Template.Spec.Containers[0], "EGRESS_GATEWAY_METRICS_URL"); got != "http://"+name+":8181/metrics" {
		t.Errorf("console gateway metrics URL %q, want the gateway's /metrics", got)
	}

	// LoadBalancer, autoscaling, ban rules, other ports.
	r = render(t, []string{"all-kinds.yaml"}, map[string]any{"gateway": map[string]any{
		"proxyPort": 3128, "socksPort": 1081,
		"service":     map[string]any{"type": "LoadBalancer", "annotations": map[string]any{"lb.example/internal": "true"}},
		"autoscaling": map[string]any{"enabled": true, "minReplicas": 3, "maxReplicas": 12, "targetCPUUtilizationPercentage": 60},
		"rules":       map[string]any{"rules": []any{map[string]any{"name": "forbidden", "outcome": "blocked", "status": []any{403}}}},
		"env":         map[string]any{"GOMAXPROCS": nil, "GOGC": "50"},
	}})
	svc = typed[*corev1.Service](r.Objects)[name]
	if svc.Spec.Type != corev1.ServiceTypeLoadBalancer || svc.Annotations["lb.example/internal"] != "true" {
		t.Errorf("gateway Service type %s annotations %v, want LoadBalancer with the annotation", svc.Spec.Type, svc.Annotations)
	}
	svcPorts := map[string]int32{}
	for _, p := range svc.Spec.Ports {
		svcPorts[p.Name] = p.Port
		if p.Name == "proxy" || p.Name == "socks" {
			if p.TargetPort.String() != p.Name {
				t.Errorf("gateway Service port %s targets %s", p.Name, p.TargetPort.String())
			}
		}
	}
	if svcPorts["proxy"] != 3128 || svcPorts["socks"] != 1081 {
		t.Errorf("gateway Service ports %v, want proxy 3128 socks 1081", svcPorts)
	}
	if other := typed[*corev1.Service](r.Objects)[relName+"-lease"]; other.Spec.Type != corev1.ServiceTypeClusterIP {
		t.Errorf("lease Service type %s: gateway.service.type must apply to the gateway only", other.Spec.Type)
	}
	d = typed[*appsv1.Deployment](r.Objects)[name]
	if d.Spec.Replicas != nil {
		t.Errorf("gateway replicas %d set although the HPA scales it", *d.Spec.Replicas)
	}
	checkHPA(t, typed[*autoscalingv2.HorizontalPodAutoscaler](r.Objects)[name], name, 3, 12, 60, "")
	c = d.Spec.Template.Spec.Containers[0]
	if got, _ := envValue(c, "EGRESS_RULES_FILE"); got != "/etc/egress/gateway/rules.yaml" {
		t.Errorf("EGRESS_RULES_FILE = %q", got)
	}
	cm := typed[*corev1.ConfigMap](r.Objects)[name+"-rules"]
	if cm == nil || !strings.Contains(cm.Data["rules.yaml"], "name: forbidden") {
		t.Fatalf("gateway rules ConfigMap %v", cm)
	}
	mounted := false
	for _, v := range d.Spec.Template.Spec.Volumes {
		if v.ConfigMap != nil && v.ConfigMap.Name == name+"-rules" {
			for _, m := range c.VolumeMounts {
				mounted = mounted || (m.Name == v.Name && m.MountPath == "/etc/egress/gateway" && m.ReadOnly)
			}
		}
	}
	if !mounted || d.Spec.Template.Annotations["checksum/rules"] == "" {
		t.Errorf("rules ConfigMap mounted %v, checksum %q", mounted, d.Spec.Template.Annotations["checksum/rules"])
	}
	if got, ok := envValue(c, "GOMAXPROCS"); ok {
		t.Errorf("gateway GOMAXPROCS = %q after gateway.env.GOMAXPROCS=null, want it unset (Go's default)", got)
	}
	for _, want := range []string{"EGRESS_PROXY_LISTEN=:3128", "EGRESS_SOCKS_LISTEN=:1081", "GOGC=50"} {
		k, v, _ := strings.Cut(want, "=")
		if got, _ := envValue(c, k); got != v {
			t.Errorf("gateway %s = %q, want %q", k, got, v)
		}
	}

	// Off: no gateway object, and the console shows no gateway figures.
	r = render(t, []string{"all-kinds.yaml"}, map[string]any{"gateway": map[string]any{"enabled": false}})
	for _, o := range r.Objects {
		if strings.HasPrefix(o.Name, name) {
			t.Errorf("%s %s rendered with gateway.enabled=false", o.Kind, o.Name)
		}
	}
	if got, ok := envValue(typed[*appsv1.Deployment](r.Objects)[relName+"-console"].Spec.Template.Spec.Containers[0], "EGRESS_GATEWAY_METRICS_URL"); ok {
		t.Errorf("console gateway metrics URL %q without a gateway", got)
	}
}

// TestGatewayDashboard: the dashboard has a Gateway row whose panels chart
// the gateway's own metrics (checkDashboard proves each name is exported).
func TestGatewayDashboard(t *testing.T) {
	t.Parallel()
	cm := typed[*corev1.ConfigMap](render(t, []string{"all-kinds.yaml"}).Objects)[relName+"-egress-proxies-dashboard"]
	if cm == nil {
		t.Fatal("no dashboard ConfigMap")
	}
	var dash struct {
		Panels []struct {
			Type, Title string
			Targets     []struct{ Expr string }
		}
	}
	if err := json.Unmarshal([]byte(cm.Data["egress-proxies.json"]), &dash); err != nil {
		t.Fatal(err)
	}
	row, exprs := false, ""
	for _, p := range dash.Panels {
		if p.Type == "row" && p.Title == "Gateway" {
			row = true
			continue
		}
		if row {
			for _, tg := range p.Targets {
				exprs += tg.Expr + "\n"
			}
		}
	}
	if !row {
		t.Fatal("no Gateway row on the dashboard")
	}
	for _, m := range []string{"egress_gateway_requests_total", "egress_gateway_bytes_total", "egress_gateway_active_tunnels"} {
		if !strings.Contains(exprs, m) {
			t.Errorf("Gateway row does not chart %s", m)
		}
	}
	checkMetricNames(t, "Gateway row", exprs)
}
