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
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// The orchestrator and provisioner-kvm against the machine's real libvirtd
// behind a real sshd: a proxy is built as a running domain (overlay, seed,
// BIOS boot of a tiny Linux guest under software emulation), goes
// Provisioning and then Running with the address the guest took by DHCP
// on the test's bridge, and on delete leaves nothing of it on the host but
// the cached base image.
//
// The guest has no agent, and this machine's libvirt 9.0 cannot read the
// host's neighbour table ("internal error: wrong nlmsg len"), so the
// address comes from the backend's last source: the host's neighbour
// table read over the SSH connection.
func TestKVMBackend(t *testing.T) {
	env := libvirttest.New(t)
	guest := env.ServeGuestImage()
	router := env.StartDHCP()
	s := newSuite(t)
	s.providers = s.write("providers.yaml", `providers:
  - name: kvm-e2e
    type: kvm
    kvm:
      domainType: qemu
      images: {tiny: {url: "`+guest.URL+`", sha256: `+guest.SHA256+`, firmware: bios}}
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
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("console of %s:\n%s", name, env.ConsoleLog(name))
		}
		env.RemoveDomain(name)
	})
	created := time.Now()
	waittest.For(t, 2*time.Minute, "domain "+name+" running on the host", func() bool { return env.DomainState(name) == "running" })
	if x := env.DomainXML(name); !strings.Contains(x, "<egress:uid>"+resp.GetProxy().GetUid()+"</egress:uid>") {
		t.Errorf("domain lacks the proxy's mark:\n%s", x)
	}
	// The guest boots under software emulation on a shared machine: a
	// generous bound, which a quiet machine meets in well under a minute.
	p := s.waitAll("kvm", 1, "Running", 5*time.Minute, func(p *proxyv1.Proxy) bool {
		return p.GetStatus().GetPhase() == proxyv1.ProxyPhase_PROXY_PHASE_RUNNING
	})[0]
	t.Logf("proxy Running at %s %s after the create (router %s)", p.GetStatus().GetIp(), time.Since(created).Round(time.Second), router)
	mac := env.DomainMAC(name)
	lease := env.Leases()[mac]
	if lease == "" {
		t.Fatalf("no DHCP lease for the guest's MAC %s: %v", mac, env.Leases())
	}
	if p.GetStatus().GetProviderId() != "hosts/h1/domains/"+name || p.GetStatus().GetIp() != lease {
		t.Errorf("status %v, want provider ID hosts/h1/domains/%s and the guest's leased address %s", p.GetStatus(), name, lease)
	}
	if st := env.DomainState(name); st != "running" {
		t.Errorf("domain %s is %q on the host, want running", name, st)
	}
	if _, err := c.DeleteProxy(ctx(t, 10*time.Second), &proxyv1.DeleteProxyRequest{Name: "kvm-00"}); err != nil {
		t.Fatal(err)
	}
	waittest.For(t, 2*time.Minute, "kvm-00 gone", func() bool {
		_, err := c.GetProxy(ctx(t, 10*time.Second), &proxyv1.GetProxyRequest{Name: "kvm-00"})
		return status.Code(err) == codes.NotFound
	})
	if st := env.DomainState(name); st != "" {
		t.Errorf("domain %s is still there (%s)", name, st)
	}
	vols := env.Volumes()
	slices.Sort(vols)
	// The base is versioned by the first 16 hex of its digest.
	baseVol := "base-tiny@" + guest.SHA256[:16] + ".qcow2"
	if want := []string{baseVol, baseVol + ".sha256"}; !slices.Equal(vols, want) {
		t.Errorf("pool after the delete = %v, want only the cached base %v", vols, want)
	}
}
