package chart

import (
	"encoding/base64"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// Proxy credentials need the keyring (the orchestrator seals them with
// it) and the provisioners need the orchestrator (Create fetches them):
// without a keysSecret the chart generates the keyring, kept on
// uninstall, and every provisioner is given the orchestrator's address
// and the service token.
func TestCredentialsWiring(t *testing.T) {
	t.Parallel()
	r := render(t, []string{"all-kinds.yaml"})
	sec := typed[*corev1.Secret](r.Objects)[relName+"-cloud-init-keys"]
	if sec == nil {
		t.Fatal("no generated keyring Secret")
	}
	if sec.Annotations["helm.sh/resource-policy"] != "keep" {
		t.Errorf("the keyring Secret's annotations %v: want resource-policy keep (stored data is unreadable without it)", sec.Annotations)
	}
	var ring struct {
		Active string
		Keys   map[string]string
	}
	if err := yaml.Unmarshal(sec.Data["keys.yaml"], &ring); err != nil {
		t.Fatal(err)
	}
	key, err := base64.StdEncoding.DecodeString(ring.Keys[ring.Active])
	if err != nil || len(key) != 32 {
		t.Errorf("keyring: active %q, its key %d bytes (%v); want 32 random bytes", ring.Active, len(key), err)
	}
	if again := typed[*corev1.Secret](render(t, []string{"all-kinds.yaml"}).Objects)[relName+"-cloud-init-keys"]; string(again.Data["keys.yaml"]) == string(sec.Data["keys.yaml"]) {
		t.Error("two installs got the same key")
	}
	deps := typed[*appsv1.Deployment](r.Objects)
	orch := deps[relName+"-orchestrator"].Spec.Template.Spec.Containers[0]
	if v, _ := envValue(orch, "EGRESS_CLOUD_INIT_KEY_FILE"); v != "/etc/egress/cloud-init/keys.yaml" {
		t.Errorf("orchestrator EGRESS_CLOUD_INIT_KEY_FILE = %q", v)
	}
	provisioners := 0
	for name, d := range deps {
		if !strings.HasPrefix(name, relName+"-provisioner-") {
			continue
		}
		provisioners++
		c := d.Spec.Template.Spec.Containers[0]
		if v, _ := envValue(c, "EGRESS_ORCHESTRATOR_ADDR"); v != relName+"-orchestrator:8100" {
			t.Errorf("%s EGRESS_ORCHESTRATOR_ADDR = %q, want the orchestrator's gRPC Service", name, v)
		}
		if v, _ := envValue(c, "EGRESS_ORCHESTRATOR_TOKEN_FILE"); v != "/etc/egress/credentials/service-token" {
			t.Errorf("%s EGRESS_ORCHESTRATOR_TOKEN_FILE = %q, want the service token", name, v)
		}
	}
	if provisioners == 0 {
		t.Fatal("no provisioner Deployment rendered")
	}

	// A keyring of the operator's own: nothing generated, theirs mounted.
	r = render(t, []string{"all-kinds.yaml"}, map[string]any{"cloudInit": map[string]any{"keysSecret": "my-keys"}})
	if _, ok := typed[*corev1.Secret](r.Objects)[relName+"-cloud-init-keys"]; ok {
		t.Error("the chart generated a keyring although one is given")
	}
	mounted := false
	for _, v := range typed[*appsv1.Deployment](r.Objects)[relName+"-orchestrator"].Spec.Template.Spec.Volumes {
		mounted = mounted || (v.Secret != nil && v.Secret.SecretName == "my-keys")
	}
	if !mounted {
		t.Error("the given keyring is not mounted into the orchestrator")
	}
}
