package kubernetes

import (
	"context"
	"encoding/json"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/crashpoint"
	"github.com/egress-proxies/egress-proxies/pkg/squid"
)

// Create creates the proxy's pod, or adopts the one an earlier attempt
// created (the name is fixed by the UID, so that is AlreadyExists on a pod
// whose mark carries the UID). It answers at once with the pod as the API
// server stored it; Get follows it to Running. Cloud-init has no guest to
// run in: it is ignored, with one WARNING per process.
func (b *Backend) Create(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.Instance, error) {
	name, err := podName(req.GetProxyUid())
	if err != nil {
		return nil, err
	}
	pl := req.GetPlacement()
	sched, image, res, err := b.s.forPlacement(pl.GetRegion(), pl.GetZone(), pl.GetMachineType(), pl.GetImage())
	if err != nil {
		return nil, errclass.Wrap(errclass.Permanent, err)
	}
	if req.GetCloudInit() != "" {
		b.cloudInitOnce.Do(func() {
			b.log.WarnContext(ctx, "WARNING: cloud-init is ignored by the kubernetes backend: a pod has no guest to run it; the proxy is the configured Squid image",
				"proxy_name", req.GetProxyName())
		})
	}
	port := int(req.GetPort())
	if port == 0 {
		port = DefaultPort
	}
	var htpasswd []byte
	if c := req.GetCredentials(); c != nil {
		if htpasswd, err = squid.HTPasswd(c.GetUsername(), c.GetPassword()); err != nil {
			return nil, errclass.New(errclass.Permanent, "%s", err.Error())
		}
	}
	cs, err := b.clientset()
	if err != nil {
		return nil, err
	}
	in := podInput{
		provider: b.name, installation: req.GetInstallation(), uid: req.GetProxyUid(), proxyName: req.GetProxyName(), specHash: req.GetSpecHash(),
		port: port, now: b.now(), sched: sched, image: image, resources: res, auth: htpasswd != nil,
	}
	pod := b.s.buildPod(in, name)
	pods := cs.CoreV1().Pods(b.s.cfg.Namespace)
	cctx, cancel := b.call(ctx)
	created, err := pods.Create(cctx, pod, metav1.CreateOptions{FieldManager: fieldManager})
	cancel()
	switch {
	case err == nil:
		b.log.DebugContext(ctx, "kubernetes pod created", "pod", name)
		crashpoint.After(ctx, "kubernetes.created")
		if err := b.ensureSecret(ctx, in, created, req.GetCredentials(), htpasswd); err != nil {
			return nil, err
		}
		return b.toInstance(created), nil
	case apierrors.IsAlreadyExists(err):
	default:
		return nil, notFoundAsTransient(b.classify(err, "create", "pods"))
	}
	existing, err := b.getPod(ctx, name)
	if err != nil {
		// Deleted between the create and this read: the next attempt
		// creates it.
		return nil, notFoundAsTransient(err)
	}
	if !ours(existing, b.name, req.GetInstallation(), req.GetProxyUid()) {
		return nil, errclass.New(errclass.Permanent, "pod %s/%s already exists and is not this proxy's (%s); delete or rename it",
			b.s.cfg.Namespace, name, describeMark(existing)).WithMetadata("namespace", b.s.cfg.Namespace, "pod", name)
	}
	if existing.DeletionTimestamp != nil {
		return nil, errclass.New(errclass.Transient, "pod %s/%s of this proxy is still being deleted; it is created again once it is gone",
			b.s.cfg.Namespace, name)
	}
	b.log.DebugContext(ctx, "kubernetes pod already exists; adopted", "pod", name)
	if existing, err = b.claim(ctx, existing, req.GetInstallation()); err != nil {
		return nil, err
	}
	if htpasswd != nil && !mountsSecret(existing) {
		b.log.WarnContext(ctx, "WARNING: the adopted pod was made without credentials and serves without them until it is replaced (rotate the proxy's credentials to replace it)",
			"pod", name, "proxy_name", req.GetProxyName())
	}
	if err := b.ensureSecret(ctx, in, existing, req.GetCredentials(), htpasswd); err != nil {
		return nil, err
	}
	return b.toInstance(existing), nil
}

// mountsSecret reports whether pod mounts its credentials Secret.
func mountsSecret(pod *corev1.Pod) bool {
	for _, v := range pod.Spec.Volumes {
		if v.Secret != nil && v.Secret.SecretName == pod.Name {
			return true
		}
	}
	return false
}

// secretOurs reports whether sec carries the mark of in's proxy.
func secretOurs(sec *corev1.Secret, in podInput) bool {
	if sec.Labels[LabelManagedBy] != ManagedByValue || sec.Labels[LabelProvider] != in.provider || sec.Annotations[AnnotationUID] != in.uid {
		return false
	}
	ins := sec.Labels[LabelInstallation]
	return ins == "" || ins == in.installation
}

// ownedBy reports whether pod owns sec.
func ownedBy(sec *corev1.Secret, pod *corev1.Pod) bool {
	for _, o := range sec.OwnerReferences {
		if o.Kind == "Pod" && o.UID == pod.UID {
			return true
		}
	}
	return false
}

// ensureSecret makes pod's credentials Secret hold htpasswd (nil: the
// proxy has none, and there is nothing to make). A Secret of that name
// that another pod of the proxy owned (a former instance whose Secret the
// garbage collector has not removed yet) is replaced, never reused: the
// collector may still delete it. One this pod owns is updated when it
// does not admit c. Errors and logs name the Secret, never its content.
func (b *Backend) ensureSecret(ctx context.Context, in podInput, pod *corev1.Pod, c *proxyv1.ProxyCredentials, htpasswd []byte) error {
	if htpasswd == nil {
		return nil
	}
	cs, err := b.clientset()
	if err != nil {
		return err
	}
	secrets := cs.CoreV1().Secrets(b.s.cfg.Namespace)
	want := b.s.buildSecret(in, pod, htpasswd)
	for attempt := 0; ; attempt++ {
		cctx, cancel := b.call(ctx)
		_, err := secrets.Create(cctx, want, metav1.CreateOptions{FieldManager: fieldManager})
		cancel()
		if err == nil {
			b.log.DebugContext(ctx, "kubernetes secret created", "secret", want.Name)
			return nil
		}
		if !apierrors.IsAlreadyExists(err) || attempt > 0 {
			return b.classify(err, "create", "secrets")
		}
		cctx, cancel = b.call(ctx)
		have, err := secrets.Get(cctx, want.Name, metav1.GetOptions{})
		cancel()
		if apierrors.IsNotFound(err) {
			continue
		}
		if err != nil {
			return b.classify(err, "get", "secrets")
		}
		if !secretOurs(have, in) {
			return errclass.New(errclass.Permanent, "secret %s/%s already exists and is not this proxy's; delete or rename it",
				b.s.cfg.Namespace, want.Name).WithMetadata("namespace", b.s.cfg.Namespace, "secret", want.Name)
		}
		if !ownedBy(have, pod) {
			uid := have.UID
			cctx, cancel = b.call(ctx)
			err := secrets.Delete(cctx, have.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
			cancel()
			if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
				return b.classify(err, "delete", "secrets")
			}
			b.log.DebugContext(ctx, "kubernetes secret of a former pod replaced", "secret", want.Name)
			continue
		}
		if squid.HTPasswdAdmits(have.Data[SecretKeyHTPasswd], c.GetUsername(), c.GetPassword()) {
			return nil
		}
		have.Data = want.Data
		cctx, cancel = b.call(ctx)
		_, err = secrets.Update(cctx, have, metav1.UpdateOptions{FieldManager: fieldManager})
		cancel()
		if err != nil {
			return notFoundAsTransient(b.classify(err, "update", "secrets"))
		}
		b.log.DebugContext(ctx, "kubernetes secret updated", "secret", want.Name)
		return nil
	}
}

// deleteSecret deletes the credentials Secret of the proxy uid's pod
// name, when it is that proxy's. A failure is logged, not returned: the
// Secret is owned by its pod, so the cluster's garbage collector removes
// it anyway once the pod is gone.
func (b *Backend) deleteSecret(ctx context.Context, name, uid, installation string) {
	cs, err := b.clientset()
	if err != nil {
		return
	}
	secrets := cs.CoreV1().Secrets(b.s.cfg.Namespace)
	cctx, cancel := b.call(ctx)
	have, err := secrets.Get(cctx, name, metav1.GetOptions{})
	cancel()
	switch {
	case apierrors.IsNotFound(err):
		return
	case err != nil:
		b.log.WarnContext(ctx, "WARNING: the proxy's credentials secret could not be read; the garbage collector removes it with its pod", "secret", name, "error", b.classify(err, "get", "secrets"))
		return
	}
	if have.Labels[LabelManagedBy] != ManagedByValue || have.Labels[LabelProvider] != b.name || (uid != "" && have.Annotations[AnnotationUID] != uid) {
		return
	}
	if ins := have.Labels[LabelInstallation]; ins != "" && ins != installation {
		return
	}
	suid := have.UID
	cctx, cancel = b.call(ctx)
	err = secrets.Delete(cctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &suid}})
	cancel()
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		b.log.WarnContext(ctx, "WARNING: the proxy's credentials secret could not be deleted; the garbage collector removes it with its pod", "secret", name, "error", b.classify(err, "delete", "secrets"))
		return
	}
	b.log.DebugContext(ctx, "kubernetes secret deleted", "secret", name)
}

const fieldManager = "egress-proxies-provisioner"

func notFoundAsTransient(err error) error {
	if errclass.Is(err, errclass.NotFound) {
		return errclass.Wrap(errclass.Transient, err)
	}
	return err
}

// ours reports whether pod carries the mark of provider, of installation
// or of none (a pod made before marks named installations), and (when uid
// is given) of the proxy.
func ours(pod *corev1.Pod, provider, installation, uid string) bool {
	if pod.Labels[LabelManagedBy] != ManagedByValue || pod.Labels[LabelProvider] != provider {
		return false
	}
	if in := pod.Labels[LabelInstallation]; in != "" && in != installation {
		return false
	}
	return uid == "" || pod.Annotations[AnnotationUID] == uid
}

// claim labels the proxy's pod with installation when its mark names none
// (it was made before marks did), so that it is this installation's from
// now on, and answers the pod as it then is.
func (b *Backend) claim(ctx context.Context, pod *corev1.Pod, installation string) (*corev1.Pod, error) {
	if installation == "" || pod.Labels[LabelInstallation] != "" {
		return pod, nil
	}
	cs, err := b.clientset()
	if err != nil {
		return nil, err
	}
	// The UID precondition claims exactly the pod just checked.
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"uid": string(pod.UID), "labels": map[string]string{LabelInstallation: installation},
	}})
	if err != nil {
		return nil, errclass.Wrap(errclass.Transient, err)
	}
	cctx, cancel := b.call(ctx)
	defer cancel()
	patched, err := cs.CoreV1().Pods(b.s.cfg.Namespace).Patch(cctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: fieldManager})
	if err != nil {
		return nil, notFoundAsTransient(b.classify(err, "patch", "pods"))
	}
	b.log.InfoContext(ctx, "kubernetes pod made before installations claimed for this installation", "pod", pod.Name, "installation", installation)
	return patched, nil
}

func describeMark(pod *corev1.Pod) string {
	switch {
	case pod.Labels[LabelManagedBy] != ManagedByValue:
		return "it lacks the " + LabelManagedBy + "=" + ManagedByValue + " label"
	case pod.Labels[LabelProvider] != "" && pod.Annotations[AnnotationUID] == "":
		return "it belongs to provider " + pod.Labels[LabelProvider]
	case pod.Labels[LabelInstallation] != "":
		return "it belongs to proxy UID " + pod.Annotations[AnnotationUID] + " of provider " + pod.Labels[LabelProvider] + ", installation " + pod.Labels[LabelInstallation]
	default:
		return "it belongs to proxy UID " + pod.Annotations[AnnotationUID] + " of provider " + pod.Labels[LabelProvider]
	}
}

func (b *Backend) getPod(ctx context.Context, name string) (*corev1.Pod, error) {
	cs, err := b.clientset()
	if err != nil {
		return nil, err
	}
	cctx, cancel := b.call(ctx)
	defer cancel()
	pod, err := cs.CoreV1().Pods(b.s.cfg.Namespace).Get(cctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, b.classify(err, "get", "pods")
	}
	return pod, nil
}

// Get reads the pod: one request. NotFound when it is gone or its mark is
// not the proxy's.
func (b *Backend) Get(ctx context.Context, req *provisionerv1.GetInstanceRequest) (*provisionerv1.Instance, error) {
	name, err := b.parseProviderID(req.GetProviderId(), req.GetProxyUid())
	if err != nil {
		return nil, err
	}
	pod, err := b.getPod(ctx, name)
	if err != nil {
		return nil, err
	}
	if !ours(pod, b.name, req.GetInstallation(), req.GetProxyUid()) {
		return nil, errclass.New(errclass.NotFound, "pod %s/%s is not this proxy's: %s", b.s.cfg.Namespace, name, describeMark(pod))
	}
	if req.GetProxyUid() != "" {
		if pod, err = b.claim(ctx, pod, req.GetInstallation()); err != nil {
			return nil, err
		}
	}
	return b.toInstance(pod), nil
}

// Delete deletes the proxy's pod (the pod is the whole instance) and
// waits for nothing: Get reports DELETING until the pod is gone. A pod
// that is gone, or not the proxy's, is left alone (false).
func (b *Backend) Delete(ctx context.Context, req *provisionerv1.DeleteInstanceRequest) (bool, error) {
	name, err := b.parseProviderID(req.GetProviderId(), req.GetProxyUid())
	if errclass.Is(err, errclass.NotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	pod, err := b.getPod(ctx, name)
	if errclass.Is(err, errclass.NotFound) {
		b.deleteSecret(ctx, name, req.GetProxyUid(), req.GetInstallation())
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if !ours(pod, b.name, req.GetInstallation(), req.GetProxyUid()) {
		b.log.InfoContext(ctx, "pod is not this proxy's; left alone", "pod", name, "mark", describeMark(pod))
		return false, nil
	}
	cs, err := b.clientset()
	if err != nil {
		return false, err
	}
	cctx, cancel := b.call(ctx)
	defer cancel()
	// The precondition deletes exactly the pod just checked, never a
	// namesake created since.
	uid := pod.UID
	err = cs.CoreV1().Pods(b.s.cfg.Namespace).Delete(cctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
	switch {
	case err == nil:
		b.deleteSecret(ctx, name, pod.Annotations[AnnotationUID], req.GetInstallation())
		return true, nil
	case apierrors.IsNotFound(err):
		return false, nil
	case apierrors.IsConflict(err):
		// Another pod of that name replaced it: the checked one is gone.
		return false, nil
	default:
		return false, b.classify(err, "delete", "pods")
	}
}

// List lists this provider's pods by their labels, following every page.
func (b *Backend) List(ctx context.Context) ([]*provisionerv1.Instance, error) {
	cs, err := b.clientset()
	if err != nil {
		return nil, err
	}
	opts := metav1.ListOptions{LabelSelector: b.selector(), Limit: int64(b.s.cfg.ListPageSize)}
	var out []*provisionerv1.Instance
	pages := 0
	for {
		cctx, cancel := b.call(ctx)
		list, err := cs.CoreV1().Pods(b.s.cfg.Namespace).List(cctx, opts)
		cancel()
		if err != nil {
			return nil, b.classify(err, "list", "pods")
		}
		pages++
		for i := range list.Items {
			out = append(out, b.toInstance(&list.Items[i]))
		}
		if list.Continue == "" {
			break
		}
		opts.Continue = list.Continue
	}
	b.log.DebugContext(ctx, "kubernetes pods listed", "selector", opts.LabelSelector, "pages", pages, "count", len(out))
	return out, nil
}

// toInstance maps a pod onto the contract.
func (b *Backend) toInstance(pod *corev1.Pod) *provisionerv1.Instance {
	state, why := stateOf(pod)
	out := &provisionerv1.Instance{
		ProviderId:   providerID(pod.Namespace, pod.Name),
		ProxyUid:     pod.Annotations[AnnotationUID],
		Name:         pod.Name,
		Installation: pod.Labels[LabelInstallation],
		State:        state,
		Details:      map[string]string{"namespace": pod.Namespace, "phase": string(pod.Status.Phase)},
	}
	if out.Details["phase"] == "" {
		out.Details["phase"] = string(corev1.PodPending)
	}
	if pod.Spec.NodeName != "" {
		out.Details["node"] = pod.Spec.NodeName
	}
	if why != "" {
		out.Details["reason"] = why
	}
	if img := podImage(pod); img != "" {
		out.Details["image"] = img
	}
	if state == provisionerv1.InstanceState_INSTANCE_STATE_RUNNING {
		out.Ip = pod.Status.PodIP
	}
	if t, err := time.Parse(time.RFC3339, pod.Annotations[AnnotationCreated]); err == nil {
		out.CreateTime = timestamppb.New(t)
	} else if !pod.CreationTimestamp.IsZero() {
		out.CreateTime = timestamppb.New(pod.CreationTimestamp.Time)
	}
	return out
}

func podImage(pod *corev1.Pod) string {
	for _, c := range pod.Spec.Containers {
		if c.Name == containerName {
			return c.Image
		}
	}
	return ""
}

// failedWaiting are container waiting reasons no retry of the same pod
// can cure: the spec itself is wrong.
var failedWaiting = map[string]bool{"InvalidImageName": true, "CreateContainerConfigError": true, "CreateContainerError": true}

// stateOf maps a pod's phase and conditions onto the contract's states,
// with the reason when it is not simply running:
//
//	being deleted                         → DELETING
//	Pending, not yet scheduled or pulling → PROVISIONING (reason: Unschedulable, ErrImagePull …)
//	Pending with an invalid image/config  → FAILED
//	Running, Ready, with an address       → RUNNING
//	Running, not Ready (starting, probe failing, crash looping) → PROVISIONING
//	Succeeded, Failed (exited, evicted)   → STOPPED: the orchestrator replaces it after its grace
//	Unknown (node lost)                   → UNSPECIFIED
func stateOf(pod *corev1.Pod) (provisionerv1.InstanceState, string) {
	if pod.DeletionTimestamp != nil {
		return provisionerv1.InstanceState_INSTANCE_STATE_DELETING, "Terminating"
	}
	waiting := ""
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.State.Waiting != nil && cs.State.Waiting.Reason != "" {
			waiting = cs.State.Waiting.Reason
		}
	}
	switch pod.Status.Phase {
	case corev1.PodRunning:
		if podReady(pod) && pod.Status.PodIP != "" {
			return provisionerv1.InstanceState_INSTANCE_STATE_RUNNING, ""
		}
		if waiting != "" {
			return provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING, waiting
		}
		return provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING, "NotReady"
	case corev1.PodSucceeded, corev1.PodFailed:
		why := pod.Status.Reason
		if why == "" {
			why = string(pod.Status.Phase)
		}
		return provisionerv1.InstanceState_INSTANCE_STATE_STOPPED, why
	case corev1.PodUnknown:
		return provisionerv1.InstanceState_INSTANCE_STATE_UNSPECIFIED, "Unknown"
	default: // Pending, or not yet set
		if failedWaiting[waiting] {
			return provisionerv1.InstanceState_INSTANCE_STATE_FAILED, waiting
		}
		if waiting != "" {
			return provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING, waiting
		}
		for _, c := range pod.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason != "" {
				return provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING, c.Reason
			}
		}
		return provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING, "Pending"
	}
}

func podReady(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
