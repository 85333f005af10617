//go:build e2e

package e2e

import (
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/libvirttest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
)

// The orchestrator and provisioner-kvm against the machine's real libvirtd
// behind a real sshd: a proxy is built as a running domain (overlay, seed,
// BIOS boot under software emulation), is Provisioning while the guest has
// no address, and on delete leaves nothing of it on the host but the cached
// base image.
func TestKVMBackend(t *testing.T) {
	env := libvirttest.New(t)
	s := newSuite(t)
	s.providers = s.write("providers.yaml", `providers:
  - name: kvm-e2e
    type: kvm
    kvm:
      domainType: qemu
      images: {tiny: {url: "`+env.ImageURL+`", sha256: `+env.ImageSHA256+`, firmware: bios}}
      machineTypes: {small: {vcpus: 1, memoryMiB: 128, diskSizeGb: 1}}
      hosts:
        - name: h1
          address: "`+env.SSHAddress+`"
          user: `+env.User+`
          keyFile: `+env.KeyFile+`
          knownHostsFile: `+env.KnownHostsFile+`
          bridge: `+env.Bridge+`
          pool: `+env.Pool+`
          consoleLogDir: `+env.ConsoleDir+`
`)
	servicetest.Start(t, "../../services/provisioner-kvm", append([]string{"--nats-url=" + s.nats.URL(),
		"--providers-config=" + s.providers, "--provider=kvm-e2e", "--replica-id=kvm-1", "--log-level=debug"}, s.serving()...))
	s.startOrchestrator()
	c := s.proxies()
	resp, err := c.CreateProxy(ctx(t, 30*time.Second), &proxyv1.CreateProxyRequest{Name: "kvm-00", Spec: &proxyv1.ProxySpec{
		Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "kvm-e2e", CloudInit: "#cloud-config\n",
		Placement: &proxyv1.Placement{Zone: "h1", MachineType: "small", Image: "tiny"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	name := "proxy-" + strings.ToLower(resp.GetProxy().GetUid())
	t.Cleanup(func() { env.RemoveDomain(name) })
	waitFor(t, "domain "+name+" running on the host", 2*time.Minute, func() bool { return env.DomainState(name) == "running" })
	// The tiny image has no OS, so neither the guest agent nor the host's
	// neighbour table can give an address, and this machine's libvirt 9.0
	// cannot read the neighbour table anyway ("internal error: wrong nlmsg
	// len", docs/provisioner-kvm.md, known gaps): the proxy stays
	// Provisioning with its domain running and marked.
	p := s.waitAll("kvm", 1, "Provisioning", time.Minute, func(p *proxyv1.Proxy) bool {
		return p.GetStatus().GetPhase() == proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING && p.GetStatus().GetProviderId() != ""
	})[0]
	if p.GetStatus().GetProviderId() != "hosts/h1/domains/"+name || p.GetStatus().GetIp() != "" {
		t.Errorf("status %v", p.GetStatus())
	}
	if x := env.DomainXML(name); !strings.Contains(x, "<egress:uid>"+resp.GetProxy().GetUid()+"</egress:uid>") {
		t.Errorf("domain lacks the proxy's mark:\n%s", x)
	}
	if _, err := c.DeleteProxy(ctx(t, 10*time.Second), &proxyv1.DeleteProxyRequest{Name: "kvm-00"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "kvm-00 gone", 2*time.Minute, func() bool {
		_, err := c.GetProxy(ctx(t, 10*time.Second), &proxyv1.GetProxyRequest{Name: "kvm-00"})
		return status.Code(err) == codes.NotFound
	})
	if st := env.DomainState(name); st != "" {
		t.Errorf("domain %s is still there (%s)", name, st)
	}
	vols := env.Volumes()
	slices.Sort(vols)
	if want := []string{"base-tiny.qcow2", "base-tiny.qcow2.sha256"}; !slices.Equal(vols, want) {
		t.Errorf("pool after the delete = %v, want only the cached base %v", vols, want)
	}
}
