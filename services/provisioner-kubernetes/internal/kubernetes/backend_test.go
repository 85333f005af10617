package kubernetes

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"github.com/egress-proxies/egress-proxies/pkg/squid"
)

var metav1Now = metav1.NewTime(time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC))

const uidA = "6f1d7a52-3c1e-4f7e-8d55-0c8d3a9e2b11"

func newFake(t *testing.T, objs ...runtime.Object) (*Backend, *fake.Clientset) {
	t.Helper()
	cs := fake.NewClientset(objs...)
	b, err := New("k8s", Config{Namespace: "proxies"}, nil, Options{Client: cs, Now: func() time.Time { return metav1Now.Time }})
	if err != nil {
		t.Fatal(err)
	}
	return b, cs
}

func createReq(uid string) *provisionerv1.CreateInstanceRequest {
	return &provisionerv1.CreateInstanceRequest{Provider: "k8s", ProxyUid: uid, ProxyName: "p-1", Port: 3128, SpecHash: "h1",
		Placement: &proxyv1.Placement{Zone: "eu-a"}}
}

func TestCreateGetListDelete(t *testing.T) {
	t.Parallel()
	b, cs := newFake(t)
	ctx := context.Background()
	in, err := b.Create(ctx, createReq(uidA))
	if err != nil {
		t.Fatal(err)
	}
	name := "proxy-" + uidA
	if in.GetProviderId() != "proxies/"+name || in.GetProxyUid() != uidA || in.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING || in.GetIp() != "" {
		t.Errorf("created %v", in)
	}
	if !in.GetCreateTime().AsTime().Equal(metav1Now.Time) {
		t.Errorf("create time %v", in.GetCreateTime().AsTime())
	}
	pod, err := cs.CoreV1().Pods("proxies").Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pod.Spec.NodeSelector[corev1.LabelTopologyZone] != "eu-a" || !strings.Contains(pod.Annotations[AnnotationSquidConf], "max_filedescriptors 4096") {
		t.Errorf("stored pod: selector %v conf %q", pod.Spec.NodeSelector, pod.Annotations[AnnotationSquidConf])
	}

	// The node runs it: Get follows.
	pod.Spec.NodeName = "node-1"
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "192.0.2.10",
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}
	if _, err := cs.CoreV1().Pods("proxies").UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uidA})
	if err != nil {
		t.Fatal(err)
	}
	if got.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_RUNNING || got.GetIp() != "192.0.2.10" || got.GetDetails()["node"] != "node-1" {
		t.Errorf("get %v", got)
	}

	// Another proxy's UID, or another namespace: NotFound.
	if _, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: "other"}); !errclass.Is(err, errclass.NotFound) {
		t.Errorf("get with another UID: %v", err)
	}
	if _, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: "elsewhere/" + name}); !errclass.Is(err, errclass.NotFound) {
		t.Errorf("get in another namespace: %v", err)
	}
	if _, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: "nonsense"}); !errclass.Is(err, errclass.Permanent) {
		t.Errorf("get of a malformed providerID: %v", err)
	}

	list, err := b.List(ctx)
	if err != nil || len(list) != 1 || list[0].GetProxyUid() != uidA {
		t.Fatalf("list %v, %v", list, err)
	}

	deleted, err := b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uidA})
	if err != nil || !deleted {
		t.Fatalf("delete = %v, %v", deleted, err)
	}
	deleted, err = b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uidA})
	if err != nil || deleted {
		t.Fatalf("second delete = %v, %v; want nothing left, no error", deleted, err)
	}
	if _, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uidA}); !errclass.Is(err, errclass.NotFound) {
		t.Errorf("get after delete: %v", err)
	}
}

func TestCreateAdoptsItsOwnPod(t *testing.T) {
	t.Parallel()
	b, cs := newFake(t)
	ctx := context.Background()
	first, err := b.Create(ctx, createReq(uidA))
	if err != nil {
		t.Fatal(err)
	}
	creates := 0
	cs.PrependReactor("create", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		creates++
		return false, nil, nil
	})
	again, err := b.Create(ctx, createReq(uidA))
	if err != nil {
		t.Fatalf("a repeated create must adopt: %v", err)
	}
	if again.GetProviderId() != first.GetProviderId() || creates != 1 {
		t.Errorf("adopted %v after %d create calls", again, creates)
	}
	pods, _ := cs.CoreV1().Pods("proxies").List(ctx, metav1.ListOptions{})
	if len(pods.Items) != 1 {
		t.Errorf("%d pods, want the one", len(pods.Items))
	}
}

func TestCreateRefusesAForeignPod(t *testing.T) {
	t.Parallel()
	name := "proxy-" + uidA
	cases := map[string]*corev1.Pod{
		"unmarked": {ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "proxies", Labels: map[string]string{"app": "web"}}},
		"another provider": {ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "proxies",
			Labels: map[string]string{LabelManagedBy: ManagedByValue, LabelProvider: "other"}, Annotations: map[string]string{AnnotationUID: uidA}}},
		"another proxy": {ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "proxies",
			Labels: map[string]string{LabelManagedBy: ManagedByValue, LabelProvider: "k8s"}, Annotations: map[string]string{AnnotationUID: "someone-else"}}},
	}
	for n, pod := range cases {
		t.Run(n, func(t *testing.T) {
			t.Parallel()
			b, cs := newFake(t, pod)
			_, err := b.Create(context.Background(), createReq(uidA))
			if !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), "already exists and is not this proxy's") {
				t.Fatalf("create over a foreign pod: %v", err)
			}
			// Delete leaves it alone too.
			deleted, err := b.Delete(context.Background(), &provisionerv1.DeleteInstanceRequest{ProviderId: "proxies/" + name, ProxyUid: uidA})
			if err != nil || deleted {
				t.Errorf("delete of a foreign pod = %v, %v", deleted, err)
			}
			if _, err := cs.CoreV1().Pods("proxies").Get(context.Background(), name, metav1.GetOptions{}); err != nil {
				t.Errorf("the foreign pod is gone: %v", err)
			}
			if _, err := b.Get(context.Background(), &provisionerv1.GetInstanceRequest{ProviderId: "proxies/" + name, ProxyUid: uidA}); !errclass.Is(err, errclass.NotFound) {
				t.Errorf("get of a foreign pod: %v", err)
			}
		})
	}
}

func TestCreateWaitsForItsTerminatingPod(t *testing.T) {
	t.Parallel()
	b, cs := newFake(t)
	ctx := context.Background()
	if _, err := b.Create(ctx, createReq(uidA)); err != nil {
		t.Fatal(err)
	}
	pod, _ := cs.CoreV1().Pods("proxies").Get(ctx, "proxy-"+uidA, metav1.GetOptions{})
	pod.DeletionTimestamp = &metav1Now
	if _, err := cs.CoreV1().Pods("proxies").Update(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Create(ctx, createReq(uidA)); !errclass.Is(err, errclass.Transient) || !strings.Contains(err.Error(), "still being deleted") {
		t.Errorf("create while the old pod terminates: %v", err)
	}
	got, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: "proxies/proxy-" + uidA})
	if err != nil || got.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_DELETING {
		t.Errorf("get of a terminating pod: %v, %v", got, err)
	}
}

// Cloud-init has no guest to run in: the first Create that carries one
// logs a WARNING, later ones do not, and nothing of it is logged.
func TestCloudInitIgnoredWithOneWarning(t *testing.T) {
	t.Parallel()
	logs := &logtest.Buffer{}
	b, err := New("k8s", Config{Namespace: "proxies"}, slog.New(slog.NewJSONHandler(logs, nil)), Options{Client: fake.NewClientset()})
	if err != nil {
		t.Fatal(err)
	}
	for _, uid := range []string{"a1", "a2"} {
		req := createReq(uid)
		req.CloudInit = "#cloud-config\npassword: hunter2-secret\n"
		if _, err := b.Create(context.Background(), req); err != nil {
			t.Fatal(err)
		}
	}
	warnings := strings.Count(logs.String(), `"msg":"WARNING: cloud-init is ignored`)
	if warnings != 1 {
		t.Errorf("%d cloud-init warnings, want 1", warnings)
	}
	if strings.Contains(logs.String(), "hunter2") {
		t.Error("cloud-init content reached the log")
	}
}

// List follows the continue token through every page.
func TestListEveryPage(t *testing.T) {
	t.Parallel()
	var objs []runtime.Object
	for i := range 7 {
		objs = append(objs, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("proxy-%d", i), Namespace: "proxies",
			Labels:      map[string]string{LabelManagedBy: ManagedByValue, LabelProvider: "k8s"},
			Annotations: map[string]string{AnnotationUID: fmt.Sprint(i)}}})
	}
	objs = append(objs, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "proxies", Labels: map[string]string{"app": "web"}}})
	cs := fake.NewClientset(objs...)
	b, err := New("k8s", Config{Namespace: "proxies", ListPageSize: 3}, nil, Options{Client: cs})
	if err != nil {
		t.Fatal(err)
	}
	// The fake ignores limit and continue; page it as the API server does.
	var selectors []string
	var calls int
	cs.PrependReactor("list", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		calls++
		la := a.(k8stesting.ListActionImpl)
		selectors = append(selectors, la.GetListRestrictions().Labels.String())
		all, err := cs.Tracker().List(corev1.SchemeGroupVersion.WithResource("pods"), corev1.SchemeGroupVersion.WithKind("Pod"), "proxies")
		if err != nil {
			return true, nil, err
		}
		var matched []corev1.Pod
		for _, p := range all.(*corev1.PodList).Items {
			if la.GetListRestrictions().Labels.Matches(labelsOf(p.Labels)) {
				matched = append(matched, p)
			}
		}
		start := (calls - 1) * 3
		end := min(start+3, len(matched))
		out := &corev1.PodList{Items: matched[start:end]}
		if end < len(matched) {
			out.Continue = fmt.Sprint("page-", calls)
		}
		return true, out, nil
	})
	list, err := b.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 7 || calls != 3 {
		t.Errorf("%d instances in %d calls, want 7 in 3", len(list), calls)
	}
	for _, s := range selectors {
		if s != "app.kubernetes.io/managed-by=egress-proxies,egress-proxies.dev/provider=k8s" {
			t.Errorf("selector %q", s)
		}
	}
}

type labelsOf map[string]string

func (l labelsOf) Has(k string) bool              { _, ok := l[k]; return ok }
func (l labelsOf) Get(k string) string            { return l[k] }
func (l labelsOf) Lookup(k string) (string, bool) { v, ok := l[k]; return v, ok }

func TestClassify(t *testing.T) {
	t.Parallel()
	b, _ := newFake(t)
	pods := schema.GroupResource{Resource: "pods"}
	rbac := apierrors.NewForbidden(pods, "", errors.New(`User "system:serviceaccount:egress:prov" cannot create resource "pods" in API group "" in the namespace "proxies"`))
	quota := apierrors.NewForbidden(pods, "proxy-x", errors.New("exceeded quota: proxies, requested: pods=1, used: pods=2, limited: pods=2"))
	podSecurity := apierrors.NewForbidden(pods, "proxy-x", errors.New(`violates PodSecurity "baseline:latest": host namespaces (hostNetwork=true)`))
	cases := []struct {
		name string
		err  error
		want errclass.Class
		text string
	}{
		{"rbac", rbac, errclass.Permanent, "RBAC: the provisioner's account may not create pods in namespace proxies"},
		{"quota", quota, errclass.QuotaExceeded, "a ResourceQuota is used up"},
		{"admission", podSecurity, errclass.Permanent, "create pods in namespace proxies was refused"},
		{"unauthorized", apierrors.NewUnauthorized("token expired"), errclass.Permanent, "refused the provisioner's credentials"},
		{"invalid", apierrors.NewInvalid(corev1.SchemeGroupVersion.WithKind("Pod").GroupKind(), "proxy-x", nil), errclass.Permanent, "rejected the request"},
		{"not found", apierrors.NewNotFound(pods, "proxy-x"), errclass.NotFound, ""},
		{"throttled", apierrors.NewTooManyRequests("slow down", 1), errclass.Transient, ""},
		{"server timeout", apierrors.NewServerTimeout(pods, "create", 1), errclass.Transient, ""},
		{"timeout", apierrors.NewTimeoutError("etcd", 1), errclass.Transient, ""},
		{"internal", apierrors.NewInternalError(errors.New("etcd down")), errclass.Transient, ""},
		{"unavailable", apierrors.NewServiceUnavailable("starting"), errclass.Transient, ""},
		{"bad gateway", apierrors.NewGenericServerResponse(502, "create", pods, "proxy-x", "", 0, false), errclass.Transient, ""},
		{"conflict", apierrors.NewConflict(pods, "proxy-x", errors.New("changed")), errclass.Transient, ""},
		{"expired continue", apierrors.NewResourceExpired("continue expired"), errclass.Transient, ""},
		{"refused", &url.Error{Op: "Post", URL: "https://10.96.0.1/api/v1/namespaces/proxies/pods", Err: syscall.ECONNREFUSED}, errclass.Transient, "the API server did not answer"},
		{"deadline", context.DeadlineExceeded, errclass.Transient, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got := b.classify(tc.err, "create", "pods")
			if errclass.Of(got) != tc.want || !strings.Contains(got.Error(), tc.text) {
				t.Errorf("classify = %s %q, want %s containing %q", errclass.Of(got), got, tc.want, tc.text)
			}
			var ce *errclass.Error
			if errors.As(got, &ce) && tc.name == "rbac" {
				if ce.Metadata["verb"] != "create" || ce.Metadata["resource"] != "pods" || ce.Metadata["httpStatus"] != "403" {
					t.Errorf("metadata %v", ce.Metadata)
				}
			}
		})
	}
	if !errors.Is(b.classify(context.Canceled, "get", "pods"), context.Canceled) {
		t.Error("a context error must still match")
	}
}

// Errors reach the callers classified: a Create refused by RBAC is
// Permanent and names the verb and resource.
func TestCreateClassifiesAPIErrors(t *testing.T) {
	t.Parallel()
	b, cs := newFake(t)
	cs.PrependReactor("create", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "", errors.New(`User "x" cannot create resource "pods" in API group "" in the namespace "proxies"`))
	})
	_, err := b.Create(context.Background(), createReq(uidA))
	if !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), "may not create pods") {
		t.Errorf("create = %v", err)
	}
	cs.PrependReactor("list", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewTooManyRequests("slow down", 1)
	})
	if _, err := b.List(context.Background()); !errclass.Is(err, errclass.Transient) {
		t.Errorf("list = %v", err)
	}
	if _, err := b.Create(context.Background(), &provisionerv1.CreateInstanceRequest{ProxyUid: uidA, Placement: &proxyv1.Placement{MachineType: "huge"}}); !errclass.Is(err, errclass.Permanent) {
		t.Errorf("create with an unknown machine type = %v", err)
	}
}

func TestCheck(t *testing.T) {
	t.Parallel()
	b, cs := newFake(t)
	var opts []metav1.ListOptions
	cs.PrependReactor("list", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		la := a.(k8stesting.ListActionImpl)
		if la.GetNamespace() != "proxies" {
			t.Errorf("check listed in %q", la.GetNamespace())
		}
		opts = append(opts, metav1.ListOptions{LabelSelector: la.GetListRestrictions().Labels.String()})
		return false, nil, nil
	})
	got := b.Check(context.Background())
	if len(got) != 1 || !got[0].GetReady() || got[0].GetReason() != provisioner.ReasonReachable || got[0].GetName() != "apiserver" {
		t.Fatalf("check %v", got)
	}
	if len(opts) != 1 || opts[0].LabelSelector != b.selector() {
		t.Errorf("list calls %v, want one with the managed selector", opts)
	}
	if got[0].GetDetails()["serverVersion"] == "" {
		t.Errorf("details %v lack the server version", got[0].GetDetails())
	}

	pods := schema.GroupResource{Resource: "pods"}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		err  error
		want string
	}{
		{"forbidden", context.Background(), apierrors.NewForbidden(pods, "", errors.New("rbac denied")), provisioner.ReasonForbidden},
		{"unauthorized", context.Background(), apierrors.NewUnauthorized("token expired"), provisioner.ReasonUnauthorized},
		{"api timeout", context.Background(), apierrors.NewTimeoutError("slow etcd", 1), provisioner.ReasonTimeout},
		{"server timeout", context.Background(), apierrors.NewServerTimeout(pods, "list", 1), provisioner.ReasonTimeout},
		{"context ended", ended, context.Canceled, provisioner.ReasonTimeout},
		{"internal error", context.Background(), apierrors.NewInternalError(errors.New("etcd down")), provisioner.ReasonAPIError},
		{"connection refused", context.Background(), &url.Error{Op: "Get", URL: "https://10.96.0.1:443/api/v1/pods", Err: syscall.ECONNREFUSED}, provisioner.ReasonUnreachable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, cs := newFake(t)
			cs.PrependReactor("list", "pods", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, tc.err })
			got := b.Check(tc.ctx)
			if len(got) != 1 || got[0].GetReady() || got[0].GetReason() != tc.want || got[0].GetMessage() == "" {
				t.Errorf("check = %v, want not ready, %s", got, tc.want)
			}
		})
	}
}

// Without a readable kubeconfig every call fails Transient and the check
// says ConfigUnavailable; nothing panics.
func TestMissingKubeconfig(t *testing.T) {
	t.Parallel()
	logs := &logtest.Buffer{}
	b, err := New("k8s", Config{Namespace: "proxies", Kubeconfig: t.TempDir() + "/missing"}, slog.New(slog.NewJSONHandler(logs, nil)), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "WARNING: kubeconfig is not readable") {
		t.Errorf("no WARNING at start: %s", logs.String())
	}
	if _, err := b.List(context.Background()); !errclass.Is(err, errclass.Transient) {
		t.Errorf("list = %v", err)
	}
	got := b.Check(context.Background())
	if got[0].GetReason() != provisioner.ReasonConfigUnavailable {
		t.Errorf("check = %v", got)
	}
}

// A proxy with credentials gets a Secret of its pod's name holding only
// the htpasswd line; Delete removes it; nothing logs the password.
func TestCreateWithCredentials(t *testing.T) {
	t.Parallel()
	logs := &logtest.Buffer{}
	cs := fake.NewClientset()
	b, err := New("k8s", Config{Namespace: "proxies"}, slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})), Options{Client: cs})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	req := createReq(uidA)
	req.Credentials = &proxyv1.ProxyCredentials{Username: "egress-00aa11bb22cc", Password: "hunter2-Pass-word_xyz"}
	in, err := b.Create(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	sec, err := cs.CoreV1().Secrets("proxies").Get(ctx, "proxy-"+uidA, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if sec.Labels[LabelProxyUID] != uidA || sec.OwnerReferences[0].Name != "proxy-"+uidA || len(sec.Data) != 1 ||
		!squidAdmits(sec.Data[SecretKeyHTPasswd], req.Credentials) {
		t.Errorf("secret %+v", sec.ObjectMeta)
	}
	if deleted, err := b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uidA}); err != nil || !deleted {
		t.Fatalf("delete = %v, %v", deleted, err)
	}
	if _, err := cs.CoreV1().Secrets("proxies").Get(ctx, "proxy-"+uidA, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("secret after Delete: %v", err)
	}
	if strings.Contains(logs.String(), "hunter2") || strings.Contains(logs.String(), "$2a$") || !strings.Contains(logs.String(), "kubernetes secret deleted") {
		t.Errorf("log:\n%s", logs.String())
	}
	// A password bcrypt cannot take is Permanent and not shown.
	req.Credentials.Password = strings.Repeat("x", 80)
	req.ProxyUid = "other"
	if _, err := b.Create(ctx, req); !errclass.Is(err, errclass.Permanent) || strings.Contains(err.Error(), req.Credentials.Password) {
		t.Errorf("an 80-byte password: %v", err)
	}
}

func squidAdmits(file []byte, c *proxyv1.ProxyCredentials) bool {
	return squid.HTPasswdAdmits(file, c.GetUsername(), c.GetPassword())
}
