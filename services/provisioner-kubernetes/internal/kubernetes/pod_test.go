package kubernetes

import (
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
)

func mustSettings(t *testing.T, c Config) *settings {
	t.Helper()
	s, err := c.WithDefaults().compile()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// The generated squid.conf sets max_filedescriptors: without it Squid
// sizes its table from the container's open-files limit and is
// OOM-killed at start on nodes with a high limit.
func TestSquidConfSetsMaxFileDescriptors(t *testing.T) {
	t.Parallel()
	conf := squidConf(3129, 2048, []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("203.0.113.0/24")}, "proxy-x", "")
	lines := strings.Split(strings.TrimSpace(conf), "\n")
	want := []string{"http_port 3129", "max_filedescriptors 2048", "cache deny all", "pid_filename none",
		"acl clients src 10.0.0.0/8", "acl clients src 203.0.113.0/24", "http_access allow clients", "visible_hostname proxy-x"}
	for _, w := range want {
		found := false
		for _, l := range lines {
			found = found || l == w
		}
		if !found {
			t.Errorf("squid.conf lacks the line %q:\n%s", w, conf)
		}
	}
	if lines[len(lines)-1] != "http_access deny all" {
		t.Errorf("squid.conf must end denying everyone else, ends %q", lines[len(lines)-1])
	}
	if strings.Count(conf, "max_filedescriptors") != 1 {
		t.Errorf("max_filedescriptors set %d times", strings.Count(conf, "max_filedescriptors"))
	}
}

func TestBuildPod(t *testing.T) {
	t.Parallel()
	s := mustSettings(t, Config{
		Namespace: "proxies", MaxFileDescriptors: 1024,
		Labels:      map[string]string{"team": "crawl"},
		Annotations: map[string]string{"example.com/owner": "crawl"},
		Scheduling: Scheduling{
			NodeSelector: map[string]string{"egress": "yes"},
			Tolerations:  []map[string]any{{"key": "egress", "operator": "Exists", "effect": "NoSchedule"}},
		},
		ImagePullSecrets: []string{"regcred"},
	})
	sched, img, res, err := s.forPlacement("eu", "eu-a", "", "")
	if err != nil {
		t.Fatal(err)
	}
	now := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	pod := s.buildPod(podInput{provider: "k8s", uid: "0b5e1c4e-AAAA-4f5e-9b1e-1234567890ab", proxyName: "p-1", specHash: "h1",
		port: 3129, now: now, sched: sched, image: img, resources: res}, "proxy-0b5e1c4e-aaaa-4f5e-9b1e-1234567890ab")

	if pod.Name != "proxy-0b5e1c4e-aaaa-4f5e-9b1e-1234567890ab" || pod.Namespace != "proxies" {
		t.Errorf("pod %s/%s", pod.Namespace, pod.Name)
	}
	wantLabels := map[string]string{LabelManagedBy: ManagedByValue, LabelProvider: "k8s",
		LabelProxyUID: "0b5e1c4e-AAAA-4f5e-9b1e-1234567890ab", "team": "crawl"}
	for k, v := range wantLabels {
		if pod.Labels[k] != v {
			t.Errorf("label %s = %q, want %q", k, pod.Labels[k], v)
		}
	}
	wantAnn := map[string]string{AnnotationUID: "0b5e1c4e-AAAA-4f5e-9b1e-1234567890ab", AnnotationName: "p-1",
		AnnotationCreated: "2026-12-03T10:00:00Z", AnnotationSpecHash: "h1", "example.com/owner": "crawl"}
	for k, v := range wantAnn {
		if pod.Annotations[k] != v {
			t.Errorf("annotation %s = %q, want %q", k, pod.Annotations[k], v)
		}
	}
	conf := pod.Annotations[AnnotationSquidConf]
	if !strings.Contains(conf, "\nmax_filedescriptors 1024\n") || !strings.Contains(conf, "\nhttp_port 3129\n") {
		t.Errorf("squid.conf annotation:\n%s", conf)
	}
	sp := pod.Spec
	if !sp.HostNetwork || sp.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
		t.Errorf("hostNetwork %v dnsPolicy %s, want the node's network", sp.HostNetwork, sp.DNSPolicy)
	}
	if sp.AutomountServiceAccountToken == nil || *sp.AutomountServiceAccountToken {
		t.Error("the proxy pod must not mount an API token")
	}
	if sp.NodeSelector["egress"] != "yes" || sp.NodeSelector[corev1.LabelTopologyRegion] != "eu" || sp.NodeSelector[corev1.LabelTopologyZone] != "eu-a" {
		t.Errorf("nodeSelector %v", sp.NodeSelector)
	}
	if len(sp.Tolerations) != 1 || sp.Tolerations[0].Key != "egress" || sp.Tolerations[0].Effect != corev1.TaintEffectNoSchedule {
		t.Errorf("tolerations %v", sp.Tolerations)
	}
	if len(sp.ImagePullSecrets) != 1 || sp.ImagePullSecrets[0].Name != "regcred" {
		t.Errorf("imagePullSecrets %v", sp.ImagePullSecrets)
	}
	if len(sp.Containers) != 1 {
		t.Fatalf("%d containers", len(sp.Containers))
	}
	c := sp.Containers[0]
	if c.Image != DefaultImage || strings.Join(c.Command, " ") != "squid -N -f /etc/egress-proxy/squid.conf" {
		t.Errorf("container image %q command %v", c.Image, c.Command)
	}
	if len(c.Ports) != 1 || c.Ports[0].ContainerPort != 3129 || c.Ports[0].HostPort != 3129 {
		t.Errorf("ports %v, want 3129 on the host", c.Ports)
	}
	if c.ReadinessProbe == nil || c.ReadinessProbe.TCPSocket == nil || c.ReadinessProbe.TCPSocket.Port.IntValue() != 3129 {
		t.Errorf("readiness probe %v", c.ReadinessProbe)
	}
	if got := c.Resources.Requests.Memory().String(); got != "64Mi" {
		t.Errorf("memory request %s, want the default 64Mi", got)
	}
	if got := c.Resources.Limits.Memory().String(); got != "256Mi" {
		t.Errorf("memory limit %s, want the default 256Mi", got)
	}
	// The conf reaches the container through the downward API, from the
	// annotation that holds it.
	if len(sp.Volumes) != 1 || sp.Volumes[0].DownwardAPI == nil ||
		sp.Volumes[0].DownwardAPI.Items[0].FieldRef.FieldPath != "metadata.annotations['"+AnnotationSquidConf+"']" ||
		sp.Volumes[0].DownwardAPI.Items[0].Path != "squid.conf" {
		t.Errorf("volumes %+v", sp.Volumes)
	}
	if len(c.VolumeMounts) != 1 || c.VolumeMounts[0].MountPath != "/etc/egress-proxy" {
		t.Errorf("mounts %v", c.VolumeMounts)
	}
}

func TestPodName(t *testing.T) {
	t.Parallel()
	for uid, want := range map[string]string{
		"0b5e1c4e-aaaa-4f5e-9b1e-1234567890ab": "proxy-0b5e1c4e-aaaa-4f5e-9b1e-1234567890ab",
		"Mixed_Case.UID":                       "proxy-mixed-case-uid",
		strings.Repeat("a", 80):                "proxy-" + strings.Repeat("a", 57),
	} {
		got, err := podName(uid)
		if err != nil || got != want {
			t.Errorf("podName(%q) = %q, %v; want %q", uid, got, err, want)
		}
	}
	if _, err := podName("___"); err == nil {
		t.Error("a UID of no name characters must be refused")
	}
}

func TestStateOf(t *testing.T) {
	t.Parallel()
	ready := []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	notReady := []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionFalse}}
	waiting := func(r string) []corev1.ContainerStatus {
		return []corev1.ContainerStatus{{Name: "squid", State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: r}}}}
	}
	cases := []struct {
		name   string
		status corev1.PodStatus
		del    bool
		want   string
		why    string
	}{
		{"new", corev1.PodStatus{}, false, "INSTANCE_STATE_PROVISIONING", "Pending"},
		{"unschedulable", corev1.PodStatus{Phase: corev1.PodPending, Conditions: []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: "Unschedulable"}}}, false, "INSTANCE_STATE_PROVISIONING", "Unschedulable"},
		{"pulling", corev1.PodStatus{Phase: corev1.PodPending, ContainerStatuses: waiting("ErrImagePull")}, false, "INSTANCE_STATE_PROVISIONING", "ErrImagePull"},
		{"bad image", corev1.PodStatus{Phase: corev1.PodPending, ContainerStatuses: waiting("InvalidImageName")}, false, "INSTANCE_STATE_FAILED", "InvalidImageName"},
		{"running ready", corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "192.0.2.7", Conditions: ready}, false, "INSTANCE_STATE_RUNNING", ""},
		{"running no ip", corev1.PodStatus{Phase: corev1.PodRunning, Conditions: ready}, false, "INSTANCE_STATE_PROVISIONING", "NotReady"},
		{"running not ready", corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "192.0.2.7", Conditions: notReady}, false, "INSTANCE_STATE_PROVISIONING", "NotReady"},
		{"crash loop", corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "192.0.2.7", Conditions: notReady, ContainerStatuses: waiting("CrashLoopBackOff")}, false, "INSTANCE_STATE_PROVISIONING", "CrashLoopBackOff"},
		{"evicted", corev1.PodStatus{Phase: corev1.PodFailed, Reason: "Evicted"}, false, "INSTANCE_STATE_STOPPED", "Evicted"},
		{"exited", corev1.PodStatus{Phase: corev1.PodSucceeded}, false, "INSTANCE_STATE_STOPPED", "Succeeded"},
		{"node lost", corev1.PodStatus{Phase: corev1.PodUnknown}, false, "INSTANCE_STATE_UNSPECIFIED", "Unknown"},
		{"terminating", corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "192.0.2.7", Conditions: ready}, true, "INSTANCE_STATE_DELETING", "Terminating"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pod := &corev1.Pod{Status: tc.status}
			if tc.del {
				pod.DeletionTimestamp = &metav1Now
			}
			got, why := stateOf(pod)
			if got.String() != tc.want || why != tc.why {
				t.Errorf("stateOf = %s, %q; want %s, %q", got, why, tc.want, tc.why)
			}
		})
	}
}

// A proxy with credentials: squid asks basic_ncsa_auth about the
// htpasswd file of the mounted Secret, and lets in only the allowed
// networks' clients that present them; without, the allowed networks.
func TestSquidConfAuth(t *testing.T) {
	t.Parallel()
	allowed := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}
	open := squidConf(3128, 4096, allowed, "proxy-x", "")
	auth := squidConf(3128, 4096, allowed, "proxy-x", "/usr/lib/squid/basic_ncsa_auth")
	tail := "http_access deny CONNECT !SSL_ports\n" +
		"auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/egress-proxy-auth/htpasswd\n" +
		"auth_param basic realm egress-proxies\n" +
		"auth_param basic children 2 startup=1 idle=1\n" +
		"auth_param basic credentialsttl 1 minute\n" +
		"acl authenticated proxy_auth REQUIRED\n" +
		"http_access allow clients authenticated\n" +
		"http_access deny all\n"
	if !strings.HasSuffix(auth, tail) {
		t.Errorf("squid.conf with credentials ends\n%s\nwant\n%s", auth, tail)
	}
	if strings.Contains(open, "auth_param") || !strings.HasSuffix(open, "http_access allow clients\nhttp_access deny all\n") {
		t.Errorf("squid.conf without credentials:\n%s", open)
	}
	s := mustSettings(t, Config{Namespace: "proxies"})
	pod := s.buildPod(podInput{provider: "k8s", uid: "u", port: 3128, auth: true}, "proxy-u")
	if got := pod.Annotations[AnnotationSquidConf]; !strings.HasSuffix(got, tail) {
		t.Errorf("the pod's squid.conf:\n%s", got)
	}
	vols := pod.Spec.Volumes
	if len(vols) != 2 || vols[1].Secret == nil || vols[1].Secret.SecretName != "proxy-u" || *vols[1].Secret.DefaultMode != 0o444 {
		t.Errorf("volumes %+v: want the downward-API conf and the Secret proxy-u", vols)
	}
	if _, err := (Config{Namespace: "p", AuthHelper: "basic_ncsa_auth"}).WithDefaults().compile(); err == nil || !strings.Contains(err.Error(), "authHelper") {
		t.Errorf("a relative authHelper: %v", err)
	}
}

// The generated squid.conf, with and without credentials, is one Debian's
// squid (the package DefaultImage is built from) parses without an error.
func TestSquidParsesTheConf(t *testing.T) {
	t.Parallel()
	bin, err := exec.LookPath("squid")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/squid"); serr != nil {
			t.Skip("squid is not installed (apt-get install squid; scripts/ensure-deps.sh installs it)")
		}
		bin = "/usr/sbin/squid"
	}
	allowed := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("::1/128")}
	for name, helper := range map[string]string{"open": "", "auth": DefaultAuthHelper} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			conf := filepath.Join(t.TempDir(), "squid.conf")
			if err := os.WriteFile(conf, []byte(squidConf(3128, 4096, allowed, "proxy-x", helper)), 0o644); err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command(bin, "-k", "parse", "-f", conf).CombinedOutput()
			if err != nil || strings.Contains(string(out), "ERROR") || strings.Contains(string(out), "FATAL") {
				t.Errorf("squid -k parse: %v\n%s", err, out)
			}
			if helper != "" && !strings.Contains(string(out), "Processing: http_access allow clients authenticated") {
				t.Errorf("squid did not read the auth rule:\n%s", out)
			}
		})
	}
}
