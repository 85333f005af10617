package kvm

// Integration tests against the machine's real libvirtd (QEMU driver,
// software emulation) behind a real sshd of the test's own, reached as a
// non-root user in the libvirt group: pkg/libvirttest sets each one up and
// fails, naming what to install, when libvirtd or sshd is missing.

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/libvirttest"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/nocloud"
)

// liveHost is the Host block for env.
func liveHost(env *libvirttest.Env, name string) Host {
	return Host{
		Name: name, Address: env.SSHAddress, User: env.User, KeyFile: env.KeyFile, KnownHostsFile: env.KnownHostsFile,
		Socket: env.Socket, Bridge: env.Bridge, Pool: env.Pool, ConsoleLogDir: env.ConsoleDir,
	}
}

func liveConfig(env *libvirttest.Env, hosts ...Host) Config {
	if len(hosts) == 0 {
		hosts = []Host{liveHost(env, "h1")}
	}
	return Config{
		Hosts:        hosts,
		DomainType:   DomainQEMU,
		Images:       map[string]Image{"tiny": {URL: env.ImageURL, SHA256: env.ImageSHA256, Firmware: FirmwareBIOS}, "tiny-uefi": {URL: env.ImageURL, SHA256: env.ImageSHA256}},
		MachineTypes: map[string]MachineType{"small": {VCPUs: 1, MemoryMiB: 128, DiskSizeGB: 1}},
		// Nothing in the tiny image runs cloud-init; the agent script only
		// has to be on the seed.
	}
}

func newLive(t *testing.T, cfg Config, log *slog.Logger) *Backend {
	t.Helper()
	return newLiveAs(t, "kvm-test", cfg, log)
}

// newLiveAs is newLive for the provider named provider.
func newLiveAs(t *testing.T, provider string, cfg Config, log *slog.Logger) *Backend {
	t.Helper()
	be, err := New(provider, cfg, log, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(be.Close)
	return be
}

func uid(t *testing.T) string {
	return fmt.Sprintf("%08x-live", time.Now().UnixNano()&0xffffffff)
}

func createReq(uid, image string) *provisionerv1.CreateInstanceRequest {
	return &provisionerv1.CreateInstanceRequest{
		Provider: "kvm-test", ProxyUid: uid, ProxyName: "p",
		Placement: &proxyv1.Placement{MachineType: "small", Image: image},
		CloudInit: "#cloud-config\n# secret-marker-do-not-log\n",
	}
}

func liveCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// TestLiveLifecycle: Create, idempotent re-Create, Get, List, Delete and
// the pool afterwards, on UEFI and BIOS images.
func TestLiveLifecycle(t *testing.T) {
	t.Parallel()
	env := libvirttest.New(t)
	var logs logtest.Buffer
	be := newLive(t, liveConfig(env), slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	ctx := liveCtx(t)
	for _, image := range []string{"tiny", "tiny-uefi"} {
		t.Run(image, func(t *testing.T) {
			u := uid(t) + image
			name, _ := instanceName(u)
			t.Cleanup(func() { env.RemoveDomain(name) })
			in, err := be.Create(ctx, createReq(u, image))
			if err != nil {
				t.Fatalf("Create: %v", err)
			}
			wantID := "hosts/h1/domains/" + name
			if in.GetProviderId() != wantID || in.GetProxyUid() != u || in.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING {
				t.Fatalf("Create = %v, want %s provisioning", in, wantID)
			}
			if st := env.DomainState(name); st != "running" {
				t.Fatalf("domain state %q, want running", st)
			}
			x := env.DomainXML(name)
			for _, want := range []string{"<type arch='x86_64' machine='pc-q35", "type='qemu'", "<source bridge='" + env.Bridge + "'/>",
				"org.qemu.guest_agent.0", "<rng model='virtio'>", metadataURI, "<egress:uid>" + u + "</egress:uid>", env.ConsoleDir + "/" + name + ".log"} {
				if !strings.Contains(x, want) {
					t.Errorf("domain XML lacks %q", want)
				}
			}
			if strings.Contains(x, "<graphics") {
				t.Error("domain has graphics")
			}
			nvram := ""
			if _, after, ok := strings.Cut(x, "<nvram"); ok {
				_, after, _ = strings.Cut(after, ">")
				nvram, _, _ = strings.Cut(after, "<")
			}
			if (nvram != "") != (image == "tiny-uefi") {
				t.Errorf("nvram %q in XML for %s", nvram, image)
			}
			// The overlay has the machine type's 1 GiB on the 16 MiB base.
			if info := env.Virsh("vol-info", "--pool", env.Pool, overlayName(name)); !strings.Contains(info, "1.00 GiB") {
				t.Errorf("overlay: %s", info)
			}
			// The seed on the host holds the user-data byte for byte.
			_, files, err := nocloud.ReadSeedISO([]byte(readVolume(t, env, seedName(name))))
			if err != nil {
				t.Fatalf("seed: %v", err)
			}
			if string(files["user-data"]) != createReq(u, image).CloudInit || !strings.Contains(string(files["meta-data"]), "instance-id: "+name) ||
				!strings.Contains(string(files["vendor-data"]), "qemu-guest-agent") {
				t.Errorf("seed files = %q", files)
			}

			again, err := be.Create(ctx, createReq(u, image))
			if err != nil || again.GetProviderId() != wantID || !again.GetCreateTime().AsTime().Equal(in.GetCreateTime().AsTime()) {
				t.Fatalf("re-Create = %v, %v; want the same domain adopted", again, err)
			}
			got, err := be.Get(ctx, &provisionerv1.GetInstanceRequest{Provider: "kvm-test", ProviderId: wantID, ProxyUid: u})
			if err != nil || got.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING || got.GetIp() != "" {
				t.Fatalf("Get = %v, %v; want provisioning without an address", got, err)
			}
			list, err := be.List(ctx)
			if err != nil || !slices.ContainsFunc(list, func(i *provisionerv1.Instance) bool {
				return i.GetProviderId() == wantID && i.GetProxyUid() == u && i.GetDetails()["libvirtState"] == "running"
			}) {
				t.Fatalf("List = %v, %v; want %s in it", list, err, wantID)
			}

			deleted, err := be.Delete(ctx, &provisionerv1.DeleteInstanceRequest{Provider: "kvm-test", ProviderId: wantID, ProxyUid: u})
			if err != nil || !deleted {
				t.Fatalf("Delete = %v, %v", deleted, err)
			}
			if st := env.DomainState(name); st != "" {
				t.Errorf("domain still there (%s)", st)
			}
			if nvram != "" {
				if _, err := os.Stat(nvram); !os.IsNotExist(err) {
					t.Errorf("NVRAM %s left after Delete: %v", nvram, err)
				}
			}
			for _, v := range env.Volumes() {
				if strings.HasPrefix(v, name) {
					t.Errorf("volume %s left in the pool", v)
				}
			}
			if _, err := be.Get(ctx, &provisionerv1.GetInstanceRequest{Provider: "kvm-test", ProviderId: wantID, ProxyUid: u}); !errclass.Is(err, errclass.NotFound) {
				t.Errorf("Get after Delete = %v, want NotFound", err)
			}
			if deleted, err := be.Delete(ctx, &provisionerv1.DeleteInstanceRequest{Provider: "kvm-test", ProviderId: wantID, ProxyUid: u}); err != nil || deleted {
				t.Errorf("second Delete = %v, %v; want false, nil", deleted, err)
			}
		})
	}
	// What stays in the pool is each key's cached base and its marker,
	// each downloaded once.
	vols := env.Volumes()
	slices.Sort(vols)
	tag := "@" + env.ImageSHA256[:16]
	want := []string{"base-tiny-uefi" + tag + ".qcow2", "base-tiny-uefi" + tag + ".qcow2.sha256", "base-tiny" + tag + ".qcow2", "base-tiny" + tag + ".qcow2.sha256"}
	if !slices.Equal(vols, want) {
		t.Errorf("pool after the deletes = %v, want %v", vols, want)
	}
	if env.ImageHits() != 2 {
		t.Errorf("image downloaded %d times, want once per key (2)", env.ImageHits())
	}
	if strings.Contains(logs.String(), "secret-marker-do-not-log") {
		t.Error("the cloud-init reached the log")
	}
	if !strings.Contains(logs.String(), `"msg":"libvirt call"`) || !strings.Contains(logs.String(), `"call":"DomainDefineXML","duration":`) {
		t.Error("no libvirt call trace with durations at debug")
	}
}

// readVolume reads a volume's file as root.
func readVolume(t *testing.T, env *libvirttest.Env, name string) string {
	t.Helper()
	out := env.Virsh("vol-path", "--pool", env.Pool, name)
	b, err := readFileRoot(strings.TrimSpace(out))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func readFileRoot(p string) (string, error) {
	b, err := os.ReadFile(p)
	return string(b), err
}

func writeTestFile(t *testing.T, p, body string) {
	t.Helper()
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestLiveSeedCarriesCredentials: a proxy's credentials reach the domain
// as NoCloud meta-data keys on its seed volume, read back from the host;
// the debug log of the Create (every libvirt call) never shows the password.
func TestLiveSeedCarriesCredentials(t *testing.T) {
	t.Parallel()
	env := libvirttest.New(t)
	var logs logtest.Buffer
	be := newLive(t, liveConfig(env), slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	u := uid(t) + "creds"
	name, _ := instanceName(u)
	t.Cleanup(func() { env.RemoveDomain(name) })
	req := createReq(u, "tiny")
	req.Credentials = &proxyv1.ProxyCredentials{Username: "egress-0a1b2c3d4e5f", Password: "Zq9-xY_0aBcDeFgHiJkLmNoPqRsTuVwX"}
	if _, err := be.Create(liveCtx(t), req); err != nil {
		t.Fatalf("Create: %v", err)
	}
	_, files, err := nocloud.ReadSeedISO([]byte(readVolume(t, env, seedName(name))))
	if err != nil {
		t.Fatalf("seed: %v", err)
	}
	want := "instance-id: " + name + "\nlocal-hostname: " + name + "\n" +
		"egress_proxy_user: \"egress-0a1b2c3d4e5f\"\negress_proxy_password: \"Zq9-xY_0aBcDeFgHiJkLmNoPqRsTuVwX\"\n"
	if got := string(files["meta-data"]); got != want {
		t.Errorf("seed meta-data = %q, want %q", got, want)
	}
	if strings.Contains(logs.String(), req.Credentials.Password) || !strings.Contains(logs.String(), name) {
		t.Errorf("the log shows the password, or nothing of the Create (the check would prove nothing):\n%s", logs.String())
	}
	if _, err := be.Delete(liveCtx(t), &provisionerv1.DeleteInstanceRequest{ProviderId: "hosts/h1/domains/" + name, ProxyUid: u}); err != nil {
		t.Fatalf("Delete: %v", err)
	}
}
