package main

import (
	"fmt"
	"maps"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/nocloud"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
	"github.com/egress-proxies/egress-proxies/services/provisioner-proxmox/internal/pvefake"
)

var binary = provisionertest.Binary{Package: ".", Service: "provisioner-proxmox"}

const (
	tokenUser   = "proxy-operator@pve!operator"
	tokenSecret = "7d3c1b2a-0e9f-4a8b-b6c5-5ec4e75ec4e7"
	node        = "pv1-1"
	isoStorage  = "proxy-seeds"
)

// pve is a fake Proxmox VE holding the documented template and the
// provisioner's token, with the token and CA files a provisioner reads.
type pve struct {
	*pvefake.Server
	tokenFile, caFile string
}

func newPVE(t testing.TB) *pve {
	t.Helper()
	fake, err := pvefake.Start(pvefake.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fake.Close)
	fake.AddToken(tokenUser, tokenSecret, fake.OperatorACL())
	fake.AddTemplate(9001, node, pvefake.DebianTemplate(), false)
	return &pve{Server: fake,
		tokenFile: provisionertest.WriteFile(t, "token", tokenUser+"="+tokenSecret+"\n"),
		caFile:    provisionertest.WriteFile(t, "ca.pem", string(fake.CAPEM))}
}

// block is the proxmox block of a provider whose API is at url (the
// fake's, or an address standing for a broken one).
func (p *pve) block(url string) string {
	return fmt.Sprintf(`proxmox:
  url: %s
  tokenFile: %s
  caFile: %s
  nodes: [%s]
  isoStorage: %s
  vlanTag: 4
  templates: {debian-13: {vmid: 9001}}
  machineTypes: {small: {cores: 1, memoryMiB: 1024}}
`, url, p.tokenFile, p.caFile, node, isoStorage)
}

// The contract, against the fake Proxmox VE.
func TestConformance(t *testing.T) {
	t.Parallel()
	p := newPVE(t)
	var vmids atomic.Int32 // the fixtures' VMIDs, above vmidRange
	vmids.Store(200000)
	addVM := func(uid, status, description string) (int, string) {
		vmid, name := int(vmids.Add(1)), "proxy-"+uid
		p.AddVM(pvefake.VM{VMID: vmid, Node: node, Status: status, Config: map[string]string{
			"name": name, "description": description, "boot": "order=scsi0",
			"scsi0": fmt.Sprintf("local-lvm:vm-%d-disk-0,size=4G", vmid), "net0": "virtio=BC:24:11:00:00:01,bridge=vmbr0",
		}})
		return vmid, fmt.Sprintf("vms/%d/%s", vmid, name)
	}
	provisionertest.TestAll(t, provisionertest.Tester{
		Binary:    binary,
		Type:      "proxmox",
		Backend:   func(*testing.T) string { return p.block(p.URL) },
		Placement: &proxyv1.Placement{MachineType: "small", Image: "debian-13"},
		Credentials: func(_ *testing.T, uid string, c *proxyv1.ProxyCredentials) error {
			return noCloudHolds(p.File(node, isoStorage, "iso/proxy-"+uid+"-seed.iso"), c)
		},
		Observe: func(_ *testing.T, uid string) provisionertest.Observed {
			var o provisionertest.Observed
			for _, vm := range p.VMs() {
				if vm.Config["name"] == "proxy-"+uid {
					o.Instances = append(o.Instances, "vm "+vm.Config["name"]+" "+vm.Status)
				}
			}
			for _, f := range p.Files(node, isoStorage) {
				if strings.Contains(f, uid) {
					o.Parts = append(o.Parts, "file "+f)
				}
			}
			return o
		},
		// A clone that finished before the crash: the VM with its mark,
		// stopped, without seed or config.
		HalfMade: func(_ *testing.T, uid string) string {
			_, pid := addVM(uid, "stopped", fmt.Sprintf("proxy-operator-managed=true\nproxy-operator-uid=%s\nproxy-operator-created-at=%s\n",
				uid, time.Now().UTC().Format(time.RFC3339)))
			return pid
		},
		Foreign: func(_ *testing.T, uid string) provisionertest.Foreign {
			vmid, pid := addVM(uid, "running", "the database of another team\n")
			was := p.VMs()[vmid]
			return provisionertest.Foreign{ProviderID: pid, Unchanged: func() error {
				now, ok := p.VMs()[vmid]
				if !ok || now.Status != was.Status || !maps.Equal(now.Config, was.Config) {
					return fmt.Errorf("VM %d was %+v, is %+v (there: %v)", vmid, was, now, ok)
				}
				return nil
			}}
		},
		Unclaim: func(t *testing.T, uid string) {
			for vmid, vm := range p.VMs() {
				if vm.Config["name"] != "proxy-"+uid {
					continue
				}
				p.SetVM(vmid, func(v *pvefake.VM) {
					var kept []string
					for _, line := range strings.Split(v.Config["description"], "\n") {
						if !strings.HasPrefix(line, "proxy-operator-installation=") {
							kept = append(kept, line)
						}
					}
					v.Config["description"] = strings.Join(kept, "\n")
				})
				return
			}
			t.Fatalf("no VM of %s to unclaim", uid)
		},
		CrashSteps: []provisionertest.CrashStep{{Name: "proxmox.cloned"}, {Name: "proxmox.seed-uploaded"}, {Name: "proxmox.configured"}, {Name: "proxmox.started"}},
		Unreachable: func(t *testing.T) provisionertest.Outage {
			return provisionertest.Outage{Backend: p.block("https://" + provisionertest.ClosedAddress(t))}
		},
		Stalled: func(t *testing.T) string { return p.block("https://" + provisionertest.StalledAddress(t)) },
	})
}

// noCloudHolds reports whether the NoCloud image carries c in its meta-data.
func noCloudHolds(image []byte, c *proxyv1.ProxyCredentials) error {
	user, password, err := nocloud.SeedCredentials(image)
	if err != nil {
		return err
	}
	if user != c.GetUsername() || password != c.GetPassword() {
		return fmt.Errorf("the NoCloud image's meta-data carries user %q and a password of %d characters, not the proxy's", user, len(password))
	}
	return nil
}
