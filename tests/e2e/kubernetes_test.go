//go:build e2e && cluster

package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/kubetest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/squid"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// The orchestrator and provisioner-kubernetes agree on the contract, as
// processes, against a real API server whose node kwok simulates: the
// provisioner acts as a ServiceAccount holding only the chart's Role; a
// proxy becomes Running at its pod's address (the node's, the pod being
// on the host network), orphan GC deletes a marked pod no proxy owns and
// spares a foreign one, and deleting the proxy deletes its pod. Run with
// `make test-cluster`.
func TestKubernetesBackend(t *testing.T) {
	s := newSuite(t)
	cp := kubetest.Start(t)
	const ns = "proxies"
	cp.Namespace(t, ns)
	bg := context.Background()
	token := cp.ServiceAccountToken(t, ns, "provisioner")
	if _, err := cp.Client.RbacV1().Roles(ns).Create(bg, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "provisioner"},
		Rules: kubetest.ProvisionerRules}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cp.Client.RbacV1().RoleBindings(ns).Create(bg, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "provisioner"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "provisioner"},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: "provisioner", Namespace: ns}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubeconfig := cp.KubeconfigFor(t, token, ns)
	s.providers = s.write("providers.yaml", `providers:
  - name: kube
    type: kubernetes
    kubernetes:
      kubeconfig: `+kubeconfig+`
      namespace: `+ns+`
      labels: {team: crawl}
`)
	// The provisioner fetches each proxy's credentials from the
	// orchestrator with the service token, as the chart runs it.
	s.startOrchestrator()
	prov, _ := servicetest.Start(t, "../../services/provisioner-kubernetes", append(append([]string{"--nats-url=" + s.nats.URL(),
		"--providers-config=" + s.providers, "--provider=kube", "--replica-id=kube-1", "--log-level=debug",
		"--orchestrator-addr=" + s.orchestrator.GRPC}, s.peer("orchestrator")...), s.serving()...))

	// A pod of this installation that no proxy owns (an orphan, old
	// enough), and a pod that is not ours.
	const orphanUID = "0d9c2a34-5b1e-4c39-9a55-6b7e2f1c8d40"
	orphan := "proxy-" + orphanUID
	old := time.Now().Add(-time.Hour).UTC().Format(time.RFC3339)
	for _, pod := range []*corev1.Pod{
		{ObjectMeta: metav1.ObjectMeta{Name: orphan, Labels: map[string]string{"app.kubernetes.io/managed-by": "egress-proxies", "egress-proxies.dev/provider": "kube",
			"egress-proxies.dev/installation": s.installation},
			Annotations: map[string]string{"egress-proxies.dev/proxy-uid": orphanUID, "egress-proxies.dev/created-at": old}},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "squid", Image: "squid"}}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "web", Labels: map[string]string{"app": "web"}},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "web", Image: "nginx"}}}},
	} {
		if _, err := cp.Client.CoreV1().Pods(ns).Create(bg, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	c := s.proxies()
	_, err := c.CreateProxy(ctx(t, 30*time.Second), &proxyv1.CreateProxyRequest{Name: "kube-00", Spec: &proxyv1.ProxySpec{
		Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "kube", Port: 3130,
	}})
	if err != nil {
		t.Fatal(err)
	}
	p := s.waitAll("kube", 1, "Running", 2*time.Minute, running)[0]
	wantPID := ns + "/proxy-" + p.GetUid()
	if p.GetStatus().GetProviderId() != wantPID || p.GetStatus().GetIp() != cp.NodeIP || p.GetStatus().GetPort() != 3130 {
		t.Errorf("status %v, want providerID %s at %s:3130", p.GetStatus(), wantPID, cp.NodeIP)
	}
	pod, err := cp.Client.CoreV1().Pods(ns).Get(bg, "proxy-"+p.GetUid(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pod.Labels["team"] != "crawl" || pod.Annotations["egress-proxies.dev/proxy-name"] != "kube-00" ||
		!strings.Contains(pod.Annotations["egress-proxies.dev/squid.conf"], "\nhttp_port 3130\nmax_filedescriptors ") ||
		pod.Spec.NodeName != cp.NodeName {
		t.Errorf("the proxy's pod: labels %v annotations %v on %q", pod.Labels, pod.Annotations, pod.Spec.NodeName)
	}

	// The proxy's credentials, as the orchestrator holds them, are what
	// the pod's Secret admits, and its squid.conf demands them.
	creds, err := proxyv1.NewProxyServiceClient(s.conn(s.orchestrator.GRPC, serviceToken)).GetProxyCredentials(ctx(t, 10*time.Second),
		&proxyv1.GetProxyCredentialsRequest{Uid: p.GetUid()})
	if err != nil || creds.GetCredentials() == nil {
		t.Fatalf("GetProxyCredentials: %v, %v", creds, err)
	}
	c0 := creds.GetCredentials()
	sec, err := cp.Client.CoreV1().Secrets(ns).Get(bg, "proxy-"+p.GetUid(), metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the proxy's Secret: %v", err)
	}
	if !squid.HTPasswdAdmits(sec.Data["htpasswd"], c0.GetUsername(), c0.GetPassword()) || len(sec.OwnerReferences) != 1 || sec.OwnerReferences[0].UID != pod.UID {
		t.Errorf("the proxy's Secret does not admit its credentials, or is not owned by its pod (%v)", sec.OwnerReferences)
	}
	if !strings.Contains(pod.Annotations["egress-proxies.dev/squid.conf"], "\nhttp_access allow clients authenticated\n") {
		t.Errorf("the pod's squid.conf does not demand credentials:\n%s", pod.Annotations["egress-proxies.dev/squid.conf"])
	}

	waittest.For(t, time.Minute, "the orphan pod deleted by GC", func() bool {
		_, err := cp.Client.CoreV1().Pods(ns).Get(bg, orphan, metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	if _, err := cp.Client.CoreV1().Pods(ns).Get(bg, "web", metav1.GetOptions{}); err != nil {
		t.Errorf("GC touched a foreign pod: %v", err)
	}
	if _, err := cp.Client.CoreV1().Pods(ns).Get(bg, "proxy-"+p.GetUid(), metav1.GetOptions{}); err != nil {
		t.Errorf("GC touched the live proxy's pod: %v", err)
	}

	if _, err := c.DeleteProxy(ctx(t, 10*time.Second), &proxyv1.DeleteProxyRequest{Name: "kube-00"}); err != nil {
		t.Fatal(err)
	}
	waittest.For(t, time.Minute, "kube-00 gone", func() bool {
		_, err := c.GetProxy(ctx(t, 10*time.Second), &proxyv1.GetProxyRequest{Name: "kube-00"})
		return status.Code(err) == codes.NotFound
	})
	if _, err := cp.Client.CoreV1().Pods(ns).Get(bg, "proxy-"+p.GetUid(), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the proxy's pod after delete: %v", err)
	}
	if _, err := cp.Client.CoreV1().Secrets(ns).Get(bg, "proxy-"+p.GetUid(), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the proxy's Secret after delete: %v", err)
	}
	if strings.Contains(prov.Output(), c0.GetPassword()) {
		t.Error("the provisioner's debug log holds the proxy's password")
	}
}
