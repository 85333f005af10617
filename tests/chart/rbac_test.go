package chart

import (
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"

	"github.com/egress-proxies/egress-proxies/pkg/kubetest"
)

// kubernetesProvisioner reports whether a RoleBinding of the release binds
// the ServiceAccount sa: only kubernetes provisioners have one.
func kubernetesProvisioner(r *Rendered, sa string) bool {
	for _, rb := range typed[*rbacv1.RoleBinding](r.Objects) {
		for _, s := range rb.Subjects {
			if s.Kind == rbacv1.ServiceAccountKind && s.Name == sa {
				return true
			}
		}
	}
	return false
}

// A kubernetes provisioner runs as its own ServiceAccount, with a token,
// and a Role in the proxies' namespace grants it create, get, delete, list
// and patch on pods and create, get, update and delete on Secrets (its
// proxies' credentials): nothing else, nothing cluster-wide. Every other workload
// keeps the shared account without a token.
func TestKubernetesProvisionerRBAC(t *testing.T) {
	t.Parallel()
	r := render(t, []string{"kubernetes.yaml"})
	const name = "eg-provisioner-cluster"
	sas := typed[*corev1.ServiceAccount](r.Objects)
	if sa, ok := sas[name]; !ok || sa.Namespace != relNS {
		t.Fatalf("ServiceAccounts %v: want %s in %s", sas, name, relNS)
	}
	roles := typed[*rbacv1.Role](r.Objects)
	if len(roles) != 1 {
		t.Fatalf("%d Roles, want 1", len(roles))
	}
	role := roles[name]
	if role == nil || role.Namespace != "egress-proxies" {
		t.Fatalf("Role %+v, want %s in the proxies' namespace egress-proxies", role, name)
	}
	// The rules the backend's tests run with against a real API server.
	want := kubetest.ProvisionerRules
	same := len(role.Rules) == len(want)
	for i := 0; same && i < len(want); i++ {
		same = slices.Equal(role.Rules[i].APIGroups, want[i].APIGroups) && slices.Equal(role.Rules[i].Resources, want[i].Resources) &&
			slices.Equal(role.Rules[i].Verbs, want[i].Verbs)
	}
	if !same {
		t.Errorf("rules %+v, want %+v", role.Rules, want)
	}
	rb := typed[*rbacv1.RoleBinding](r.Objects)[name]
	if rb == nil || rb.Namespace != "egress-proxies" || rb.RoleRef.Kind != "Role" || rb.RoleRef.Name != name ||
		len(rb.Subjects) != 1 || rb.Subjects[0].Name != name || rb.Subjects[0].Namespace != relNS {
		t.Errorf("RoleBinding %+v", rb)
	}
	for _, o := range r.Objects {
		if strings.HasPrefix(o.Kind, "Cluster") {
			t.Errorf("cluster-wide object %s %s", o.Kind, o.Name)
		}
	}
	specs := podSpecs(r)
	prov := specs["Deployment/"+name]
	if prov.ServiceAccountName != name || prov.AutomountServiceAccountToken == nil || !*prov.AutomountServiceAccountToken {
		t.Errorf("the kubernetes provisioner runs as %q with token %v", prov.ServiceAccountName, prov.AutomountServiceAccountToken)
	}
	if img := prov.Containers[0].Image; img != "egress-proxies/provisioner-kubernetes:0.1.0" {
		t.Errorf("image %s", img)
	}
	for n, spec := range specs {
		if n != "Deployment/"+name && (spec.ServiceAccountName == name || spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken) {
			t.Errorf("%s runs as %q with token %v", n, spec.ServiceAccountName, spec.AutomountServiceAccountToken)
		}
	}
}

// A kubernetes provider without its namespace is refused, naming it.
func TestKubernetesProviderNeedsNamespace(t *testing.T) {
	t.Parallel()
	vals, err := Values([]string{"kubernetes.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	vals["providers"].([]any)[0].(map[string]any)["kubernetes"] = map[string]any{"image": "squid"}
	_, err = Render(relName, relNS, vals)
	if err == nil || !strings.Contains(err.Error(), `the kubernetes provider "cluster" needs kubernetes.namespace`) {
		t.Errorf("render = %v", err)
	}
}
