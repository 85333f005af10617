package providers

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const sample = `
providers:
  - name: pve-home
    type: proxmox
    proxmox:
      url: https://pve.example:8006
      nodes: [pv1-1, pv1-2]
      machineTypes:
        small: {cores: 1, memoryMiB: 1024}
  - name: local
    type: local
`

type machineType struct {
	Cores     int `yaml:"cores"`
	MemoryMiB int `yaml:"memoryMiB"`
}

type proxmoxBlock struct {
	URL          string                 `yaml:"url"`
	Nodes        []string               `yaml:"nodes"`
	MachineTypes map[string]machineType `yaml:"machineTypes"`
}

func TestParse(t *testing.T) {
	t.Parallel()
	cfg, err := Parse([]byte(sample))
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(cfg.Names(), ","); got != "pve-home,local" {
		t.Errorf("names = %s", got)
	}
	p, ok := cfg.Get("pve-home")
	if !ok || p.Type != "proxmox" {
		t.Fatalf("Get = %+v, %v", p, ok)
	}
	var b proxmoxBlock
	if err := p.DecodeBackend(&b); err != nil {
		t.Fatal(err)
	}
	if b.URL != "https://pve.example:8006" || len(b.Nodes) != 2 || b.MachineTypes["small"].MemoryMiB != 1024 {
		t.Errorf("decoded %+v", b)
	}
	local, _ := cfg.Get("local")
	var none proxmoxBlock
	if err := local.DecodeBackend(&none); err != nil || none.URL != "" {
		t.Errorf("a provider without a block: %+v, %v", none, err)
	}
}

func TestParseErrors(t *testing.T) {
	t.Parallel()
	cases := map[string]struct{ doc, want string }{
		"unknown top-level key": {"provider: []\n", "provider: unknown field"},
		"not a list":            {"providers: {}\n", "providers: want a list"},
		"bad name":              {"providers:\n  - {name: Pve_1, type: local}\n", "providers[0].name: \"Pve_1\" must be a DNS label"},
		"unknown type":          {"providers:\n  - {name: a, type: vmware}\n", "providers[0].type: \"vmware\" is not one of"},
		"unknown provider key":  {"providers:\n  - {name: a, type: local, region: x}\n", "providers[0].region: unknown field"},
		"block of another type": {"providers:\n  - {name: a, type: kvm, gcp: {}}\n", "providers[0].gcp: a kvm provider takes a kvm block"},
		"duplicate name":        {"providers:\n  - {name: a, type: local}\n  - {name: a, type: gcp}\n", "providers[1].name: \"a\" is already used by providers[0]"},
		"empty":                 {"", "empty document"},
	}
	for name, tc := range cases {
		if _, err := Parse([]byte(tc.doc)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to contain %q", name, err, tc.want)
		}
	}
}

func TestDecodeBackendRejectsUnknownKeysWithPath(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		"top":    "url: x\ntokenFlie: /t\n",
		"nested": "machineTypes:\n  small: {cores: 1, memMiB: 5}\n",
	}
	want := map[string]string{
		"top":    "providers[0].proxmox.tokenFlie: unknown field (line 6)",
		"nested": "providers[0].proxmox.machineTypes.small.memMiB: unknown field",
	}
	for name, block := range cases {
		doc := "providers:\n  - name: a\n    type: proxmox\n    proxmox:\n" + indent(block, "      ")
		cfg, err := Parse([]byte(doc))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var b proxmoxBlock
		if err := cfg.Providers[0].DecodeBackend(&b); err == nil || !strings.Contains(err.Error(), want[name]) {
			t.Errorf("%s: err = %v, want %q", name, err, want[name])
		}
	}
}

func TestDecodeBackendTypeError(t *testing.T) {
	t.Parallel()
	cfg, err := Parse([]byte("providers:\n  - name: a\n    type: proxmox\n    proxmox:\n      nodes: 5\n"))
	if err != nil {
		t.Fatal(err)
	}
	var b proxmoxBlock
	if err := cfg.Providers[0].DecodeBackend(&b); err == nil || !strings.Contains(err.Error(), "providers[0].proxmox") {
		t.Errorf("type error = %v", err)
	}
}

func TestLoadFile(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "providers.yaml")
	if err := os.WriteFile(path, []byte(sample), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadFile(path); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadFile(path + ".missing"); err == nil {
		t.Error("missing file accepted")
	}
}

func indent(s, prefix string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i := range lines {
		lines[i] = prefix + lines[i]
	}
	return strings.Join(lines, "\n") + "\n"
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(sample))
	f.Add([]byte("providers:\n  - {name: a, type: local}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := Parse(data)
		if err != nil {
			return
		}
		for _, p := range cfg.Providers {
			var b proxmoxBlock
			_ = p.DecodeBackend(&b)
		}
	})
}
