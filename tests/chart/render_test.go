package chart

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/release"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

const (
	relName = "eg"
	relNS   = "egress"
)

func render(t *testing.T, files []string, overrides ...map[string]any) *Rendered {
	t.Helper()
	vals, err := Values(files, overrides...)
	if err != nil {
		t.Fatal(err)
	}
	r, err := Render(relName, relNS, vals)
	if err != nil {
		t.Fatalf("render %v: %v", files, err)
	}
	return r
}

// typed returns every object of type T, by name.
func typed[T any](objs []Object) map[string]T {
	out := map[string]T{}
	for _, o := range objs {
		if v, ok := o.Typed.(T); ok {
			out[o.Name] = v
		}
	}
	return out
}

func hookObjects(r *Rendered) []Object {
	out := make([]Object, len(r.Hooks))
	for i, h := range r.Hooks {
		out[i] = h.Object
	}
	return out
}

// podSpecs is every pod template the release and its hooks create.
func podSpecs(r *Rendered) map[string]corev1.PodSpec {
	out := map[string]corev1.PodSpec{}
	all := append(slices.Clone(r.Objects), hookObjects(r)...)
	for name, d := range typed[*appsv1.Deployment](all) {
		out["Deployment/"+name] = d.Spec.Template.Spec
	}
	for name, j := range typed[*batchv1.Job](all) {
		out["Job/"+name] = j.Spec.Template.Spec
	}
	for name, p := range typed[*corev1.Pod](all) {
		out["Pod/"+name] = p.Spec
	}
	return out
}

func envValue(c corev1.Container, name string) (string, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value, true
		}
	}
	return "", false
}

func secretEnvRefs(c corev1.Container) []string {
	var out []string
	for _, e := range c.Env {
		if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
			out = append(out, e.ValueFrom.SecretKeyRef.Name+"/"+e.ValueFrom.SecretKeyRef.Key)
		}
	}
	return out
}

// TestRenderEveryValuesFile renders each values file under testdata and
// checks what every install must have.
func TestRenderEveryValuesFile(t *testing.T) {
	t.Parallel()
	files, err := ValuesFiles()
	if err != nil || len(files) < 3 {
		t.Fatalf("values files %v, %v: want at least 3", files, err)
	}
	for _, f := range files {
		t.Run(f, func(t *testing.T) {
			t.Parallel()
			r := render(t, []string{f})
			checkSecurity(t, r)
			checkProbes(t, r)
			checkServices(t, r)
			checkMigrationHook(t, r)
		})
	}
}

func checkSecurity(t *testing.T, r *Rendered) {
	t.Helper()
	specs := podSpecs(r)
	if len(specs) < 5 {
		t.Fatalf("only %d pod templates: %v", len(specs), slices.Sorted(maps.Keys(specs)))
	}
	for name, spec := range specs {
		psc := spec.SecurityContext
		if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser != 65532 ||
			psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
			t.Errorf("%s: pod securityContext %+v, want non-root 65532 with seccomp RuntimeDefault", name, psc)
		}
		// Only a kubernetes provisioner talks to the API server, as its own
		// account (TestKubernetesProvisionerRBAC).
		ownAccount := strings.HasPrefix(name, "Deployment/") && spec.ServiceAccountName == strings.TrimPrefix(name, "Deployment/") &&
			kubernetesProvisioner(r, spec.ServiceAccountName)
		if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken != ownAccount {
			t.Errorf("%s: automountServiceAccountToken %v, want %v: only kubernetes provisioners talk to the API server", name, spec.AutomountServiceAccountToken, ownAccount)
		}
		for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
			sc := c.SecurityContext
			if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
				sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
				sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0 {
				t.Errorf("%s/%s: securityContext %+v, want read-only root, no privilege escalation, all capabilities dropped", name, c.Name, sc)
			}
			if !strings.HasPrefix(c.Image, "egress-proxies/") || !strings.HasSuffix(c.Image, ":0.1.0") {
				t.Errorf("%s/%s: image %q, want egress-proxies/<name>:0.1.0", name, c.Name, c.Image)
			}
		}
		if !strings.HasPrefix(name, "Deployment/") {
			continue
		}
		var tmp bool
		for _, v := range spec.Volumes {
			if v.Name == "tmp" && v.EmptyDir != nil {
				tmp = true
			}
		}
		var mounted bool
		for _, m := range spec.Containers[0].VolumeMounts {
			if m.Name == "tmp" && m.MountPath == "/tmp" && !m.ReadOnly {
				mounted = true
			}
		}
		if !tmp || !mounted {
			t.Errorf("%s: no writable emptyDir on /tmp (volume %v, mounted %v)", name, tmp, mounted)
		}
	}
}

func checkProbes(t *testing.T, r *Rendered) {
	t.Helper()
	for name, d := range typed[*appsv1.Deployment](r.Objects) {
		if len(d.Spec.Template.Spec.Containers) != 1 {
			t.Fatalf("%s: %d containers, want 1", name, len(d.Spec.Template.Spec.Containers))
		}
		c := d.Spec.Template.Spec.Containers[0]
		for _, p := range []struct {
			kind  string
			probe *corev1.Probe
			path  string
		}{{"liveness", c.LivenessProbe, "/healthz"}, {"readiness", c.ReadinessProbe, "/readyz"}} {
			if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path || p.probe.HTTPGet.Port != intstr.FromString("http") {
				t.Errorf("%s: %s probe %+v, want GET %s on port http", name, p.kind, p.probe, p.path)
			}
		}
		ports := map[string]int32{}
		for _, p := range c.Ports {
			ports[p.Name] = p.ContainerPort
		}
		if listen, _ := envValue(c, "EGRESS_HTTP_LISTEN"); listen != fmt.Sprintf(":%d", ports["http"]) {
			t.Errorf("%s: EGRESS_HTTP_LISTEN %q but the http port is %d", name, listen, ports["http"])
		}
		if listen, _ := envValue(c, "EGRESS_GRPC_LISTEN"); listen != fmt.Sprintf(":%d", ports["grpc"]) {
			t.Errorf("%s: EGRESS_GRPC_LISTEN %q but the grpc port is %d", name, listen, ports["grpc"])
		}
	}
}

// checkServices: every Deployment has a Service with a gRPC and an HTTP
// port selecting exactly its pods.
func checkServices(t *testing.T, r *Rendered) {
	t.Helper()
	svcs := typed[*corev1.Service](r.Objects)
	for name, d := range typed[*appsv1.Deployment](r.Objects) {
		s, ok := svcs[name]
		if !ok {
			t.Errorf("Deployment %s has no Service", name)
			continue
		}
		if !maps.Equal(s.Spec.Selector, d.Spec.Selector.MatchLabels) {
			t.Errorf("Service %s selects %v, Deployment matches %v", name, s.Spec.Selector, d.Spec.Selector.MatchLabels)
		}
		var names []string
		for _, p := range s.Spec.Ports {
			names = append(names, p.Name)
		}
		want := []string{"grpc", "http"}
		if name == relName+"-gateway" {
			want = append(want, "proxy", "socks")
		}
		if !slices.Equal(names, want) {
			t.Errorf("Service %s ports %v, want %v", name, names, want)
		}
	}
	// Selectors must not overlap: one Deployment's pods never match another's.
	deps := typed[*appsv1.Deployment](r.Objects)
	for a, da := range deps {
		for b, db := range deps {
			if a != b && subset(da.Spec.Selector.MatchLabels, db.Spec.Template.Labels) {
				t.Errorf("Deployment %s's selector matches %s's pods", a, b)
			}
		}
	}
}

func subset(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// checkMigrationHook: one Job, a pre-install and pre-upgrade hook, runs
// every schema's migrations; no Deployment migrates on its own.
func checkMigrationHook(t *testing.T, r *Rendered) {
	t.Helper()
	var jobs []Hook
	for _, h := range r.Hooks {
		if h.Kind == "Job" {
			jobs = append(jobs, h)
		}
	}
	if len(jobs) != 1 {
		t.Fatalf("%d Job hooks, want 1", len(jobs))
	}
	h := jobs[0]
	if !slices.Equal(h.Events, []release.HookEvent{release.HookPreInstall, release.HookPreUpgrade}) {
		t.Errorf("migration Job hook events %v, want pre-install, pre-upgrade", h.Events)
	}
	job := h.Typed.(*batchv1.Job)
	spec := job.Spec.Template.Spec
	var migrated []string
	for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
		if !slices.Equal(c.Args, []string{"migrate"}) || !strings.HasSuffix(c.Image, "/"+c.Name+":0.1.0") {
			t.Errorf("migration container %s: image %s args %v, want its own image with args [migrate]", c.Name, c.Image, c.Args)
		}
		if refs := secretEnvRefs(c); !slices.Equal(refs, []string{"egress-database/url"}) {
			t.Errorf("migration container %s: Secret refs %v, want only the database URL", c.Name, refs)
		}
		migrated = append(migrated, c.Name)
	}
	if !slices.Equal(migrated, []string{"orchestrator", "lease", "health"}) {
		t.Errorf("migrations run for %v, want orchestrator, lease, health in order", migrated)
	}
	if spec.RestartPolicy != corev1.RestartPolicyNever || spec.ServiceAccountName != "" {
		t.Errorf("migration pod: restartPolicy %q serviceAccountName %q, want Never and none (the release's account is not there before install)", spec.RestartPolicy, spec.ServiceAccountName)
	}
	for _, o := range r.Objects {
		if o.Kind == "Job" {
			t.Errorf("Job %s is installed with the release, not as a hook", o.Name)
		}
	}
	// Every service with a database has the one migrate flag off.
	withDB := map[string]bool{"orchestrator": true, "lease": true, "health": true}
	for name, d := range typed[*appsv1.Deployment](r.Objects) {
		c := d.Spec.Template.Spec.Containers[0]
		if withDB[c.Name] {
			if v, _ := envValue(c, "EGRESS_MIGRATE"); v != "false" {
				t.Errorf("%s: EGRESS_MIGRATE=%q, want false: the hook migrates", name, v)
			}
		}
	}
	var tests []Hook
	for _, h := range r.Hooks {
		if slices.Contains(h.Events, release.HookTest) {
			tests = append(tests, h)
		}
	}
	if len(tests) != 1 || tests[0].Kind != "Pod" {
		t.Fatalf("test hooks %v, want one Pod", tests)
	}
	pod := tests[0].Typed.(*corev1.Pod)
	var calls [][]string
	for _, c := range append(slices.Clone(pod.Spec.InitContainers), pod.Spec.Containers...) {
		calls = append(calls, c.Args)
	}
	want := [][]string{{"proxies", "list"}, {"leases", "proxies"}, {"health", "providers"}}
	if !slices.EqualFunc(calls, want, slices.Equal) || pod.Spec.RestartPolicy != corev1.RestartPolicyNever {
		t.Errorf("test pod calls %v (restart %s), want %v, Never", calls, pod.Spec.RestartPolicy, want)
	}
}

// TestProvisionerList: one Deployment per provisioner entry with its own
// replicas, HPA, type's image and Secret, and health told about each.
func TestProvisionerList(t *testing.T) {
	t.Parallel()
	r := render(t, []string{"all-kinds.yaml"})
	deps := typed[*appsv1.Deployment](r.Objects)
	hpas := typed[*autoscalingv2.HorizontalPodAutoscaler](r.Objects)

	tests := []struct {
		provider, image string
		replicas        int32 // 0: autoscaled
		secret          string
		extraEnv        map[string]string
	}{
		{"pve-a", "provisioner-proxmox", 3, "pve-a-credentials", nil},
		{"pve-b", "provisioner-proxmox", 0, "pve-b-credentials", nil},
		{"kvm-lab", "provisioner-kvm", 2, "kvm-lab-ssh", nil},
		{"gcp-eu", "provisioner-gcp", 2, "gcp-eu-service-account",
			map[string]string{"GOOGLE_APPLICATION_CREDENTIALS": "/etc/egress/secrets/gcp-eu/credentials.json"}},
		{"local", "provisioner-local", 1, "", nil},
	}
	var wantDeps []string
	for _, tc := range tests {
		name := relName + "-provisioner-" + tc.provider
		wantDeps = append(wantDeps, name)
		d, ok := deps[name]
		if !ok {
			t.Errorf("no Deployment %s", name)
			continue
		}
		c := d.Spec.Template.Spec.Containers[0]
		if c.Image != "egress-proxies/"+tc.image+":0.1.0" {
			t.Errorf("%s: image %s, want %s", name, c.Image, tc.image)
		}
		if p, _ := envValue(c, "EGRESS_PROVIDER"); p != tc.provider {
			t.Errorf("%s: EGRESS_PROVIDER %q, want %q", name, p, tc.provider)
		}
		for k, v := range tc.extraEnv {
			if got, _ := envValue(c, k); got != v {
				t.Errorf("%s: %s=%q, want %q", name, k, got, v)
			}
		}
		if d.Labels["egress-proxies.io/provider"] != tc.provider {
			t.Errorf("%s: provider label %q", name, d.Labels["egress-proxies.io/provider"])
		}
		hpa, autoscaled := hpas[name]
		switch {
		case tc.replicas == 0 && (d.Spec.Replicas != nil || !autoscaled):
			t.Errorf("%s: replicas %v, HPA %v: want no replicas and an HPA", name, d.Spec.Replicas, autoscaled)
		case tc.replicas != 0 && (d.Spec.Replicas == nil || *d.Spec.Replicas != tc.replicas || autoscaled):
			t.Errorf("%s: replicas %v, HPA %v: want %d and no HPA", name, d.Spec.Replicas, autoscaled, tc.replicas)
		}
		if autoscaled {
			checkHPA(t, hpa, name, 2, 5, 70, "4")
		}
	}
	var gotDeps []string
	for name := range deps {
		if strings.Contains(name, "-provisioner-") {
			gotDeps = append(gotDeps, name)
		}
	}
	sort.Strings(gotDeps)
	sort.Strings(wantDeps)
	if !slices.Equal(gotDeps, wantDeps) {
		t.Errorf("provisioner Deployments %v, want %v", gotDeps, wantDeps)
	}
	checkHPA(t, hpas[relName+"-lease"], relName+"-lease", 2, 4, 80, "")

	health := deps[relName+"-health"].Spec.Template.Spec.Containers[0]
	addrs, _ := envValue(health, "EGRESS_PROVISIONER")
	wantAddrs := "pve-a=eg-provisioner-pve-a:8130,pve-b=eg-provisioner-pve-b:8130,kvm-lab=eg-provisioner-kvm-lab:8130,gcp-eu=eg-provisioner-gcp-eu:8130,local=eg-provisioner-local:8130"
	if addrs != wantAddrs {
		t.Errorf("health EGRESS_PROVISIONER=%q, want %q", addrs, wantAddrs)
	}

	// The orchestrator's pools read the providers' health with the
	// service token.
	orch := deps[relName+"-orchestrator"].Spec.Template.Spec.Containers[0]
	var healthGRPC int32
	for _, p := range health.Ports {
		if p.Name == "grpc" {
			healthGRPC = p.ContainerPort
		}
	}
	for env, want := range map[string]string{
		"EGRESS_HEALTH_ADDR":       fmt.Sprintf("%s-health:%d", relName, healthGRPC),
		"EGRESS_HEALTH_TOKEN_FILE": "/etc/egress/credentials/service-token",
	} {
		if got, _ := envValue(orch, env); got != want {
			t.Errorf("orchestrator %s=%q, want %q", env, got, want)
		}
	}

	// A PDB exactly for the Deployments that can run more than one pod.
	pdbs := typed[*policyv1.PodDisruptionBudget](r.Objects)
	for name, d := range deps {
		min := int32(0)
		if d.Spec.Replicas != nil {
			min = *d.Spec.Replicas
		} else if h, ok := hpas[name]; ok && h.Spec.MinReplicas != nil {
			min = *h.Spec.MinReplicas
		}
		pdb, ok := pdbs[name]
		if ok != (min > 1) {
			t.Errorf("%s (at least %d pods): PDB %v, want one only above 1 pod", name, min, ok)
		}
		if ok && (pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() != 1 || !maps.Equal(pdb.Spec.Selector.MatchLabels, d.Spec.Selector.MatchLabels)) {
			t.Errorf("PDB %s: %+v, want maxUnavailable 1 over the Deployment's pods", name, pdb.Spec)
		}
		ts := d.Spec.Template.Spec.TopologySpreadConstraints
		if len(ts) != 1 || ts[0].TopologyKey != "kubernetes.io/hostname" || !maps.Equal(ts[0].LabelSelector.MatchLabels, d.Spec.Selector.MatchLabels) {
			t.Errorf("%s: topology spread %+v, want one over hostnames selecting its own pods", name, ts)
		}
	}
}

func checkHPA(t *testing.T, h *autoscalingv2.HorizontalPodAutoscaler, name string, min, max, cpu int32, inFlight string) {
	t.Helper()
	if h == nil {
		t.Errorf("no HPA %s", name)
		return
	}
	if h.Spec.ScaleTargetRef.Kind != "Deployment" || h.Spec.ScaleTargetRef.Name != name ||
		h.Spec.MinReplicas == nil || *h.Spec.MinReplicas != min || h.Spec.MaxReplicas != max {
		t.Errorf("HPA %s: target %+v min %v max %d, want Deployment %s %d..%d", name, h.Spec.ScaleTargetRef, h.Spec.MinReplicas, h.Spec.MaxReplicas, name, min, max)
	}
	var gotCPU int32
	var gotInFlight string
	for _, m := range h.Spec.Metrics {
		switch {
		case m.Resource != nil && m.Resource.Name == corev1.ResourceCPU:
			gotCPU = *m.Resource.Target.AverageUtilization
		case m.Pods != nil && m.Pods.Metric.Name == "egress_provisioner_in_flight":
			gotInFlight = m.Pods.Target.AverageValue.String()
		default:
			t.Errorf("HPA %s: unexpected metric %+v", name, m)
		}
	}
	if gotCPU != cpu || gotInFlight != inFlight {
		t.Errorf("HPA %s: cpu %d in-flight %q, want %d %q", name, gotCPU, gotInFlight, cpu, inFlight)
	}
}

// TestSecretsMountedOnlyWhereNeeded lists, for every pod template, the
// Secrets it can read (volumes and env) and compares with what it needs.
func TestSecretsMountedOnlyWhereNeeded(t *testing.T) {
	t.Parallel()
	db := "egress-database/url"
	tests := []struct {
		file string
		want map[string][]string
	}{
		{"all-kinds.yaml", map[string][]string{
			"Deployment/eg-orchestrator": {"egress-auth", "egress-service-credentials", db, "eg-cloud-init-keys"},
			"Deployment/eg-lease":        {"egress-auth", "egress-service-credentials", db},
			"Deployment/eg-health":       {"egress-auth", "egress-service-credentials", db},
			// Provisioners fetch proxies' credentials with the service token.
			"Deployment/eg-provisioner-pve-a":   {"egress-auth", "egress-service-credentials", "pve-a-credentials"},
			"Deployment/eg-provisioner-pve-b":   {"egress-auth", "egress-service-credentials", "pve-b-credentials"},
			"Deployment/eg-provisioner-kvm-lab": {"egress-auth", "egress-service-credentials", "kvm-lab-ssh"},
			"Deployment/eg-provisioner-gcp-eu":  {"egress-auth", "egress-service-credentials", "gcp-eu-service-account"},
			"Deployment/eg-provisioner-local":   {"egress-auth", "egress-service-credentials"},
			"Job/eg-migrate-1":                  {db},
			"Pod/eg-test-services":              {"egress-service-credentials/viewer-token"},
			// The console calls with each user's token: only its session keys.
			"Deployment/eg-console": {"eg-console-session"},
			// Crawlers' tokens to check, the service token to lease with.
			"Deployment/eg-gateway": {"egress-auth", "egress-service-credentials"},
		}},
		{"auth-disabled.yaml", map[string][]string{
			"Deployment/eg-orchestrator":      {db, "eg-cloud-init-keys"},
			"Deployment/eg-lease":             {db},
			"Deployment/eg-health":            {db},
			"Deployment/eg-provisioner-local": nil,
			"Job/eg-migrate-1":                {db},
			"Pod/eg-test-services":            nil,
			"Deployment/eg-console":           {"eg-console-session"},
			"Deployment/eg-gateway":           nil,
		}},
	}
	for _, tc := range tests {
		t.Run(tc.file, func(t *testing.T) {
			t.Parallel()
			r := render(t, []string{tc.file})
			specs := podSpecs(r)
			if !slices.Equal(slices.Sorted(maps.Keys(specs)), slices.Sorted(maps.Keys(tc.want))) {
				t.Fatalf("pod templates %v, want %v", slices.Sorted(maps.Keys(specs)), slices.Sorted(maps.Keys(tc.want)))
			}
			for name, spec := range specs {
				got := map[string]bool{}
				mounted := map[string]string{}
				for _, v := range spec.Volumes {
					if v.Secret != nil {
						got[v.Secret.SecretName] = true
						mounted[v.Name] = v.Secret.SecretName
					}
					if v.Projected != nil {
						t.Errorf("%s: projected volume %s: secrets must be plain volumes to be checked", name, v.Name)
					}
				}
				for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
					for _, ref := range secretEnvRefs(c) {
						got[ref] = true
					}
					for _, e := range c.EnvFrom {
						t.Errorf("%s/%s: envFrom %+v exposes whole objects", name, c.Name, e)
					}
					for _, m := range c.VolumeMounts {
						if s, ok := mounted[m.Name]; ok && !m.ReadOnly {
							t.Errorf("%s/%s: Secret %s mounted writable", name, c.Name, s)
						}
						if s, ok := mounted[m.Name]; ok && strings.HasPrefix(s, "pve-") && m.MountPath != "/etc/egress/secrets/"+strings.TrimSuffix(s, "-credentials") {
							t.Errorf("%s/%s: Secret %s at %s, want /etc/egress/secrets/<provider>", name, c.Name, s, m.MountPath)
						}
					}
				}
				if gotList := slices.Sorted(maps.Keys(got)); !slices.Equal(gotList, slices.Sorted(slices.Values(tc.want[name]))) {
					t.Errorf("%s reads Secrets %v, want %v", name, gotList, tc.want[name])
				}
			}
		})
	}
}

// TestProvidersChecksum: changing the providers config changes the pod
// template of every component that reads it, and of no other.
func TestProvidersChecksum(t *testing.T) {
	t.Parallel()
	before := render(t, []string{"all-kinds.yaml"})
	vals, err := Values([]string{"all-kinds.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	providers := vals["providers"].([]any)
	providers[0].(map[string]any)["proxmox"].(map[string]any)["url"] = "https://pve-a2.example.net:8006"
	after, err := Render(relName, relNS, vals)
	if err != nil {
		t.Fatal(err)
	}
	a, b := typed[*appsv1.Deployment](before.Objects), typed[*appsv1.Deployment](after.Objects)
	for name, d := range a {
		old := d.Spec.Template.Annotations["checksum/providers"]
		rolled := old != b[name].Spec.Template.Annotations["checksum/providers"]
		readsConfig := name != relName+"-lease" && name != relName+"-console" && name != relName+"-gateway"
		if readsConfig && (old == "" || !rolled) {
			t.Errorf("%s reads the providers config but its pods do not roll (checksum %q)", name, old)
		}
		if !readsConfig && (old != "" || rolled) {
			t.Errorf("%s does not read the providers config but carries its checksum", name)
		}
	}
	cms := typed[*corev1.ConfigMap](after.Objects)
	if cm := cms[relName+"-providers"]; cm == nil || !strings.Contains(cm.Data["providers.yaml"], "pve-a2.example.net") {
		t.Errorf("providers ConfigMap does not carry the new config: %v", cm)
	}
}

// TestNetworkPolicy: crawlers reach only lease and the gateway (its proxy
// ports too); only the orchestrator and
// health reach provisioners; monitoring only the HTTP ports.
func TestNetworkPolicy(t *testing.T) {
	t.Parallel()
	r := render(t, []string{"all-kinds.yaml"})
	pols := typed[*networkingv1.NetworkPolicy](r.Objects)
	deps := typed[*appsv1.Deployment](r.Objects)
	if len(pols) != len(deps) {
		t.Fatalf("%d NetworkPolicies for %d Deployments", len(pols), len(deps))
	}
	crawlers := "kubernetes.io/metadata.name=crawlers"
	monitoring := "kubernetes.io/metadata.name=monitoring"
	for name, d := range deps {
		p, ok := pols[name]
		if !ok {
			t.Errorf("no NetworkPolicy for %s", name)
			continue
		}
		if !maps.Equal(p.Spec.PodSelector.MatchLabels, d.Spec.Selector.MatchLabels) || !slices.Equal(p.Spec.PolicyTypes, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}) {
			t.Errorf("%s: policy selects %v types %v", name, p.Spec.PodSelector.MatchLabels, p.Spec.PolicyTypes)
		}
		peers := map[string][]string{} // peer -> ports it may reach
		for _, rule := range p.Spec.Ingress {
			var ports []string
			for _, port := range rule.Ports {
				ports = append(ports, port.Port.String())
			}
			for _, from := range rule.From {
				peers[peerString(from)] = append(peers[peerString(from)], ports...)
			}
		}
		component := d.Spec.Selector.MatchLabels["app.kubernetes.io/component"]
		want := map[string][]string{"ns:" + monitoring: {"http"}}
		switch {
		case strings.HasPrefix(component, "provisioner-"):
			want["pod:app.kubernetes.io/component=orchestrator,app.kubernetes.io/instance=eg,app.kubernetes.io/name=egress-proxies"] = []string{"grpc", "http"}
			want["pod:app.kubernetes.io/component=health,app.kubernetes.io/instance=eg,app.kubernetes.io/name=egress-proxies"] = []string{"grpc", "http"}
		default:
			want["pod:app.kubernetes.io/instance=eg,app.kubernetes.io/name=egress-proxies"] = []string{"grpc", "http"}
			want["pod:app=egressctl"] = []string{"grpc", "http"}
			if component == "lease" {
				want["ns:"+crawlers] = []string{"grpc", "http"}
			}
			if component == "gateway" {
				want["ns:"+crawlers] = []string{"proxy", "socks", "grpc", "http"}
			}
		}
		if !maps.EqualFunc(peers, want, slices.Equal) {
			t.Errorf("%s: ingress %v, want %v", name, peers, want)
		}
	}
	// Off by default.
	if n := len(typed[*networkingv1.NetworkPolicy](render(t, []string{"minimal.yaml"}).Objects)); n != 0 {
		t.Errorf("minimal values render %d NetworkPolicies, want none", n)
	}
}

func peerString(p networkingv1.NetworkPolicyPeer) string {
	var parts []string
	if p.NamespaceSelector != nil {
		parts = append(parts, "ns:"+labelString(p.NamespaceSelector.MatchLabels))
	}
	if p.PodSelector != nil {
		parts = append(parts, "pod:"+labelString(p.PodSelector.MatchLabels))
	}
	if p.IPBlock != nil {
		parts = append(parts, "ip:"+p.IPBlock.CIDR)
	}
	return strings.Join(parts, "+")
}

func labelString(m map[string]string) string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, k+"="+m[k])
	}
	return strings.Join(out, ",")
}

// TestMonitoring: the ServiceMonitor scrapes every Service's http port, the
// alerts use metrics the services export, and the dashboard is valid JSON
// labelled for the sidecar.
func TestMonitoring(t *testing.T) {
	t.Parallel()
	r := render(t, []string{"all-kinds.yaml"})
	var sm, rule *Object
	for i, o := range r.Objects {
		switch o.Kind {
		case "ServiceMonitor":
			sm = &r.Objects[i]
		case "PrometheusRule":
			rule = &r.Objects[i]
		}
	}
	if sm == nil || rule == nil {
		t.Fatalf("ServiceMonitor %v PrometheusRule %v, want both", sm != nil, rule != nil)
	}
	checkServiceMonitor(t, sm.Raw.Object, typed[*corev1.Service](r.Objects))
	checkAlerts(t, rule.Raw.Object)
	checkDashboard(t, typed[*corev1.ConfigMap](r.Objects)[relName+"-egress-proxies-dashboard"])

	if n := len(render(t, []string{"minimal.yaml"}).Objects); n == 0 {
		t.Fatal("minimal renders nothing")
	}
	for _, o := range render(t, []string{"minimal.yaml"}).Objects {
		if o.Kind == "ServiceMonitor" || o.Kind == "PrometheusRule" || strings.HasSuffix(o.Name, "-dashboard") {
			t.Errorf("%s %s rendered though not enabled", o.Kind, o.Name)
		}
	}
}

// TestStreamReplicasOnEveryService: every service ensures the streams with
// its own replica count, so all of them must be given the same one.
func TestStreamReplicasOnEveryService(t *testing.T) {
	t.Parallel()
	r := render(t, []string{"all-kinds.yaml"}, map[string]any{"nats": map[string]any{"streamReplicas": 3}})
	deployments := typed[*appsv1.Deployment](r.Objects)
	if len(deployments) < 4 {
		t.Fatalf("only %d Deployments", len(deployments))
	}
	for name, d := range deployments {
		for _, c := range d.Spec.Template.Spec.Containers {
			if v, ok := envValue(c, "EGRESS_NATS_STREAM_REPLICAS"); v != "3" {
				t.Errorf("%s/%s: EGRESS_NATS_STREAM_REPLICAS = %q (set %v), want 3", name, c.Name, v, ok)
			}
		}
	}
}
