package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/libvirttest"
	"github.com/egress-proxies/egress-proxies/pkg/nocloud"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

var binary = provisionertest.Binary{Package: ".", Service: "provisioner-kvm"}

// kvmBlock is the kvm block of a provider with one host, env's, whose SSH
// endpoint is at address (env's sshd, or an address standing for a broken
// one).
func kvmBlock(env *libvirttest.Env, address string) string {
	// A short step timeout: a host connection that stops answering is
	// dropped and the call retried well within the suite's deadlines.
	return fmt.Sprintf(`kvm:
  domainType: qemu
  stepTimeout: 20s
  images: {tiny: {url: %q, sha256: %s, firmware: bios}}
  machineTypes: {small: {vcpus: 1, memoryMiB: 128, diskSizeGb: 1}}
  hosts:
    - {name: h1, address: %q, user: %s, keyFile: %s, knownHostsFile: %s, socket: %s, bridge: %s, pool: %s, consoleLogDir: %s}
`, env.ImageURL, env.ImageSHA256, address, env.User, env.KeyFile, env.KnownHostsFile, env.Socket, env.Bridge, env.Pool, env.ConsoleDir)
}

// The contract against the machine's real libvirtd, behind a real sshd.
func TestConformance(t *testing.T) {
	t.Parallel()
	env := libvirttest.New(t)
	virsh := func(t *testing.T, args ...string) string {
		t.Helper()
		out, err := env.VirshErr(args...)
		if err != nil {
			t.Fatalf("virsh %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return out
	}
	// define defines a shut-off domain named for uid, with metadata.
	define := func(t *testing.T, uid, metadata string) string {
		t.Helper()
		name := "proxy-" + uid
		t.Cleanup(func() { env.RemoveDomain(name) })
		x := fmt.Sprintf(`<domain type='qemu'><name>%s</name><memory unit='MiB'>64</memory><os><type arch='x86_64' machine='q35'>hvm</type></os>%s<devices><serial type='pty'/></devices></domain>`,
			name, metadata)
		path := filepath.Join(t.TempDir(), "domain.xml")
		if err := os.WriteFile(path, []byte(x), 0o644); err != nil {
			t.Fatal(err)
		}
		virsh(t, "define", path)
		return "hosts/h1/domains/" + name
	}
	provisionertest.TestAll(t, provisionertest.Tester{
		Binary:    binary,
		Type:      "kvm",
		Backend:   func(*testing.T) string { return kvmBlock(env, env.SSHAddress) },
		Placement: &proxyv1.Placement{MachineType: "small", Image: "tiny"},
		Credentials: func(t *testing.T, uid string, c *proxyv1.ProxyCredentials) error {
			path := strings.TrimSpace(virsh(t, "vol-path", "--pool", env.Pool, "proxy-"+uid+"-seed.iso"))
			image, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			user, password, err := nocloud.SeedCredentials(image)
			if err != nil {
				return err
			}
			if user != c.GetUsername() || password != c.GetPassword() {
				return fmt.Errorf("the NoCloud image's meta-data carries user %q and a password of %d characters, not the proxy's", user, len(password))
			}
			return nil
		},
		Observe: func(t *testing.T, uid string) provisionertest.Observed {
			var o provisionertest.Observed
			name := "proxy-" + uid
			if st := env.DomainState(name); st != "" {
				o.Instances = append(o.Instances, "domain "+name+" "+st)
			}
			// libvirtd refuses a refresh while another row uploads into
			// the pool; the upload ends within the suite's patience.
			waittest.ForErr(t, provisionertest.Patience, "a refresh of pool "+env.Pool, func() error {
				if out, err := env.VirshErr("pool-refresh", env.Pool); err != nil {
					if strings.Contains(out, "asynchronous jobs running") {
						return errors.New(out)
					}
					t.Fatalf("virsh pool-refresh %s: %v: %s", env.Pool, err, out)
				}
				return nil
			})
			for _, l := range strings.Split(virsh(t, "vol-list", env.Pool), "\n") {
				if f := strings.Fields(l); len(f) > 0 && strings.HasPrefix(f[0], name) {
					o.Parts = append(o.Parts, "volume "+f[0])
				}
			}
			return o
		},
		// The daemon is the machine's: nothing of a row may stay on it.
		Remove: func(t *testing.T, uid string) {
			name := "proxy-" + uid
			env.RemoveDomain(name)
			for _, v := range []string{name + ".qcow2", name + "-seed.iso"} {
				_, _ = env.VirshErr("vol-delete", "--pool", env.Pool, v)
			}
		},
		// A crash between the define and the start: the marked domain,
		// shut off.
		HalfMade: func(t *testing.T, uid string) string {
			return define(t, uid, fmt.Sprintf(`<metadata><egress:instance xmlns:egress="https://egress-proxies.dev/xmlns/kvm-instance/1">`+
				`<egress:managed>true</egress:managed><egress:provider>%s</egress:provider><egress:uid>%s</egress:uid><egress:createdAt>%s</egress:createdAt>`+
				`</egress:instance></metadata>`, provisionertest.ProviderName, uid, time.Now().UTC().Format(time.RFC3339)))
		},
		Foreign: func(t *testing.T, uid string) provisionertest.Foreign {
			pid := define(t, uid, "")
			name := "proxy-" + uid
			was := virsh(t, "dumpxml", "--inactive", name)
			return provisionertest.Foreign{ProviderID: pid, Unchanged: func() error {
				if st := env.DomainState(name); st != "shut off" {
					return fmt.Errorf("domain %s is %q, was shut off", name, st)
				}
				if now := virsh(t, "dumpxml", "--inactive", name); now != was {
					return fmt.Errorf("domain %s was\n%s\nis\n%s", name, was, now)
				}
				return nil
			}}
		},
		// The mark as written before installations: the installation
		// element taken out, in the running domain and its definition.
		Unclaim: func(t *testing.T, uid string) {
			name, uri := "proxy-"+uid, "https://egress-proxies.dev/xmlns/kvm-instance/1"
			now := virsh(t, "metadata", name, "--uri", uri)
			old := regexp.MustCompile(`<(\w+:)?installation>[^<]*</(\w+:)?installation>`).ReplaceAllString(now, "")
			if old == now {
				t.Fatalf("the mark of %s names no installation: %s", name, now)
			}
			old = regexp.MustCompile(`(</?)\w+:`).ReplaceAllString(old, "$1")
			old = regexp.MustCompile(`\s+xmlns:\w+="[^"]*"`).ReplaceAllString(old, "")
			if out, err := env.VirshErr("metadata", name, "--uri", uri, "--key", "egress", "--set", old, "--live", "--config"); err != nil {
				virsh(t, "metadata", name, "--uri", uri, "--key", "egress", "--set", old, "--config")
				t.Logf("unclaimed the definition only: %s", out)
			}
		},
		CrashSteps: []provisionertest.CrashStep{
			{Name: "kvm.overlay-created"}, {Name: "kvm.seed-written"}, {Name: "kvm.defined"},
			// Killed while libvirtd starts the domain: it goes on starting.
			{Name: "kvm.starting", Until: func(t *testing.T, uid string) error {
				if st := env.DomainState("proxy-" + uid); st != "paused" && st != "running" {
					return fmt.Errorf("domain %q", st)
				}
				return nil
			}},
		},
		Unreachable: func(t *testing.T) provisionertest.Outage {
			return provisionertest.Outage{Backend: kvmBlock(env, provisionertest.ClosedAddress(t))}
		},
		Stalled: func(t *testing.T) string { return kvmBlock(env, provisionertest.StalledAddress(t)) },
	})
}
