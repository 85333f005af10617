//go:build cluster

package kubernetes

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/kubetest"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"github.com/egress-proxies/egress-proxies/pkg/squid"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

func backendFor(t *testing.T, kubeconfig string, cfg Config) *Backend {
	t.Helper()
	cfg.Kubeconfig = kubeconfig
	b, err := New("k8s", cfg, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func waitState(t *testing.T, b *Backend, pid, uid string, want provisionerv1.InstanceState) *provisionerv1.Instance {
	t.Helper()
	var got *provisionerv1.Instance
	waittest.ForErr(t, 60*time.Second, pid+" "+want.String(), func() error {
		in, err := b.Get(context.Background(), &provisionerv1.GetInstanceRequest{ProviderId: pid, ProxyUid: uid})
		if err != nil {
			return err
		}
		got = in
		if in.GetState() != want {
			return fmt.Errorf("state %s (%v)", in.GetState(), in.GetDetails())
		}
		return nil
	})
	return got
}

// TestAgainstAPIServer runs the backend against a real API server whose
// node is simulated by kwok: the server validates the pods it builds,
// enforces RBAC and ResourceQuota, the scheduler binds them and kwok runs
// them.
func TestAgainstAPIServer(t *testing.T) {
	cp := kubetest.Start(t)
	ctx := context.Background()

	t.Run("create get list delete", func(t *testing.T) {
		cp.Namespace(t, "lifecycle")
		b := backendFor(t, cp.Account(t, "lifecycle", "provisioner", kubetest.ProvisionerRules), Config{Namespace: "lifecycle", ListPageSize: 2})
		var pids []string
		for i := range 3 {
			in, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: fmt.Sprintf("uid-%d", i), ProxyName: fmt.Sprintf("p-%d", i), Port: uint32(3128 + i), SpecHash: "h"})
			if err != nil {
				t.Fatalf("create %d: %v", i, err)
			}
			if in.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING {
				t.Errorf("a new pod is %s", in.GetState())
			}
			pids = append(pids, in.GetProviderId())
		}
		for i, pid := range pids {
			in := waitState(t, b, pid, fmt.Sprintf("uid-%d", i), provisionerv1.InstanceState_INSTANCE_STATE_RUNNING)
			if in.GetIp() != cp.NodeIP || in.GetDetails()["node"] != cp.NodeName {
				t.Errorf("%s runs at %q on %q, want the node's address %s on %s", pid, in.GetIp(), in.GetDetails()["node"], cp.NodeIP, cp.NodeName)
			}
		}
		// What the API server stored: the squid.conf with its descriptor cap.
		pod, err := cp.Client.CoreV1().Pods("lifecycle").Get(ctx, "proxy-uid-1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(pod.Annotations[AnnotationSquidConf], "\nhttp_port 3129\nmax_filedescriptors 4096\n") || !pod.Spec.HostNetwork {
			t.Errorf("stored pod: hostNetwork %v, conf %q", pod.Spec.HostNetwork, pod.Annotations[AnnotationSquidConf])
		}
		// A pod that is not ours in the same namespace is not listed.
		foreign := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web", Labels: map[string]string{"app": "web"}},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "web", Image: "nginx"}}}}
		if _, err := cp.Client.CoreV1().Pods("lifecycle").Create(ctx, foreign, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		list, err := b.List(ctx) // page size 2: two pages
		if err != nil {
			t.Fatal(err)
		}
		if len(list) != 3 {
			t.Errorf("listed %d instances, want 3: %v", len(list), list)
		}
		for _, pid := range pids {
			deleted, err := b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: pid})
			if err != nil || !deleted {
				t.Fatalf("delete %s = %v, %v", pid, deleted, err)
			}
		}
		for _, pid := range pids {
			waittest.ForErr(t, 60*time.Second, pid+" gone", func() error {
				_, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: pid})
				if errclass.Is(err, errclass.NotFound) {
					return nil
				}
				return fmt.Errorf("get: %v", err)
			})
			deleted, err := b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: pid})
			if err != nil || deleted {
				t.Errorf("delete of a gone pod = %v, %v", deleted, err)
			}
		}
		if _, err := cp.Client.CoreV1().Pods("lifecycle").Get(ctx, "web", metav1.GetOptions{}); err != nil {
			t.Errorf("the foreign pod: %v", err)
		}
	})

	t.Run("credentials", func(t *testing.T) {
		const ns = "creds"
		cp.Namespace(t, ns)
		logs := &logtest.Buffer{}
		cfg := Config{Namespace: ns, Kubeconfig: cp.Account(t, ns, "provisioner", kubetest.ProvisionerRules)}
		b, err := New("k8s", cfg, slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})), Options{})
		if err != nil {
			t.Fatal(err)
		}
		creds := &proxyv1.ProxyCredentials{Username: "egress-0a1b2c3d4e5f", Password: "pw-" + strings.Repeat("Zq9", 10)}
		req := &provisionerv1.CreateInstanceRequest{ProxyUid: "uid-c", ProxyName: "p-c", Port: 3128, Installation: "inst-a", Credentials: creds}
		in, err := b.Create(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		pods, secrets := cp.Client.CoreV1().Pods(ns), cp.Client.CoreV1().Secrets(ns)
		pod, err := pods.Get(ctx, "proxy-uid-c", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// squid demands the credentials of the mounted htpasswd file.
		conf := pod.Annotations[AnnotationSquidConf]
		for _, line := range []string{
			"auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/egress-proxy-auth/htpasswd",
			"acl authenticated proxy_auth REQUIRED",
			"http_access allow clients authenticated",
		} {
			if !strings.Contains(conf, "\n"+line+"\n") {
				t.Errorf("stored squid.conf lacks %q:\n%s", line, conf)
			}
		}
		if strings.Contains(conf, "http_access allow clients\n") {
			t.Errorf("stored squid.conf lets clients in without credentials:\n%s", conf)
		}
		var vol *corev1.Volume
		for i := range pod.Spec.Volumes {
			if pod.Spec.Volumes[i].Name == "proxy-auth" {
				vol = &pod.Spec.Volumes[i]
			}
		}
		if vol == nil || vol.Secret == nil || vol.Secret.SecretName != "proxy-uid-c" || len(vol.Secret.Items) != 1 || vol.Secret.Items[0].Key != "htpasswd" {
			t.Fatalf("stored pod's volumes %+v: want the Secret proxy-uid-c's htpasswd", pod.Spec.Volumes)
		}
		mounted := false
		for _, m := range pod.Spec.Containers[0].VolumeMounts {
			mounted = mounted || (m.Name == "proxy-auth" && m.MountPath == "/etc/egress-proxy-auth" && m.ReadOnly)
		}
		if !mounted {
			t.Errorf("squid's mounts %+v: want proxy-auth read-only at /etc/egress-proxy-auth", pod.Spec.Containers[0].VolumeMounts)
		}
		// The Secret: named after the pod, marked like it, owned by it,
		// holding the htpasswd line only.
		sec, err := secrets.Get(ctx, "proxy-uid-c", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !maps.Equal(sec.Labels, pod.Labels) || sec.Labels[LabelInstallation] != "inst-a" || sec.Annotations[AnnotationUID] != "uid-c" {
			t.Errorf("secret labels %v annotations %v, want the pod's labels %v", sec.Labels, sec.Annotations, pod.Labels)
		}
		if len(sec.OwnerReferences) != 1 || sec.OwnerReferences[0].Kind != "Pod" || sec.OwnerReferences[0].UID != pod.UID {
			t.Errorf("secret owners %+v, want the pod %s", sec.OwnerReferences, pod.UID)
		}
		if len(sec.Data) != 1 || !squid.HTPasswdAdmits(sec.Data["htpasswd"], creds.Username, creds.Password) ||
			squid.HTPasswdAdmits(sec.Data["htpasswd"], creds.Username, creds.Password+"x") || strings.Contains(string(sec.Data["htpasswd"]), creds.Password) {
			t.Errorf("secret data: want one htpasswd line admitting the proxy's credentials, never the password itself")
		}
		waittest.ForErr(t, 60*time.Second, "proxy-uid-c RUNNING", func() error {
			got, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: "uid-c", Installation: "inst-a"})
			if err != nil {
				return err
			}
			if got.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_RUNNING {
				return fmt.Errorf("state %s (%v)", got.GetState(), got.GetDetails())
			}
			return nil
		})

		// A repeated Create adopts the pod and keeps its Secret as it is;
		// one with other credentials (never the orchestrator's way, which
		// replaces the pod) makes the Secret admit those.
		if _, err := b.Create(ctx, req); err != nil {
			t.Fatal(err)
		}
		again, err := secrets.Get(ctx, "proxy-uid-c", metav1.GetOptions{})
		if err != nil || again.UID != sec.UID || again.ResourceVersion != sec.ResourceVersion {
			t.Errorf("a repeated Create changed the secret: %v", err)
		}
		other := &proxyv1.ProxyCredentials{Username: creds.Username, Password: "pw-other-" + strings.Repeat("Kx", 8)}
		req2 := proto.Clone(req).(*provisionerv1.CreateInstanceRequest)
		req2.Credentials = other
		if _, err := b.Create(ctx, req2); err != nil {
			t.Fatal(err)
		}
		if again, err = secrets.Get(ctx, "proxy-uid-c", metav1.GetOptions{}); err != nil || !squid.HTPasswdAdmits(again.Data["htpasswd"], other.Username, other.Password) {
			t.Errorf("the secret does not admit the new credentials: %v", err)
		}

		// Delete removes the Secret with the pod.
		if deleted, err := b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: "uid-c", Installation: "inst-a"}); err != nil || !deleted {
			t.Fatalf("delete = %v, %v", deleted, err)
		}
		if _, err := secrets.Get(ctx, "proxy-uid-c", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("the secret after Delete: %v", err)
		}

		// A pod deleted behind the provisioner's back (by hand, or by
		// orphan GC on another replica) takes its Secret with it: the
		// cluster's garbage collector follows the owner reference.
		if _, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "uid-g", Port: 3129, Installation: "inst-a", Credentials: creds}); err != nil {
			t.Fatal(err)
		}
		if err := pods.Delete(ctx, "proxy-uid-g", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		waittest.ForErr(t, 90*time.Second, "the garbage collector deleting the secret of a deleted pod", func() error {
			if _, err := secrets.Get(ctx, "proxy-uid-g", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				return fmt.Errorf("secret still there (%v)", err)
			}
			return nil
		})

		// A Secret a former pod of the proxy owned is replaced, not reused.
		stale, err := secrets.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "proxy-uid-s",
			Labels:          map[string]string{LabelManagedBy: ManagedByValue, LabelProvider: "k8s", LabelInstallation: "inst-a"},
			Annotations:     map[string]string{AnnotationUID: "uid-s"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Pod", Name: "proxy-uid-s", UID: "0f0f0f0f-0000-4000-8000-000000000000"}}},
			Data: map[string][]byte{"htpasswd": []byte("old:x\n")}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "uid-s", Port: 3130, Installation: "inst-a", Credentials: creds}); err != nil {
			t.Fatal(err)
		}
		spod, err := pods.Get(ctx, "proxy-uid-s", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		now, err := secrets.Get(ctx, "proxy-uid-s", metav1.GetOptions{})
		if err != nil || now.UID == stale.UID || len(now.OwnerReferences) != 1 || now.OwnerReferences[0].UID != spod.UID ||
			!squid.HTPasswdAdmits(now.Data["htpasswd"], creds.Username, creds.Password) {
			t.Errorf("a former pod's secret was not replaced by the new pod's: %v", err)
		}

		// A Secret of the name that is not the proxy's is refused and left
		// alone.
		foreign, err := secrets.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "proxy-uid-f", Labels: map[string]string{"app": "web"}},
			Data: map[string][]byte{"password": []byte("theirs")}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		_, err = b.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "uid-f", Port: 3131, Installation: "inst-a", Credentials: creds})
		if !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), "secret creds/proxy-uid-f already exists and is not this proxy's") {
			t.Errorf("create over a foreign secret: %v", err)
		}
		if now, err := secrets.Get(ctx, "proxy-uid-f", metav1.GetOptions{}); err != nil || now.ResourceVersion != foreign.ResourceVersion {
			t.Errorf("the foreign secret was touched: %v", err)
		}
		if _, err := b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: ns + "/proxy-uid-f", ProxyUid: "uid-f", Installation: "inst-a"}); err != nil {
			t.Fatal(err)
		}
		if _, err := secrets.Get(ctx, "proxy-uid-f", metav1.GetOptions{}); err != nil {
			t.Errorf("Delete removed a foreign secret: %v", err)
		}

		// Without the secrets verbs, Create names what is missing.
		podsOnly := backendFor(t, cp.Account(t, ns, "pods-only", kubetest.ProvisionerRules[:1]), Config{Namespace: ns})
		_, err = podsOnly.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "uid-r", Port: 3132, Credentials: creds})
		if !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), "may not create secrets in namespace creds") {
			t.Errorf("create without the secrets verbs: %v", err)
		}
		if err != nil && (strings.Contains(err.Error(), creds.Password) || strings.Contains(err.Error(), string(sec.Data["htpasswd"]))) {
			t.Error("an error shows the credentials")
		}
		// No log line carries the password or its hash.
		if strings.Contains(logs.String(), creds.Password) || strings.Contains(logs.String(), other.Password) || strings.Contains(logs.String(), "$2a$") {
			t.Errorf("the credentials reached the log:\n%s", logs.String())
		}
		if !strings.Contains(logs.String(), "kubernetes secret created") || !strings.Contains(logs.String(), "kubernetes secret deleted") {
			t.Errorf("the debug log does not show the secret's life (the check above would prove nothing):\n%s", logs.String())
		}
	})

	t.Run("adoption", func(t *testing.T) {
		cp.Namespace(t, "adopt")
		kc := cp.Account(t, "adopt", "provisioner", kubetest.ProvisionerRules)
		first := backendFor(t, kc, Config{Namespace: "adopt"})
		req := &provisionerv1.CreateInstanceRequest{ProxyUid: "uid-adopt", ProxyName: "p", Port: 3128}
		a, err := first.Create(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		// Another replica, after a crash: the same pod.
		second := backendFor(t, kc, Config{Namespace: "adopt"})
		b, err := second.Create(ctx, req)
		if err != nil {
			t.Fatalf("a repeated create must adopt the pod: %v", err)
		}
		if a.GetProviderId() != b.GetProviderId() {
			t.Errorf("adopted %s, created %s", b.GetProviderId(), a.GetProviderId())
		}
		pods, err := cp.Client.CoreV1().Pods("adopt").List(ctx, metav1.ListOptions{})
		if err != nil || len(pods.Items) != 1 {
			t.Errorf("%d pods (%v), want one", len(pods.Items), err)
		}
	})

	t.Run("foreign pod", func(t *testing.T) {
		cp.Namespace(t, "foreign")
		b := backendFor(t, cp.Account(t, "foreign", "provisioner", kubetest.ProvisionerRules), Config{Namespace: "foreign"})
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "proxy-uid-f", Labels: map[string]string{"app": "web"}},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "web", Image: "nginx"}}}}
		if _, err := cp.Client.CoreV1().Pods("foreign").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		_, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "uid-f", Port: 3128})
		if !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), "already exists and is not this proxy's") {
			t.Errorf("create over a foreign pod: %v", err)
		}
		if _, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: "foreign/proxy-uid-f"}); !errclass.Is(err, errclass.NotFound) {
			t.Errorf("get of a foreign pod: %v", err)
		}
		if deleted, err := b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: "foreign/proxy-uid-f", ProxyUid: "uid-f"}); err != nil || deleted {
			t.Errorf("delete of a foreign pod = %v, %v", deleted, err)
		}
		if _, err := cp.Client.CoreV1().Pods("foreign").Get(ctx, "proxy-uid-f", metav1.GetOptions{}); err != nil {
			t.Errorf("the foreign pod: %v", err)
		}
	})

	t.Run("RBAC denied", func(t *testing.T) {
		cp.Namespace(t, "rbac")
		none := backendFor(t, cp.Account(t, "rbac", "nobody", nil), Config{Namespace: "rbac"})
		_, err := none.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "uid-r", Port: 3128})
		if !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), "may not create pods in namespace rbac") {
			t.Errorf("create without the verb: %v", err)
		}
		if _, err := none.List(ctx); !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), "may not list pods") {
			t.Errorf("list without the verb: %v", err)
		}
		if ts := none.Check(ctx)[0]; ts.GetReady() || ts.GetReason() != provisioner.ReasonForbidden {
			t.Errorf("check without the verbs: %v", ts)
		}
		// Allowed to read but not to create: the check passes, Create names
		// what is missing.
		reader := backendFor(t, cp.Account(t, "rbac", "reader", []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list"}}}),
			Config{Namespace: "rbac"})
		if ts := reader.Check(ctx)[0]; !ts.GetReady() {
			t.Errorf("check with list: %v", ts)
		}
		_, err = reader.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "uid-r", Port: 3128})
		var ce *errclass.Error
		if !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), "may not create pods") {
			t.Errorf("create with get/list only: %v", err)
		} else if !errors.As(err, &ce) || ce.Metadata["verb"] != "create" || ce.Metadata["resource"] != "pods" {
			t.Errorf("metadata %v", ce.Metadata)
		}
	})

	t.Run("quota exceeded", func(t *testing.T) {
		cp.Namespace(t, "quota")
		_, err := cp.Client.CoreV1().ResourceQuotas("quota").Create(ctx, &corev1.ResourceQuota{ObjectMeta: metav1.ObjectMeta{Name: "pods"},
			Spec: corev1.ResourceQuotaSpec{Hard: corev1.ResourceList{corev1.ResourcePods: resource.MustParse("1")}}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// Admission enforces a quota once the controller has computed it.
		waittest.ForErr(t, 60*time.Second, "quota status", func() error {
			q, err := cp.Client.CoreV1().ResourceQuotas("quota").Get(ctx, "pods", metav1.GetOptions{})
			if err != nil {
				return err
			}
			if _, ok := q.Status.Hard[corev1.ResourcePods]; !ok {
				return fmt.Errorf("status %v", q.Status)
			}
			return nil
		})
		b := backendFor(t, cp.Account(t, "quota", "provisioner", kubetest.ProvisionerRules), Config{Namespace: "quota"})
		if _, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "uid-q1", Port: 3128}); err != nil {
			t.Fatal(err)
		}
		_, err = b.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "uid-q2", Port: 3128})
		if !errclass.Is(err, errclass.QuotaExceeded) || !strings.Contains(err.Error(), "exceeded quota") {
			t.Errorf("create past the quota: %s %v", errclass.Of(err), err)
		}
	})

	t.Run("unschedulable placement", func(t *testing.T) {
		cp.Namespace(t, "placement")
		b := backendFor(t, cp.Account(t, "placement", "provisioner", kubetest.ProvisionerRules), Config{Namespace: "placement"})
		in, err := b.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "uid-z", Port: 3128, Placement: &proxyv1.Placement{Region: "mars", Zone: "mars-a"}})
		if err != nil {
			t.Fatal(err)
		}
		waittest.ForErr(t, 60*time.Second, "Unschedulable", func() error {
			got, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId()})
			if err != nil {
				return err
			}
			if got.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING || got.GetDetails()["reason"] != "Unschedulable" {
				return fmt.Errorf("%s %v", got.GetState(), got.GetDetails())
			}
			return nil
		})
	})

	t.Run("check", func(t *testing.T) {
		admin := backendFor(t, cp.Kubeconfig, Config{Namespace: "default"})
		ts := admin.Check(ctx)
		if len(ts) != 1 || !ts[0].GetReady() || ts[0].GetName() != "apiserver" || ts[0].GetAddress() != cp.Host ||
			!strings.HasPrefix(ts[0].GetDetails()["serverVersion"], "v1.") {
			t.Errorf("check %v", ts)
		}
		bad := backendFor(t, cp.KubeconfigFor(t, "not-a-token", "default"), Config{Namespace: "default"})
		if ts := bad.Check(ctx)[0]; ts.GetReady() || ts.GetReason() != provisioner.ReasonUnauthorized {
			t.Errorf("check with a refused token: %v", ts)
		}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		closed := l.Addr().String()
		l.Close()
		down := *cp
		down.Host = "https://" + closed
		gone := backendFor(t, down.KubeconfigFor(t, "x", "default"), Config{Namespace: "default"})
		if ts := gone.Check(ctx)[0]; ts.GetReady() || ts.GetReason() != provisioner.ReasonUnreachable {
			t.Errorf("check of a closed port: %v", ts)
		}
	})

}
