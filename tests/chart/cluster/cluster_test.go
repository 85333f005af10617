//go:build cluster

// Package cluster installs the chart into a real Kubernetes API server
// (etcd, kube-apiserver, controller-manager, scheduler) whose node is
// simulated by kwok: the API server validates every object, controllers
// create ReplicaSets and pods, hooks and `helm test` run their course in
// kwok's simulated time. No container runs here; the images are proven by
// `make test-images`. Run with `make test-cluster`.
package cluster

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/release"
	"helm.sh/helm/v3/pkg/releaseutil"
	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"

	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/tests/chart"
)

const (
	ns      = "egress"
	relName = "eg"
)

func helmConfig(t *testing.T, cp *controlPlane) *action.Configuration {
	t.Helper()
	flags := genericclioptions.NewConfigFlags(false)
	kc, n := cp.Kubeconfig, ns
	flags.KubeConfig, flags.Namespace = &kc, &n
	cfg := &action.Configuration{}
	must(t, cfg.Init(flags, ns, "secret", func(format string, v ...any) { t.Logf("helm: "+format, v...) }))
	return cfg
}

// event is one watch event on a Job or Deployment, with the resource
// version the API server stored it at (etcd's revision: one total order
// across kinds).
type event struct {
	kind, name string
	typ        watch.EventType
	rv         int64
	succeeded  bool   // a Job with a succeeded pod
	checksum   string // a Deployment's providers checksum
}

type recorder struct {
	mu     sync.Mutex
	events []event
}

func (r *recorder) add(e event) {
	r.mu.Lock()
	r.events = append(r.events, e)
	r.mu.Unlock()
}

func (r *recorder) snapshot() []event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events)
}

// record watches Jobs and Deployments of the namespace until ctx ends.
func record(ctx context.Context, t *testing.T, cp *controlPlane) *recorder {
	t.Helper()
	r := &recorder{}
	jw, err := cp.Client.BatchV1().Jobs(ns).Watch(ctx, metav1.ListOptions{})
	must(t, err)
	dw, err := cp.Client.AppsV1().Deployments(ns).Watch(ctx, metav1.ListOptions{})
	must(t, err)
	var wg sync.WaitGroup
	for _, w := range []watch.Interface{jw, dw} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ev := range w.ResultChan() {
				obj, err := meta.Accessor(ev.Object)
				if err != nil {
					continue
				}
				rv, _ := strconv.ParseInt(obj.GetResourceVersion(), 10, 64)
				e := event{name: obj.GetName(), typ: ev.Type, rv: rv}
				switch o := ev.Object.(type) {
				case *batchv1.Job:
					e.kind, e.succeeded = "Job", o.Status.Succeeded > 0
				case *appsv1.Deployment:
					e.kind, e.checksum = "Deployment", o.Spec.Template.Annotations["checksum/providers"]
				}
				r.add(e)
			}
		}()
	}
	t.Cleanup(func() { jw.Stop(); dw.Stop(); wg.Wait() })
	return r
}

func createSecrets(t *testing.T, cp *controlPlane) {
	t.Helper()
	ctx := context.Background()
	_, err := cp.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	must(t, err)
	secrets := map[string]map[string]string{
		"egress-database":            {"url": "postgres://egress:pw@postgres:5432/egress"},
		"egress-auth":                {"tokens": "crawler tok-crawler crawler\nsuite tok-service service\nboard tok-viewer viewer\n"},
		"egress-service-credentials": {"service-token": "tok-service", "viewer-token": "tok-viewer"},
		"pve-a-credentials":          {"token": "root@pam!egress=00000000-0000-0000-0000-000000000000", "ca.crt": "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n"},
		"pve-b-credentials":          {"token": "root@pam!egress=11111111-1111-1111-1111-111111111111"},
		"kvm-lab-ssh":                {"id_ed25519": "-----BEGIN OPENSSH PRIVATE KEY-----\n-----END OPENSSH PRIVATE KEY-----\n", "known_hosts": "kvm1.example.net ssh-ed25519 AAAA\n"},
		"gcp-eu-service-account":     {"credentials.json": `{"type":"service_account"}`},
	}
	for name, data := range secrets {
		_, err := cp.Client.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name}, StringData: data}, metav1.CreateOptions{})
		must(t, err)
	}
	// Pods are refused until the namespace's default ServiceAccount exists.
	waittest.ForErr(t, 60*time.Second, "default ServiceAccount", func() error {
		_, err := cp.Client.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		return err
	})
}

// TestChartLifecycle installs the chart with every provisioner kind,
// upgrades it with a changed providers config, runs `helm test` and
// uninstalls it.
func TestChartLifecycle(t *testing.T) {
	cp := startControlPlane(t)
	createSecrets(t, cp)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rec := record(ctx, t, cp)
	cfg := helmConfig(t, cp)

	vals, err := allKindsValues()
	must(t, err)
	chrt, err := chart.Load()
	must(t, err)

	// Install and wait for every Deployment.
	inst := action.NewInstall(cfg)
	inst.ReleaseName, inst.Namespace = relName, ns
	inst.Wait, inst.WaitForJobs, inst.Timeout = true, true, 5*time.Minute
	began := time.Now()
	rel, err := inst.Run(chrt, vals)
	if err != nil {
		t.Fatalf("helm install: %v", err)
	}
	t.Logf("helm install --wait: %s", time.Since(began).Round(time.Millisecond))
	if rel.Info.Status != release.StatusDeployed {
		t.Fatalf("release status %s", rel.Info.Status)
	}

	t.Run("every object accepted", func(t *testing.T) { checkObjectsExist(t, cp, rel.Manifest) })
	deps := checkDeploymentsAvailable(t, cp, minPods)
	t.Run("migration hook before the Deployments", func(t *testing.T) {
		var created []event
		for _, e := range rec.snapshot() {
			if e.kind == "Deployment" && e.typ == watch.Added {
				created = append(created, e)
			}
		}
		if len(created) != len(deps) {
			t.Errorf("%d Deployments created, %d exist", len(created), len(deps))
		}
		checkHookFirst(t, rec.snapshot(), "eg-migrate-1", created)
	})

	// Upgrade with a changed providers config: the components reading it roll.
	before := checksums(t, cp)
	rs0 := replicaSets(t, cp)
	vals["providers"].([]any)[0].(map[string]any)["proxmox"].(map[string]any)["url"] = "https://pve-a2.example.net:8006"
	up := action.NewUpgrade(cfg)
	up.Namespace = ns
	up.Wait, up.WaitForJobs, up.Timeout = true, true, 5*time.Minute
	mark := len(rec.snapshot())
	keysBefore, err := cp.Client.CoreV1().Secrets(ns).Get(context.Background(), relName+"-cloud-init-keys", metav1.GetOptions{})
	must(t, err)
	rel, err = up.Run(relName, chrt, vals)
	if err != nil {
		t.Fatalf("helm upgrade: %v", err)
	}
	// The generated keyring survives the upgrade unchanged (lookup).
	if keysAfter, err := cp.Client.CoreV1().Secrets(ns).Get(context.Background(), relName+"-cloud-init-keys", metav1.GetOptions{}); err != nil ||
		string(keysAfter.Data["keys.yaml"]) != string(keysBefore.Data["keys.yaml"]) || len(keysBefore.Data["keys.yaml"]) == 0 {
		t.Errorf("the generated keyring changed on upgrade (%v)", err)
	}
	t.Run("upgrade rolls the readers of the providers config", func(t *testing.T) {
		checkDeploymentsAvailable(t, cp, minPods)
		rs1 := replicaSets(t, cp)
		if len(rs0) != 10 || len(rs1) != 10 {
			t.Fatalf("ReplicaSets before %v after %v, want one per Deployment", rs0, rs1)
		}
		for name := range before {
			rolled := rs1[name] != rs0[name]
			// Lease, the console and the gateway do not read the providers config.
			if wantRoll := name != relName+"-lease" && name != relName+"-console" && name != relName+"-gateway"; rolled != wantRoll {
				t.Errorf("%s: rolled to a new ReplicaSet %v (%s -> %s), want %v", name, rolled, rs0[name], rs1[name], wantRoll)
			}
		}
		// The first change of each rolled Deployment's template comes after
		// the upgrade's migration Job succeeded.
		var rolledOut []event
		seen := map[string]bool{}
		for _, e := range rec.snapshot()[mark:] {
			if e.kind == "Deployment" && !seen[e.name] && e.checksum != "" && e.checksum != before[e.name] {
				seen[e.name] = true
				rolledOut = append(rolledOut, e)
			}
		}
		if len(rolledOut) != 7 {
			t.Errorf("%d Deployments took the new providers checksum, want 7", len(rolledOut))
		}
		checkHookFirst(t, rec.snapshot()[mark:], "eg-migrate-2", rolledOut)
	})

	t.Run("helm test", func(t *testing.T) {
		rt := action.NewReleaseTesting(cfg)
		rt.Namespace, rt.Timeout = ns, 3*time.Minute
		r, err := rt.Run(relName)
		if err != nil {
			t.Fatalf("helm test: %v", err)
		}
		var ran int
		for _, h := range r.Hooks {
			if slices.Contains(h.Events, release.HookTest) {
				ran++
				if h.LastRun.Phase != release.HookPhaseSucceeded {
					t.Errorf("test hook %s: %s", h.Name, h.LastRun.Phase)
				}
			}
		}
		if ran != 1 {
			t.Errorf("%d test hooks ran, want 1", ran)
		}
	})

	t.Run("uninstall leaves nothing", func(t *testing.T) {
		un := action.NewUninstall(cfg)
		un.Wait, un.Timeout = true, 3*time.Minute
		if _, err := un.Run(relName); err != nil {
			t.Fatalf("helm uninstall: %v", err)
		}
		checkNothingLeft(t, cp)
		// Except the keyring: stored cloud-init and proxy credentials
		// cannot be read without it.
		if _, err := cp.Client.CoreV1().Secrets(ns).Get(context.Background(), relName+"-cloud-init-keys", metav1.GetOptions{}); err != nil {
			t.Errorf("the generated keyring after uninstall: %v", err)
		}
	})
}

// checkObjectsExist gets every object of the release's manifest back from
// the API server.
func checkObjectsExist(t *testing.T, cp *controlPlane, manifest string) {
	t.Helper()
	dyn, err := dynamic.NewForConfig(cp.Config)
	must(t, err)
	dc, err := discovery.NewDiscoveryClientForConfig(cp.Config)
	must(t, err)
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	kinds := map[string]int{}
	for _, m := range releaseutil.SplitManifests(manifest) {
		objs, err := chart.Decode([]byte(m))
		must(t, err)
		for _, o := range objs {
			gvk := o.Raw.GroupVersionKind()
			mapping, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
			if err != nil {
				t.Errorf("%s %s: %v", o.Kind, o.Name, err)
				continue
			}
			var ri dynamic.ResourceInterface = dyn.Resource(mapping.Resource)
			if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
				ri = dyn.Resource(mapping.Resource).Namespace(ns)
			}
			got, err := ri.Get(context.Background(), o.Name, metav1.GetOptions{})
			if err != nil {
				t.Errorf("%s %s not in the cluster: %v", o.Kind, o.Name, err)
				continue
			}
			if got.GetLabels()["app.kubernetes.io/instance"] != relName {
				t.Errorf("%s %s: labels %v", o.Kind, o.Name, got.GetLabels())
			}
			kinds[o.Kind]++
		}
	}
	// all-kinds.yaml without the monitoring CRDs, which this cluster lacks
	// (the test installs with them off: see allKindsValues).
	// The Secrets are the console's session key and the cloud-init
	// keyring, which the chart makes.
	want := map[string]int{"ServiceAccount": 1, "ConfigMap": 2, "Service": 10, "Deployment": 10,
		"HorizontalPodAutoscaler": 2, "PodDisruptionBudget": 9, "NetworkPolicy": 10, "Secret": 2}
	for k, n := range want {
		if kinds[k] != n {
			t.Errorf("%d %s objects in the cluster, want %d (all: %v)", kinds[k], k, n, kinds)
		}
	}
}

// checkDeploymentsAvailable waits for every Deployment of the release to be
// Available with all its pods ready on the kwok node, and returns their
// names.
func checkDeploymentsAvailable(t *testing.T, cp *controlPlane, wantPods int) []string {
	t.Helper()
	ctx := context.Background()
	var names []string
	waittest.ForErr(t, 3*time.Minute, "Deployments Available", func() error {
		list, err := cp.Client.AppsV1().Deployments(ns).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + relName})
		if err != nil {
			return err
		}
		names = names[:0]
		for _, d := range list.Items {
			names = append(names, d.Name)
			avail := false
			for _, c := range d.Status.Conditions {
				if c.Type == appsv1.DeploymentAvailable && c.Status == corev1.ConditionTrue {
					avail = true
				}
			}
			want := *d.Spec.Replicas // defaulted by the API server, moved by HPAs
			if !avail || d.Status.ReadyReplicas != want || d.Status.UpdatedReplicas != want || d.Status.Replicas != want {
				return fmt.Errorf("%s: available %v, %d/%d ready, %d updated, %d total", d.Name, avail, d.Status.ReadyReplicas, want, d.Status.UpdatedReplicas, d.Status.Replicas)
			}
		}
		if len(list.Items) != 10 {
			return fmt.Errorf("%d Deployments, want 10", len(list.Items))
		}
		pods, err := cp.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + relName})
		if err != nil {
			return err
		}
		running := 0
		for _, p := range pods.Items {
			if p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodSucceeded {
				continue
			}
			if p.Spec.NodeName != cp.NodeName || p.Status.Phase != corev1.PodRunning {
				return fmt.Errorf("pod %s on %q is %s", p.Name, p.Spec.NodeName, p.Status.Phase)
			}
			running++
		}
		if running < wantPods {
			return fmt.Errorf("%d pods running, want %d", running, wantPods)
		}
		return nil
	})
	return slices.Clone(names)
}

// checkHookFirst: the migration Job succeeded at an earlier revision than
// the given Deployment events.
func checkHookFirst(t *testing.T, events []event, job string, deployments []event) {
	t.Helper()
	var done int64
	for _, e := range events {
		if e.kind == "Job" && e.name == job && e.succeeded && (done == 0 || e.rv < done) {
			done = e.rv
		}
	}
	if done == 0 {
		t.Fatalf("no success of Job %s seen (events %v)", job, events)
	}
	if len(deployments) == 0 {
		t.Fatal("no Deployment events")
	}
	for _, e := range deployments {
		if e.rv < done {
			t.Errorf("Deployment %s %s at revision %d, before the migration Job succeeded at %d", e.name, e.typ, e.rv, done)
		}
	}
}

func checksums(t *testing.T, cp *controlPlane) map[string]string {
	t.Helper()
	list, err := cp.Client.AppsV1().Deployments(ns).List(context.Background(), metav1.ListOptions{})
	must(t, err)
	out := map[string]string{}
	for _, d := range list.Items {
		out[d.Name] = d.Spec.Template.Annotations["checksum/providers"]
	}
	return out
}

// minPods is the pods all-kinds.yaml runs before any autoscaling: 2
// orchestrator, 1+ lease, 2 health, 2 console, 2 gateway, 3 pve-a, 1+
// pve-b, 2 kvm-lab, 2 gcp-eu, 1 local.
const minPods = 18

// allKindsValues are testdata/all-kinds.yaml without the prometheus-operator
// objects, whose CRDs this cluster does not have.
func allKindsValues() (map[string]any, error) {
	return chart.Values([]string{"all-kinds.yaml"}, map[string]any{"metrics": map[string]any{
		"serviceMonitor": map[string]any{"enabled": false}, "prometheusRule": map[string]any{"enabled": false}}})
}

// replicaSets maps each Deployment to its newest ReplicaSet.
func replicaSets(t *testing.T, cp *controlPlane) map[string]string {
	t.Helper()
	list, err := cp.Client.AppsV1().ReplicaSets(ns).List(context.Background(), metav1.ListOptions{})
	must(t, err)
	out := map[string]string{}
	newest := map[string]int64{}
	for _, rs := range list.Items {
		for _, o := range rs.OwnerReferences {
			rev, _ := strconv.ParseInt(rs.Annotations["deployment.kubernetes.io/revision"], 10, 64)
			if o.Kind == "Deployment" && rev >= newest[o.Name] {
				newest[o.Name], out[o.Name] = rev, rs.Name
			}
		}
	}
	return out
}

// checkNothingLeft waits until no object of the release is left in the
// namespace: workloads, pods, hooks and the release's own records.
func checkNothingLeft(t *testing.T, cp *controlPlane) {
	t.Helper()
	ctx := context.Background()
	sel := metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + relName}
	waittest.ForErr(t, 2*time.Minute, "nothing left after uninstall", func() error {
		var left []string
		add := func(kind string, n int, err error) {
			if err != nil {
				left = append(left, kind+": "+err.Error())
			} else if n > 0 {
				left = append(left, fmt.Sprintf("%d %s", n, kind))
			}
		}
		d, err := cp.Client.AppsV1().Deployments(ns).List(ctx, sel)
		add("Deployments", lenOr(d, err, func() int { return len(d.Items) }), err)
		rs, err := cp.Client.AppsV1().ReplicaSets(ns).List(ctx, sel)
		add("ReplicaSets", lenOr(rs, err, func() int { return len(rs.Items) }), err)
		p, err := cp.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		add("Pods", lenOr(p, err, func() int { return len(p.Items) }), err)
		s, err := cp.Client.CoreV1().Services(ns).List(ctx, metav1.ListOptions{})
		add("Services", lenOr(s, err, func() int { return len(s.Items) }), err)
		cm, err := cp.Client.CoreV1().ConfigMaps(ns).List(ctx, sel)
		add("ConfigMaps", lenOr(cm, err, func() int { return len(cm.Items) }), err)
		j, err := cp.Client.BatchV1().Jobs(ns).List(ctx, metav1.ListOptions{})
		add("Jobs", lenOr(j, err, func() int { return len(j.Items) }), err)
		h, err := cp.Client.AutoscalingV2().HorizontalPodAutoscalers(ns).List(ctx, sel)
		add("HPAs", lenOr(h, err, func() int { return len(h.Items) }), err)
		pdb, err := cp.Client.PolicyV1().PodDisruptionBudgets(ns).List(ctx, sel)
		add("PDBs", lenOr(pdb, err, func() int { return len(pdb.Items) }), err)
		np, err := cp.Client.NetworkingV1().NetworkPolicies(ns).List(ctx, sel)
		add("NetworkPolicies", lenOr(np, err, func() int { return len(np.Items) }), err)
		sa, err := cp.Client.CoreV1().ServiceAccounts(ns).List(ctx, sel)
		add("ServiceAccounts", lenOr(sa, err, func() int { return len(sa.Items) }), err)
		// Helm's release records; the namespace keeps only our input Secrets.
		sec, err := cp.Client.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{LabelSelector: "owner=helm"})
		add("release Secrets", lenOr(sec, err, func() int { return len(sec.Items) }), err)
		if len(left) > 0 {
			return fmt.Errorf("left: %s", strings.Join(left, ", "))
		}
		return nil
	})
}

func lenOr(obj any, err error, n func() int) int {
	if err != nil || obj == nil {
		return 0
	}
	return n()
}

// TestBadValuesRefusedByInstall: values the schema or the chart's rules
// refuse fail `helm install` before any object reaches the cluster.
func TestBadValuesRefusedByInstall(t *testing.T) {
	cp := startControlPlane(t)
	createSecrets(t, cp)
	cfg := helmConfig(t, cp)
	chrt, err := chart.Load()
	must(t, err)
	tests := []struct {
		name      string
		overrides map[string]any
		want      string
	}{
		{"no database secret", map[string]any{"database": map[string]any{"existingSecret": ""}}, "/database/existingSecret"},
		{"provisioner type", map[string]any{"provisioners": []any{map[string]any{"name": "pve-a", "type": "vsphere", "existingSecret": "x"}}}, "/provisioners/0/type"},
		{"provisioner of no provider", map[string]any{"provisioners": []any{map[string]any{"name": "pve-z", "type": "proxmox", "existingSecret": "x"}}}, `"pve-z" is not a provider`},
		{"proxmox without secret", map[string]any{"provisioners": []any{map[string]any{"name": "pve-a", "type": "proxmox"}}}, "existingSecret"},
		{"plain-http probe target", map[string]any{"health": map[string]any{"probeTarget": "http://probe.example/"}}, "/health/probeTarget"},
		{"negative replicas", map[string]any{"orchestrator": map[string]any{"replicas": -1}}, "/orchestrator/replicas"},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			vals, err := allKindsValues()
			must(t, err)
			for k, v := range tc.overrides {
				vals[k] = v
			}
			inst := action.NewInstall(cfg)
			inst.ReleaseName, inst.Namespace = fmt.Sprintf("bad%d", i), ns
			_, err = inst.Run(chrt, vals)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("install = %v, want an error naming %q", err, tc.want)
			}
		})
	}
	// Nothing of any attempt reached the cluster.
	for _, list := range []func() (int, error){
		func() (int, error) {
			l, err := cp.Client.AppsV1().Deployments(ns).List(context.Background(), metav1.ListOptions{})
			return lenOr(l, err, func() int { return len(l.Items) }), err
		},
		func() (int, error) {
			l, err := cp.Client.CoreV1().ConfigMaps(ns).List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=egress-proxies"})
			return lenOr(l, err, func() int { return len(l.Items) }), err
		},
		func() (int, error) {
			l, err := cp.Client.BatchV1().Jobs(ns).List(context.Background(), metav1.ListOptions{})
			return lenOr(l, err, func() int { return len(l.Items) }), err
		},
	} {
		if n, err := list(); err != nil || n != 0 {
			t.Errorf("after refused installs: %d objects (%v), want none", n, err)
		}
	}
}

// TestKubernetesProvisionerInstall installs a kubernetes provisioner: its
// Deployment becomes available as its own ServiceAccount, and the API
// server's authorizer grants that account exactly the pod verbs in the
// proxies' namespace, nothing in the release's namespace or cluster-wide.
func TestKubernetesProvisionerInstall(t *testing.T) {
	cp := startControlPlane(t)
	createSecrets(t, cp)
	ctx := context.Background()
	_, err := cp.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "egress-proxies"}}, metav1.CreateOptions{})
	must(t, err)
	cfg := helmConfig(t, cp)
	vals, err := chart.Values([]string{"kubernetes.yaml"})
	must(t, err)
	chrt, err := chart.Load()
	must(t, err)
	inst := action.NewInstall(cfg)
	inst.ReleaseName, inst.Namespace = relName, ns
	inst.Wait, inst.WaitForJobs, inst.Timeout = true, true, 5*time.Minute
	if _, err := inst.Run(chrt, vals); err != nil {
		t.Fatalf("helm install: %v", err)
	}
	d, err := cp.Client.AppsV1().Deployments(ns).Get(ctx, relName+"-provisioner-cluster", metav1.GetOptions{})
	must(t, err)
	if d.Status.ReadyReplicas != 2 || d.Spec.Template.Spec.ServiceAccountName != relName+"-provisioner-cluster" {
		t.Errorf("provisioner Deployment: %d ready, account %q", d.Status.ReadyReplicas, d.Spec.Template.Spec.ServiceAccountName)
	}
	user := "system:serviceaccount:" + ns + ":" + relName + "-provisioner-cluster"
	for _, tc := range []struct {
		namespace, verb, resource string
		want                      bool
	}{
		{"egress-proxies", "create", "pods", true},
		{"egress-proxies", "get", "pods", true},
		{"egress-proxies", "delete", "pods", true},
		{"egress-proxies", "list", "pods", true},
		{"egress-proxies", "watch", "pods", false},
		{"egress-proxies", "update", "pods", false},
		{"egress-proxies", "create", "services", false},
		// Each proxy's credentials Secret, read by name only.
		{"egress-proxies", "create", "secrets", true},
		{"egress-proxies", "get", "secrets", true},
		{"egress-proxies", "update", "secrets", true},
		{"egress-proxies", "delete", "secrets", true},
		{"egress-proxies", "list", "secrets", false},
		{"egress-proxies", "watch", "secrets", false},
		{ns, "get", "secrets", false},
		{ns, "create", "pods", false},
		{ns, "list", "pods", false},
		{"", "list", "pods", false},
		{"", "get", "nodes", false},
	} {
		sar, err := cp.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User: user, Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
			ResourceAttributes: &authorizationv1.ResourceAttributes{Namespace: tc.namespace, Verb: tc.verb, Resource: tc.resource},
		}}, metav1.CreateOptions{})
		must(t, err)
		if sar.Status.Allowed != tc.want {
			t.Errorf("%s %s in %q: allowed %v, want %v (%s)", tc.verb, tc.resource, tc.namespace, sar.Status.Allowed, tc.want, sar.Status.Reason)
		}
	}
}
