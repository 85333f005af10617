package kvm

import (
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/providers"
)

const minimalBlock = `    kvm:
      images: {debian-13: {url: "https://cloud.example/debian.qcow2"}}
      machineTypes: {small: {vcpus: 1, memoryMiB: 1024}}
      hosts:
        - {name: nas1, address: "nas1.lan:22", user: virt, keyFile: /k, knownHostsFile: /kh, bridge: br0}
`

func decode(t *testing.T, block string) (Config, error) {
	t.Helper()
	c, err := providers.Parse([]byte("providers:\n  - name: kvm-home\n    type: kvm\n" + block))
	if err != nil {
		return Config{}, err
	}
	p, _ := c.Get("kvm-home")
	var cfg Config
	if err := p.DecodeBackend(&cfg); err != nil {
		return Config{}, err
	}
	cfg = cfg.WithDefaults()
	return cfg, cfg.Validate()
}

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	cfg, err := decode(t, minimalBlock)
	if err != nil {
		t.Fatal(err)
	}
	h := cfg.Hosts[0]
	img := cfg.Images["debian-13"]
	if cfg.DiskSizeGB != 10 || cfg.DomainType != "kvm" || !*cfg.InstallGuestAgent || cfg.MaxConcurrentPerHost != 4 || cfg.StepTimeout != 90*time.Second ||
		h.Socket != "/var/run/libvirt/libvirt-sock" || h.Pool != "default" || h.ConsoleLogDir != "/var/log/libvirt/qemu" ||
		img.Format != "qcow2" || img.Firmware != "uefi" || cfg.InsecureIgnoreHostKey {
		t.Errorf("defaults = %+v", cfg)
	}
}

func TestConfigRejects(t *testing.T) {
	t.Parallel()
	host := func(s string) string {
		return strings.Replace(minimalBlock, "{name: nas1, address: \"nas1.lan:22\", user: virt, keyFile: /k, knownHostsFile: /kh, bridge: br0}", s, 1)
	}
	tests := []struct{ name, block, want string }{
		{"unknown key with its path", minimalBlock + "      diskSizeGB: 3\n", "providers[0].kvm.diskSizeGB"},
		{"unknown host key with its path", host("{name: nas1, address: \"a:22\", user: v, keyFile: /k, knownHostsFile: /kh, bridge: br0, sockett: /s}"), "providers[0].kvm.hosts[0].sockett"},
		{"unknown image key with its path", strings.Replace(minimalBlock, `url: "https`, `sha: x, url: "https`, 1), "providers[0].kvm.images.debian-13.sha"},
		{"host name with a slash", host("{name: dc1/rack2, address: \"a:22\", user: v, keyFile: /k, knownHostsFile: /kh, bridge: br0}"), `hosts[0].name "dc1/rack2": letters, digits`},
		{"image key with a traversal", strings.Replace(minimalBlock, "debian-13:", "../etc/d:", 1), `images["../etc/d"]: the key must be letters`},
		{"duplicate host", strings.Replace(minimalBlock, "      hosts:\n", "      hosts:\n        - {name: nas1, address: \"b:22\", user: v, keyFile: /k, knownHostsFile: /kh, bridge: br0}\n", 1), `"nas1" is listed twice`},
		{"address without a port", host("{name: nas1, address: nas1, user: v, keyFile: /k, knownHostsFile: /kh, bridge: br0}"), "hosts[0].address \"nas1\": want host:port"},
		{"no user", host("{name: nas1, address: \"a:22\", keyFile: /k, knownHostsFile: /kh, bridge: br0}"), "hosts[0].user is required"},
		{"no key file", host("{name: nas1, address: \"a:22\", user: v, knownHostsFile: /kh, bridge: br0}"), "hosts[0].keyFile is required"},
		{"no known_hosts", host("{name: nas1, address: \"a:22\", user: v, keyFile: /k, bridge: br0}"), "hosts[0].knownHostsFile is required unless insecureIgnoreHostKey"},
		{"no bridge", host("{name: nas1, address: \"a:22\", user: v, keyFile: /k, knownHostsFile: /kh}"), "hosts[0].bridge is required"},
		{"relative socket", host("{name: nas1, address: \"a:22\", user: v, keyFile: /k, knownHostsFile: /kh, bridge: br0, socket: sock}"), `hosts[0].socket "sock": want an absolute path`},
		{"file image url", strings.Replace(minimalBlock, "https://cloud.example/debian.qcow2", "file:///x", 1), `images.debian-13.url "file:///x"`},
		{"short sha256", strings.Replace(minimalBlock, `url: "https`, `sha256: abc, url: "https`, 1), "images.debian-13.sha256: want 64 hex"},
		{"bad format", strings.Replace(minimalBlock, `url: "https`, `format: vmdk, url: "https`, 1), `images.debian-13.format "vmdk"`},
		{"bad firmware", strings.Replace(minimalBlock, `url: "https`, `firmware: coreboot, url: "https`, 1), `images.debian-13.firmware "coreboot"`},
		{"zero vcpus", strings.Replace(minimalBlock, "vcpus: 1", "vcpus: 0", 1), "machineTypes.small.vcpus"},
		{"bad domain type", minimalBlock + "      domainType: xen\n", `domainType "xen"`},
		{"negative per-host bound", minimalBlock + "      maxConcurrentPerHost: -1\n", "maxConcurrentPerHost"},
		{"step timeout too short", minimalBlock + "      stepTimeout: 10ms\n", "stepTimeout"},
		{"no hosts", strings.Split(minimalBlock, "      hosts:")[0], "hosts: at least one host"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := decode(t, tc.block)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestConfigInsecureNeedsNoKnownHosts(t *testing.T) {
	t.Parallel()
	block := strings.Replace(minimalBlock, ", knownHostsFile: /kh", "", 1) + "      insecureIgnoreHostKey: true\n"
	if _, err := decode(t, block); err != nil {
		t.Fatal(err)
	}
}
