//go:build cluster

package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/kubetest"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
	"github.com/egress-proxies/egress-proxies/pkg/squid"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/provisioner-kubernetes/internal/kubernetes"
)

// kubeBlock is the kubernetes block of a provider acting through
// kubeconfig in namespace.
func kubeBlock(kubeconfig, namespace string) string {
	return fmt.Sprintf("kubernetes: {kubeconfig: %s, namespace: %s}\n", kubeconfig, namespace)
}

// The contract against a real API server whose node kwok simulates, the
// provisioner holding the chart's Role only. Run with make test-cluster.
func TestConformance(t *testing.T) {
	cp := kubetest.Start(t)
	const ns = "conformance"
	cp.Namespace(t, ns)
	kubeconfig := cp.Account(t, ns, "provisioner", kubetest.ProvisionerRules)
	pods := cp.Client.CoreV1().Pods(ns)
	ctx := context.Background()
	// put creates the pod of uid's name with labels and annotations.
	put := func(t *testing.T, uid string, labels, annotations map[string]string) *corev1.Pod {
		t.Helper()
		pod, err := pods.Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "proxy-" + uid, Labels: labels, Annotations: annotations},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "squid", Image: "ubuntu/squid"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return pod
	}
	// elsewhere is the API server's account of this provider, at address.
	elsewhere := func(t *testing.T, address string) string {
		down := *cp
		down.Host = "https://" + address
		return kubeBlock(down.KubeconfigFor(t, "no-server-here", ns), ns)
	}
	provisionertest.TestAll(t, provisionertest.Tester{
		Binary:  binary,
		Type:    "kubernetes",
		Backend: func(*testing.T) string { return kubeBlock(kubeconfig, ns) },
		// The pod's Secret admits them, and its squid.conf demands them.
		Credentials: func(t *testing.T, uid string, c *proxyv1.ProxyCredentials) error {
			sec, err := cp.Client.CoreV1().Secrets(ns).Get(ctx, "proxy-"+uid, metav1.GetOptions{})
			if err != nil {
				return err
			}
			if !squid.HTPasswdAdmits(sec.Data[kubernetes.SecretKeyHTPasswd], c.GetUsername(), c.GetPassword()) {
				return errors.New("the pod's Secret does not admit them")
			}
			pod, err := pods.Get(ctx, "proxy-"+uid, metav1.GetOptions{})
			if err != nil {
				return err
			}
			if !strings.Contains(pod.Annotations[kubernetes.AnnotationSquidConf], "\nhttp_access allow clients "+squid.AuthACL+"\n") {
				return errors.New("the pod's squid.conf does not demand credentials")
			}
			return nil
		},
		Observe: func(t *testing.T, uid string) provisionertest.Observed {
			var o provisionertest.Observed
			switch _, err := pods.Get(ctx, "proxy-"+uid, metav1.GetOptions{}); {
			case err == nil:
				o.Instances = append(o.Instances, "pod proxy-"+uid)
			case !apierrors.IsNotFound(err):
				t.Fatal(err)
			}
			return o
		},
		// The pod a crashed Create had created.
		HalfMade: func(t *testing.T, uid string) string {
			pod := put(t, uid, map[string]string{kubernetes.LabelManagedBy: kubernetes.ManagedByValue, kubernetes.LabelProvider: provisionertest.ProviderName,
				kubernetes.LabelProxyUID: uid}, map[string]string{kubernetes.AnnotationUID: uid, kubernetes.AnnotationCreated: time.Now().UTC().Format(time.RFC3339)})
			return ns + "/" + pod.Name
		},
		Foreign: func(t *testing.T, uid string) provisionertest.Foreign {
			was := put(t, uid, map[string]string{"app": "web"}, nil)
			return provisionertest.Foreign{ProviderID: ns + "/" + was.Name, Unchanged: func() error {
				now, err := pods.Get(ctx, was.Name, metav1.GetOptions{})
				if err != nil || now.UID != was.UID || now.DeletionTimestamp != nil || !maps.Equal(now.Labels, was.Labels) || !maps.Equal(now.Annotations, was.Annotations) {
					return fmt.Errorf("pod %s was %v, is %v (%v)", was.Name, was.ObjectMeta, now.ObjectMeta, err)
				}
				return nil
			}}
		},
		Unclaim: func(t *testing.T, uid string) {
			patch := `[{"op":"remove","path":"/metadata/labels/` + strings.ReplaceAll(kubernetes.LabelInstallation, "/", "~1") + `"}]`
			if _, err := pods.Patch(ctx, "proxy-"+uid, types.JSONPatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
				t.Fatalf("unclaiming the pod of %s: %v", uid, err)
			}
		},
		CrashSteps: []provisionertest.CrashStep{{Name: "kubernetes.created"}},
		Unreachable: func(t *testing.T) provisionertest.Outage {
			return provisionertest.Outage{Backend: elsewhere(t, provisionertest.ClosedAddress(t))}
		},
		Stalled: func(t *testing.T) string { return elsewhere(t, provisionertest.StalledAddress(t)) },
		// A namespace whose ResourceQuota admits no pod.
		Quota: func(t *testing.T) provisionertest.Quota {
			const full = "conformance-quota"
			cp.Namespace(t, full)
			_, err := cp.Client.CoreV1().ResourceQuotas(full).Create(ctx, &corev1.ResourceQuota{ObjectMeta: metav1.ObjectMeta{Name: "pods"},
				Spec: corev1.ResourceQuotaSpec{Hard: corev1.ResourceList{corev1.ResourcePods: resource.MustParse("0")}}}, metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			// Admission enforces a quota once the controller has computed it.
			waittest.ForErr(t, time.Minute, "the quota's status", func() error {
				q, err := cp.Client.CoreV1().ResourceQuotas(full).Get(ctx, "pods", metav1.GetOptions{})
				if err != nil {
					return err
				}
				if _, ok := q.Status.Hard[corev1.ResourcePods]; !ok {
					return fmt.Errorf("status %v", q.Status)
				}
				return nil
			})
			return provisionertest.Quota{Backend: kubeBlock(cp.Account(t, full, "provisioner", kubetest.ProvisionerRules), full)}
		},
	})
}
