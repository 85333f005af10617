//go:build e2e

package e2e

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/libvirttest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// Two installations of the suite (two databases, two NATS servers, two
// orchestrators with their provisioners) share one fake Proxmox cluster,
// one fake GCE project and one real libvirt host. Each creates a proxy on
// every backend; orphan GC sweeps every 2 s with a 1 s grace, so without
// installation identity each would delete the other's instances as
// orphans within seconds. After several sweeps of both, all six instances
// are still there; then one installation deletes its proxies and the
// other's instances stay.
func TestTwoInstallationsShareBackends(t *testing.T) {
	env := libvirttest.New(t)
	guest := env.ServeGuestImage()
	env.StartDHCP()
	dir := t.TempDir()
	pveURL := startFake(t, "../../services/provisioner-proxmox/internal/pvefake/cmd/pvefake", "--listen=127.0.0.1:0", "--dir="+dir)
	const zone = "europe-west1-b"
	gceURL := startFake(t, "../../services/provisioner-gcp/internal/gcpfake/cmd/gcpfake",
		"--listen=127.0.0.1:0", "--project=egress-e2e", "--zones="+zone)
	providers := `providers:
  - name: pve
    type: proxmox
    proxmox:
      url: ` + pveURL + `
      tokenFile: ` + filepath.Join(dir, "token") + `
      caFile: ` + filepath.Join(dir, "ca.pem") + `
      nodes: [pv1-1]
      isoStorage: proxy-seeds
      templates: {debian-13: {vmid: 9001}}
      machineTypes: {small: {cores: 1, memoryMiB: 1024}}
  - name: gce
    type: gcp
    gcp:
      project: egress-e2e
      zones: [` + zone + `]
      machineTypes: [e2-small]
      images: {debian-13: projects/debian-cloud/global/images/family/debian-13}
      operationWaitSeconds: 5
      endpoint: ` + gceURL + `
      withoutAuthentication: true
  - name: kvm
    type: kvm
    kvm:
      domainType: qemu
      images: {tiny: {url: "` + guest.URL + `", sha256: ` + guest.SHA256 + `, firmware: bios}}
      machineTypes: {small: {vcpus: 1, memoryMiB: 128, diskSizeGb: 1}}
      hosts:
        - name: h1
          address: "` + env.SSHAddress + `"
          user: ` + env.User + `
          keyFile: ` + env.KeyFile + `
          knownHostsFile: ` + env.KnownHostsFile + `
          bridge: ` + env.Bridge + `
          pool: ` + env.Pool + `
          consoleLogDir: ` + env.ConsoleDir + `
`
	specs := map[string]*proxyv1.Placement{
		"pve": {Zone: "pv1-1", MachineType: "small", Image: "debian-13"},
		"gce": {Zone: zone, MachineType: "e2-small", Image: "debian-13"},
		"kvm": {Zone: "h1", MachineType: "small", Image: "tiny"},
	}

	var suites []*suite
	uids := map[string][]string{} // backend -> the proxy UIDs of both installations
	for i, name := range []string{"staging", "production"} {
		s := newSuite(t)
		s.providers = s.write("providers.yaml", providers)
		for _, b := range []string{"pve", "gce", "kvm"} {
			module := map[string]string{"pve": "provisioner-proxmox", "gce": "provisioner-gcp", "kvm": "provisioner-kvm"}[b]
			servicetest.Start(t, "../../services/"+module, append([]string{"--nats-url=" + s.nats.URL(),
				"--providers-config=" + s.providers, "--provider=" + b, "--replica-id=" + b + "-" + name}, s.serving()...))
		}
		s.startOrchestrator()
		for _, b := range []string{"pve", "gce", "kvm"} {
			resp, err := s.proxies().CreateProxy(ctx(t, 30*time.Second), &proxyv1.CreateProxyRequest{
				Name: fmt.Sprintf("%s-%d", b, i), Spec: &proxyv1.ProxySpec{
					Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: b, CloudInit: "#cloud-config\n", Placement: specs[b],
				}})
			if err != nil {
				t.Fatal(err)
			}
			uids[b] = append(uids[b], resp.GetProxy().GetUid())
		}
		suites = append(suites, s)
	}
	t.Cleanup(func() {
		for _, uid := range uids["kvm"] {
			env.RemoveDomain("proxy-" + strings.ToLower(uid))
		}
	})

	// Every instance of both installations exists on its backend.
	present := func(b, uid string) bool {
		switch b {
		case "pve":
			return slices.Contains(pveVMNames(t, pveURL, dir), "proxy-"+strings.ToLower(uid))
		case "gce":
			return slices.Contains(fakeInstances(t, gceURL), "proxy-"+strings.ToLower(uid))
		default:
			return env.DomainState("proxy-"+strings.ToLower(uid)) != ""
		}
	}
	for b, list := range uids {
		for _, uid := range list {
			waittest.For(t, 3*time.Minute, b+" instance of "+uid, func() bool { return present(b, uid) })
		}
	}

	// Several sweeps of both installations over every backend.
	for _, s := range suites {
		for _, b := range []string{"pve", "gce", "kvm"} {
			start := metricValue(t, "http://"+s.orchestrator.HTTP+"/metrics", `egress_orchestrator_gc_sweeps_total{provider="`+b+`"}`)
			waittest.For(t, 2*time.Minute, "three more GC sweeps of "+b, func() bool {
				return metricAtLeast(t, "http://"+s.orchestrator.HTTP+"/metrics", `egress_orchestrator_gc_sweeps_total{provider="`+b+`"}`, start+3)
			})
		}
	}
	for b, list := range uids {
		for _, uid := range list {
			if !present(b, uid) {
				t.Errorf("the %s instance of proxy %s was deleted by the other installation's GC", b, uid)
			}
		}
	}

	// Staging deletes its proxies: production's instances stay.
	for _, b := range []string{"pve", "gce", "kvm"} {
		if _, err := suites[0].proxies().DeleteProxy(ctx(t, 10*time.Second), &proxyv1.DeleteProxyRequest{Name: b + "-0"}); err != nil {
			t.Fatal(err)
		}
	}
	for b, list := range uids {
		waittest.For(t, 2*time.Minute, "staging's "+b+" instance gone", func() bool { return !present(b, list[0]) })
		if !present(b, list[1]) {
			t.Errorf("production's %s instance of proxy %s went with staging's", b, list[1])
		}
	}
}

// startFake starts a fake backend API and returns the URL it prints.
func startFake(t *testing.T, pkg string, args ...string) string {
	t.Helper()
	fake := proctest.Start(t, proctest.Build(t, pkg), args)
	var url string
	waittest.For(t, 30*time.Second, "the fake API at "+pkg, func() bool {
		for _, line := range strings.Split(fake.Output(), "\n") {
			if u, ok := strings.CutPrefix(strings.TrimSpace(line), "url: "); ok {
				url = u
				return true
			}
		}
		return false
	})
	return url
}

// pveVMNames lists the names of the fake Proxmox cluster's VMs through its
// API, with the token and CA the fake wrote into dir.
func pveVMNames(t *testing.T, apiURL, dir string) []string {
	t.Helper()
	token, err := os.ReadFile(filepath.Join(dir, "token"))
	if err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}}
	req, _ := http.NewRequest(http.MethodGet, strings.TrimSuffix(apiURL, "/")+"/api2/json/cluster/resources?type=vm", nil)
	req.Header.Set("Authorization", "PVEAPIToken="+strings.TrimSpace(string(token)))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Data []struct{ Name string }
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("fake Proxmox resources: %d %v", resp.StatusCode, err)
	}
	var out []string
	for _, vm := range list.Data {
		out = append(out, vm.Name)
	}
	return out
}

// metricValue is the sample named series on the metrics page at url, 0
// when it is not there yet.
func metricValue(t *testing.T, url, series string) float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return f
		}
	}
	return 0
}
