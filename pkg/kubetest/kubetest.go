// Package kubetest starts a real Kubernetes control plane for tests: etcd,
// kube-apiserver, kube-controller-manager, kube-scheduler and kwok on
// loopback with random ports, and one node simulated by kwok, from the
// binaries scripts/k8s-tools.sh builds (the folder it prints is
// EGRESS_K8S_BIN). The API server validates every object and enforces
// RBAC and admission (ResourceQuota included); the controllers and the
// scheduler run; kwok moves pods to Running with an address on its node.
// No container runs. Tests that use it carry a build tag (cluster) so
// that `make test` needs no binaries; `make test-cluster` runs them.
package kubetest

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// ControlPlane is etcd, kube-apiserver, kube-controller-manager,
// kube-scheduler and kwok on loopback with random ports, and one kwok node.
type ControlPlane struct {
	// Kubeconfig is an admin kubeconfig file (group system:masters).
	Kubeconfig string
	// Config and Client are the admin's.
	Config *rest.Config
	Client kubernetes.Interface
	// NodeName is the kwok node; NodeIP the address kwok gives it, which
	// is also the address of its host-network pods.
	NodeName string
	NodeIP   string
	// Host is the API server's URL.
	Host string
	dir  string
}

// NodeIP is the address of the kwok node (and so of its host-network
// pods): loopback, never routed anywhere.
const NodeIP = "127.0.0.2"

// bareCompleteStage moves a bare pod that may not restart (a `helm test`
// pod) from Running to Succeeded; kwok's own completion stage only handles
// pods owned by a Job.
const bareCompleteStage = `apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-complete-bare
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Running']
    - key: '.spec.restartPolicy'
      operator: 'In'
      values: ['Never']
    - key: '.metadata.ownerReferences'
      operator: 'DoesNotExist'
  next:
    statusTemplate: |
      {{ $now := Now }}
      containerStatuses:
      {{ range $index, $item := .spec.containers }}
      - image: {{ $item.image | Quote }}
        name: {{ $item.name | Quote }}
        ready: false
        restartCount: 0
        started: false
        state:
          terminated:
            exitCode: 0
            finishedAt: {{ $now | Quote }}
            reason: Completed
            startedAt: {{ $now | Quote }}
      {{ end }}
      phase: Succeeded
`

type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Bin is the folder of the Kubernetes binaries, from EGRESS_K8S_BIN; the
// test fails without it.
func Bin(t testing.TB) string {
	t.Helper()
	bin := os.Getenv("EGRESS_K8S_BIN")
	if bin == "" {
		t.Fatal("EGRESS_K8S_BIN must name the folder of the Kubernetes binaries (make test-cluster sets it)")
	}
	return bin
}

// Start starts everything under t.TempDir() and stops it, each process
// waited for, when the test ends.
func Start(t testing.TB) *ControlPlane {
	t.Helper()
	bin := Bin(t)
	dir := t.TempDir()
	logDir := filepath.Join(dir, "logs")
	must(t, os.MkdirAll(logDir, 0o755))

	var mu sync.Mutex
	var procs []*proc
	start := func(name string, args ...string) *proc {
		t.Helper()
		logf, err := os.Create(filepath.Join(logDir, name+".log"))
		must(t, err)
		cmd := exec.Command(filepath.Join(bin, name), args...)
		cmd.Stdout, cmd.Stderr = logf, logf
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		must(t, cmd.Start())
		p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
		go func() { _ = cmd.Wait(); logf.Close(); close(p.done) }()
		mu.Lock()
		procs = append(procs, p)
		mu.Unlock()
		return p
	}
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for i := len(procs) - 1; i >= 0; i-- {
			p := procs[i]
			_ = p.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-p.done:
			case <-time.After(20 * time.Second):
				_ = p.cmd.Process.Kill()
				<-p.done
			}
		}
		if t.Failed() {
			for _, p := range procs {
				b, _ := os.ReadFile(filepath.Join(logDir, p.name+".log"))
				lines := strings.Split(strings.TrimSpace(string(b)), "\n")
				if len(lines) > 30 {
					lines = lines[len(lines)-30:]
				}
				t.Logf("--- last lines of %s:\n%s", p.name, strings.Join(lines, "\n"))
			}
		}
	})
	// A process that exits early fails the test with its log.
	alive := func(p *proc) {
		t.Helper()
		select {
		case <-p.done:
			b, _ := os.ReadFile(filepath.Join(logDir, p.name+".log"))
			t.Fatalf("%s exited: %s", p.name, tail(string(b), 40))
		default:
		}
	}

	// etcd
	etcdClient, etcdPeer := freePort(t), freePort(t)
	etcd := start("etcd", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdClient),
		"--advertise-client-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdClient),
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeer),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeer),
		"--initial-cluster", fmt.Sprintf("default=http://127.0.0.1:%d", etcdPeer),
		"--unsafe-no-fsync")
	waittest.ForErr(t, 60*time.Second, "etcd /health", func() error {
		alive(etcd)
		return httpOK(&http.Client{}, fmt.Sprintf("http://127.0.0.1:%d/health", etcdClient), "")
	})

	// kube-apiserver with a service-account key pair and an admin token.
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	must(t, err)
	saKey := filepath.Join(dir, "sa.key")
	saPub := filepath.Join(dir, "sa.pub")
	must(t, os.WriteFile(saKey, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}), 0o600))
	pubDER, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	must(t, err)
	must(t, os.WriteFile(saPub, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}), 0o644))
	token := randomToken(t)
	tokens := filepath.Join(dir, "tokens.csv")
	must(t, os.WriteFile(tokens, []byte(token+`,admin,admin-uid,"system:masters"`+"\n"), 0o600))
	certDir := filepath.Join(dir, "certs")
	apiPort := freePort(t)
	api := start("kube-apiserver",
		fmt.Sprintf("--etcd-servers=http://127.0.0.1:%d", etcdClient),
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
		fmt.Sprintf("--secure-port=%d", apiPort), "--cert-dir="+certDir,
		"--endpoint-reconciler-type=none",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+saPub, "--service-account-signing-key-file="+saKey,
		"--token-auth-file="+tokens, "--authorization-mode=Node,RBAC",
		"--service-cluster-ip-range=10.96.0.0/16")
	insecure := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} // the API server's own self-signed loopback certificate
	waittest.ForErr(t, 120*time.Second, "kube-apiserver /readyz", func() error {
		alive(api)
		return httpOK(insecure, fmt.Sprintf("https://127.0.0.1:%d/readyz", apiPort), token)
	})

	kubeconfig := filepath.Join(dir, "kubeconfig")
	must(t, os.WriteFile(kubeconfig, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: https://127.0.0.1:%d
    insecure-skip-tls-verify: true
users:
- name: admin
  user:
    token: %s
contexts:
- name: test
  context: {cluster: test, user: admin, namespace: default}
current-context: test
`, apiPort, token)), 0o600))
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	must(t, err)
	cfg.QPS, cfg.Burst = 100, 200
	client, err := kubernetes.NewForConfig(cfg)
	must(t, err)

	cm := start("kube-controller-manager", "--kubeconfig="+kubeconfig,
		"--authentication-kubeconfig="+kubeconfig, "--authorization-kubeconfig="+kubeconfig,
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", freePort(t)), "--leader-elect=false",
		"--service-account-private-key-file="+saKey,
		"--root-ca-file="+filepath.Join(certDir, "apiserver.crt"),
		"--controllers=*", "--use-service-account-credentials=false")
	sched := start("kube-scheduler", "--kubeconfig="+kubeconfig, "--leader-elect=false",
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", freePort(t)))

	stages := []string{}
	entries, err := os.ReadDir(filepath.Join(bin, "stages"))
	must(t, err)
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(bin, "stages", e.Name()))
		must(t, err)
		stages = append(stages, strings.TrimSpace(string(b)))
	}
	stages = append(stages, strings.TrimSpace(bareCompleteStage))
	stagesFile := filepath.Join(dir, "stages.yaml")
	must(t, os.WriteFile(stagesFile, []byte(strings.Join(stages, "\n---\n")+"\n"), 0o644))
	kwok := start("kwok", "--kubeconfig="+kubeconfig, "--config="+stagesFile,
		"--manage-all-nodes=false", "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
		"--node-ip="+NodeIP, fmt.Sprintf("--server-address=127.0.0.1:%d", freePort(t)))

	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name:        "kwok-node-0",
			Annotations: map[string]string{"kwok.x-k8s.io/node": "fake"},
			Labels:      map[string]string{"kubernetes.io/hostname": "kwok-node-0", "type": "kwok"},
		},
		Status: corev1.NodeStatus{
			Allocatable: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("32"), corev1.ResourceMemory: resource.MustParse("256Gi"), corev1.ResourcePods: resource.MustParse("110")},
			Capacity:    corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("32"), corev1.ResourceMemory: resource.MustParse("256Gi"), corev1.ResourcePods: resource.MustParse("110")},
		},
	}
	ctx := context.Background()
	_, err = client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	must(t, err)
	waittest.ForErr(t, 60*time.Second, "kwok node Ready", func() error {
		for _, p := range []*proc{cm, sched, kwok} {
			alive(p)
		}
		n, err := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, c := range n.Status.Conditions {
			if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
				return nil
			}
		}
		return fmt.Errorf("conditions %v", n.Status.Conditions)
	})
	// The default ServiceAccount is created by the controller-manager; pods
	// of a namespace cannot be admitted before it exists.
	return &ControlPlane{Kubeconfig: kubeconfig, Config: cfg, Client: client, NodeName: node.Name, NodeIP: NodeIP, Host: cfg.Host, dir: dir}
}

func httpOK(c *http.Client, url, token string) error {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	return nil
}

func randomToken(t testing.TB) string {
	b := make([]byte, 24)
	_, err := rand.Read(b)
	must(t, err)
	return fmt.Sprintf("%x", b)
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// KubeconfigFor writes a kubeconfig that reaches the API server with
// token, in namespace, and returns its path.
func (cp *ControlPlane) KubeconfigFor(t testing.TB, token, namespace string) string {
	t.Helper()
	f, err := os.CreateTemp(cp.dir, "kubeconfig-*")
	must(t, err)
	defer f.Close()
	_, err = fmt.Fprintf(f, `apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: %s
    insecure-skip-tls-verify: true
users:
- name: user
  user:
    token: %s
contexts:
- name: test
  context: {cluster: test, user: user, namespace: %s}
current-context: test
`, cp.Host, token, namespace)
	must(t, err)
	return f.Name()
}

// Namespace creates a namespace and waits for its default ServiceAccount
// (pods are refused until the controller-manager made it).
func (cp *ControlPlane) Namespace(t testing.TB, name string) {
	t.Helper()
	ctx := context.Background()
	_, err := cp.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	must(t, err)
	waittest.ForErr(t, 60*time.Second, "default ServiceAccount of "+name, func() error {
		_, err := cp.Client.CoreV1().ServiceAccounts(name).Get(ctx, "default", metav1.GetOptions{})
		return err
	})
}

// ServiceAccountToken creates the ServiceAccount namespace/name (if it is
// not there) and returns a token of it from the TokenRequest API: an
// identity with no rights until a Role is bound to it.
func (cp *ControlPlane) ServiceAccountToken(t testing.TB, namespace, name string) string {
	t.Helper()
	ctx := context.Background()
	_, err := cp.Client.CoreV1().ServiceAccounts(namespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	exp := int64(3600)
	tr, err := cp.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
	must(t, err)
	return tr.Status.Token
}

// ProvisionerRules are what the chart's Role grants provisioner-kubernetes
// in its namespace: its proxies' pods, and their credentials Secrets.
var ProvisionerRules = []rbacv1.PolicyRule{
	{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"create", "get", "delete", "list", "patch"}},
	{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"create", "get", "update", "delete"}},
}

// Account makes the ServiceAccount namespace/name, bound to a Role of the
// same name holding rules (nil: no Role, no rights), and returns a
// kubeconfig acting as it in namespace.
func (cp *ControlPlane) Account(t testing.TB, namespace, name string, rules []rbacv1.PolicyRule) string {
	t.Helper()
	ctx := context.Background()
	token := cp.ServiceAccountToken(t, namespace, name)
	if rules != nil {
		_, err := cp.Client.RbacV1().Roles(namespace).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: rules}, metav1.CreateOptions{})
		must(t, err)
		_, err = cp.Client.RbacV1().RoleBindings(namespace).Create(ctx, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: name, Namespace: namespace}},
		}, metav1.CreateOptions{})
		must(t, err)
	}
	return cp.KubeconfigFor(t, token, namespace)
}
