package kvm

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/libvirttest"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
)

// errCrash stands for the process dying: the operation stops at that call
// and the next attempt runs in a fresh Backend.
var errCrash = errors.New("simulated crash")

// crashAt fails the first call of method (and every call after it) so an
// operation stops exactly there.
type crashAt struct {
	libvirtAPI
	method  string
	crashed *atomic.Bool
}

func (c crashAt) stop(m string) error {
	if m == c.method || c.crashed.Load() {
		c.crashed.Store(true)
		return errCrash
	}
	return nil
}

func (c crashAt) StorageVolCreateXML(p libvirt.StoragePool, x string, f libvirt.StorageVolCreateFlags) (libvirt.StorageVol, error) {
	if err := c.stop("StorageVolCreateXML:" + volName(x)); err != nil {
		return libvirt.StorageVol{}, err
	}
	return c.libvirtAPI.StorageVolCreateXML(p, x, f)
}

// volName pulls the volume name out of a volume XML.
func volName(x string) string {
	_, after, _ := strings.Cut(x, "<name>")
	name, _, _ := strings.Cut(after, "</name>")
	if strings.HasSuffix(name, "-seed.iso") {
		return "seed"
	}
	if strings.HasPrefix(name, "base-") {
		return "base"
	}
	return "overlay"
}

// TestLiveCrashMidCreate: a Create that stops in the middle of the base
// image's upload (the volume made, its content and marker not) is finished
// by the next one, with one domain, running, and no leaked volume. The
// crashes between Create's later steps, with the process killed, are the
// conformance suite's (TestConformance in the service's package).
func TestLiveCrashMidCreate(t *testing.T) {
	t.Parallel()
	env := libvirttest.New(t)
	ctx := liveCtx(t)
	for _, step := range []string{"StorageVolCreateXML:base"} {
		t.Run(step, func(t *testing.T) {
			u := uid(t) + strings.ToLower(strings.NewReplacer(":", "-").Replace(step))
			name, _ := instanceName(u)
			t.Cleanup(func() { env.RemoveDomain(name) })
			var crashed atomic.Bool
			first, err := New("kvm-test", liveConfig(env), nil, Options{wrap: func(api libvirtAPI) libvirtAPI {
				return crashAt{libvirtAPI: api, method: step, crashed: &crashed}
			}})
			if err != nil {
				t.Fatal(err)
			}
			defer first.Close()
			if _, err := first.Create(ctx, createReq(u, "tiny")); !errors.Is(err, errCrash) {
				t.Fatalf("first Create = %v, want the simulated crash", err)
			}
			be := newLive(t, liveConfig(env), nil)
			in, err := be.Create(ctx, createReq(u, "tiny"))
			if err != nil {
				t.Fatalf("Create after the crash: %v", err)
			}
			if st := env.DomainState(name); st != "running" {
				t.Errorf("domain %s, want running", st)
			}
			if n := strings.Count(env.Virsh("list", "--all", "--name"), name); n != 1 {
				t.Errorf("%d domains named %s", n, name)
			}
			var mine []string
			for _, v := range env.Volumes() {
				if strings.HasPrefix(v, name) {
					mine = append(mine, v)
				}
			}
			slices.Sort(mine)
			if want := []string{seedName(name), overlayName(name)}; !slices.Equal(mine, want) {
				t.Errorf("volumes of the proxy = %v, want %v", mine, want)
			}
			if _, err := be.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: u}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestLiveListWithAHostDown: one unreachable host does not hide the other;
// a host no longer configured makes Get Permanent and Delete a success.
func TestLiveListWithAHostDown(t *testing.T) {
	t.Parallel()
	env := libvirttest.New(t)
	ctx := liveCtx(t)
	down := liveHost(env, "h2")
	down.Address = env.ClosedAddress()
	var logs logtest.Buffer
	be := newLive(t, liveConfig(env, liveHost(env, "h1"), down), slog.New(slog.NewJSONHandler(&logs, nil)))
	u := uid(t) + "list"
	name, _ := instanceName(u)
	t.Cleanup(func() { env.RemoveDomain(name) })
	req := createReq(u, "tiny")
	req.Placement.Zone = "h1"
	in, err := be.Create(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	// The daemon is shared with the other tests, so their domains may be
	// listed too; this one must be, and nothing from the host that is down.
	list, err := be.List(ctx)
	if err != nil || !slices.ContainsFunc(list, func(i *provisionerv1.Instance) bool {
		return i.GetProviderId() == in.GetProviderId() && i.GetProxyUid() == u && i.GetCreateTime() != nil
	}) || slices.ContainsFunc(list, func(i *provisionerv1.Instance) bool { return strings.HasPrefix(i.GetProviderId(), "hosts/h2/") }) {
		t.Fatalf("List = %v, %v; want %s and nothing of h2", list, err, in.GetProviderId())
	}
	if !strings.Contains(logs.String(), "WARNING: kvm host skipped in List") || !strings.Contains(logs.String(), `"host":"h2"`) {
		t.Errorf("no WARNING for the unreachable host:\n%s", logs.String())
	}
	onlyDown := newLive(t, liveConfig(env, down), nil)
	if _, err := onlyDown.List(ctx); !errclass.Is(err, errclass.Transient) {
		t.Errorf("List with every host down = %v, want Transient", err)
	}
	// h1 dropped from the config.
	without := newLive(t, liveConfig(env, down), nil)
	if _, err := without.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: u}); !errclass.Is(err, errclass.Permanent) {
		t.Errorf("Get on an unconfigured host = %v, want Permanent", err)
	}
	if deleted, err := without.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: u}); err != nil || deleted {
		t.Errorf("Delete on an unconfigured host = %v, %v; want false, nil", deleted, err)
	}
	if st := env.DomainState(name); st != "running" {
		t.Errorf("domain is %q; an unconfigured host's domain must stay", st)
	}
}

// TestLiveCheck: one verdict per host, in order, with every reason.
func TestLiveCheck(t *testing.T) {
	t.Parallel()
	env := libvirttest.New(t)
	ctx := liveCtx(t)
	inactive := "egress-inactive-" + strings.TrimPrefix(env.Pool, "egress-test-")
	env.DefinePool(inactive, env.Dir+"/inactive", false)
	emptyKnownHosts := env.Dir + "/known_hosts_empty"
	writeTestFile(t, emptyKnownHosts, "")
	notAKey := env.Dir + "/not_a_key"
	writeTestFile(t, notAKey, "this is not a key\n")
	h := func(name string, mod func(*Host)) Host {
		x := liveHost(env, name)
		mod(&x)
		return x
	}
	hosts := []Host{
		h("ok", func(*Host) {}),
		h("missing-pool", func(x *Host) { x.Pool = "no-such-pool" }),
		h("inactive-pool", func(x *Host) { x.Pool = inactive }),
		h("wrong-port", func(x *Host) { x.Address = env.ClosedAddress() }),
		h("host-key-unknown", func(x *Host) { x.KnownHostsFile = emptyKnownHosts }),
		h("host-key-changed", func(x *Host) { x.KnownHostsFile = env.WrongKnownHostsFile }),
		h("key-not-authorised", func(x *Host) { x.KeyFile = env.OtherKeyFile }),
		h("key-file-missing", func(x *Host) { x.KeyFile = env.Dir + "/no-such-key" }),
		h("key-file-garbage", func(x *Host) { x.KeyFile = notAKey }),
		h("wrong-socket", func(x *Host) { x.Socket = "/var/run/libvirt/no-such-sock" }),
	}
	want := []struct{ reason, message string }{
		{provisioner.ReasonReachable, ""},
		{provisioner.ReasonPoolNotFound, "Storage pool not found"},
		{provisioner.ReasonPoolNotActive, "is inactive"},
		{provisioner.ReasonUnreachable, "connection refused"},
		{provisioner.ReasonSSHHandshakeFailed, "key is unknown"},
		{provisioner.ReasonSSHHandshakeFailed, "key mismatch"},
		{provisioner.ReasonSSHHandshakeFailed, "unable to authenticate"},
		{provisioner.ReasonSSHMaterialUnavailable, "no such file"},
		{provisioner.ReasonSSHMaterialUnavailable, "no key found"},
		{provisioner.ReasonLibvirtConnectFailed, "open failed"},
	}
	be := newLive(t, liveConfig(env, hosts...), nil)
	got := be.Check(ctx)
	if len(got) != len(hosts) {
		t.Fatalf("Check gave %d verdicts for %d hosts", len(got), len(hosts))
	}
	for i, ts := range got {
		if ts.GetName() != hosts[i].Name || ts.GetReason() != want[i].reason || !strings.Contains(ts.GetMessage(), want[i].message) ||
			ts.GetReady() != (want[i].reason == provisioner.ReasonReachable) || ts.GetLatency() == nil {
			t.Errorf("%s: ready=%v reason=%s message=%q; want reason %s with %q", hosts[i].Name, ts.GetReady(), ts.GetReason(), ts.GetMessage(), want[i].reason, want[i].message)
		}
	}
	ok := got[0].GetDetails()
	for _, k := range []string{"hostname", "libvirtVersion", "hypervisorVersion", "poolState", "poolCapacity", "poolAvailable", "user"} {
		if ok[k] == "" {
			t.Errorf("details[%s] empty: %v", k, ok)
		}
	}
	if ok["poolState"] != "running" || !strings.HasSuffix(ok["poolAvailable"], "GiB") {
		t.Errorf("details = %v", ok)
	}
	if got[2].GetDetails()["poolState"] != "inactive" {
		t.Errorf("inactive pool details = %v", got[2].GetDetails())
	}

	// The same failures, met by an operation, carry their class.
	classes := map[string]errclass.Class{
		"missing-pool": errclass.Permanent, "wrong-port": errclass.Transient, "host-key-changed": errclass.Permanent,
		"key-not-authorised": errclass.Permanent, "key-file-missing": errclass.Transient, "key-file-garbage": errclass.Permanent,
		"wrong-socket": errclass.Transient,
	}
	for i, hh := range hosts {
		class, ok := classes[hh.Name]
		if !ok {
			continue
		}
		req := createReq(uid(t)+fmt.Sprint(i), "tiny")
		req.Placement.Zone = hh.Name
		if _, err := be.Create(ctx, req); !errclass.Is(err, class) {
			t.Errorf("Create on %s = %v (%v), want %v", hh.Name, err, errclass.Of(err), class)
		}
	}
}

// TestLiveProvidersSharingAHost: two providers on one host see only their
// own domains; a domain marked before marks named their provider is left
// out of List (with one WARNING) until its proxy's Get claims it, in the
// live domain and its definition.
func TestLiveProvidersSharingAHost(t *testing.T) {
	t.Parallel()
	env := libvirttest.New(t)
	ctx := liveCtx(t)
	var logs logtest.Buffer
	a := newLiveAs(t, "kvm-a", liveConfig(env), slog.New(slog.NewJSONHandler(&logs, nil)))
	b := newLiveAs(t, "kvm-b", liveConfig(env), nil)
	listed := func(be *Backend, name string) bool {
		t.Helper()
		list, err := be.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return slices.ContainsFunc(list, func(i *provisionerv1.Instance) bool { return i.GetName() == name })
	}

	u := uid(t) + "shared"
	name, _ := instanceName(u)
	t.Cleanup(func() { env.RemoveDomain(name) })
	in, err := a.Create(ctx, createReq(u, "tiny"))
	if err != nil {
		t.Fatal(err)
	}
	if x := env.DomainXML(name); !strings.Contains(x, "<egress:provider>kvm-a</egress:provider>") {
		t.Fatalf("the mark does not name the provider:\n%s", x)
	}
	if !listed(a, name) || listed(b, name) {
		t.Errorf("listed by kvm-a %v, by kvm-b %v; want only kvm-a", listed(a, name), listed(b, name))
	}
	getReq := &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: u}
	if _, err := b.Get(ctx, getReq); !errclass.Is(err, errclass.NotFound) {
		t.Errorf("kvm-b's Get = %v, want NotFound", err)
	}
	if _, err := b.Create(ctx, createReq(u, "tiny")); !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), `provider "kvm-a"`) {
		t.Errorf("kvm-b's Create = %v, want Permanent naming kvm-a", err)
	}
	if deleted, err := b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: u}); err != nil || deleted {
		t.Errorf("kvm-b's Delete = %v, %v; want false, nil", deleted, err)
	}
	if st := env.DomainState(name); st != "running" || !slices.Contains(env.Volumes(), overlayName(name)) {
		t.Errorf("kvm-a's domain is %q (volumes %v) after kvm-b's calls, want it untouched", st, env.Volumes())
	}
	if deleted, err := a.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: u}); err != nil || !deleted {
		t.Fatalf("kvm-a's Delete = %v, %v", deleted, err)
	}

	// A domain with a legacy mark (no provider), running.
	lu := uid(t) + "legacy"
	lname, _ := instanceName(lu)
	t.Cleanup(func() { env.RemoveDomain(lname) })
	legacyMark := `<egress:instance xmlns:egress="` + metadataURI + `"><egress:managed>true</egress:managed><egress:uid>` + lu +
		`</egress:uid><egress:createdAt>2026-01-02T03:04:05Z</egress:createdAt></egress:instance>`
	path := env.Dir + "/legacy.xml"
	writeTestFile(t, path, fmt.Sprintf(`<domain type='qemu'><name>%s</name><memory unit='MiB'>64</memory><os><type arch='x86_64'>hvm</type></os><metadata>%s</metadata></domain>`, lname, legacyMark))
	env.Virsh("define", path)
	env.Virsh("start", lname)
	if listed(a, lname) || listed(a, lname) || listed(b, lname) {
		t.Error("a legacy-marked domain is listed before it is claimed")
	}
	if n := strings.Count(logs.String(), "WARNING: domain carries a mark without provider"); n != 1 || !strings.Contains(logs.String(), lname) {
		t.Errorf("%d WARNINGs for the legacy domain over two Lists, want 1:\n%s", n, logs.String())
	}
	lid := providerID("h1", lname)
	got, err := a.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: lid, ProxyUid: lu})
	if err != nil || got.GetProxyUid() != lu || !got.GetCreateTime().AsTime().Equal(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)) {
		t.Fatalf("kvm-a's Get of its legacy domain = %v, %v", got, err)
	}
	for _, x := range []string{env.DomainXML(lname), env.Virsh("dumpxml", "--inactive", lname)} {
		if !strings.Contains(x, "<egress:provider>kvm-a</egress:provider>") || !strings.Contains(x, "<egress:createdAt>2026-01-02T03:04:05Z</egress:createdAt>") {
			t.Errorf("the claimed mark lacks the provider or lost the creation time:\n%s", x)
		}
	}
	if !listed(a, lname) || listed(b, lname) {
		t.Error("the claimed domain is not listed by kvm-a only")
	}
	if _, err := b.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: lid, ProxyUid: lu}); !errclass.Is(err, errclass.NotFound) {
		t.Errorf("kvm-b's Get of the claimed domain = %v, want NotFound", err)
	}
}

// TestLiveChecksumChangeKeepsTheBaseInUse: a changed checksum downloads a
// new base beside the old one, whose running domain keeps its backing
// file; once that domain is deleted, the next ensure of the image removes
// the old base and its marker, and the new one stays.
func TestLiveChecksumChangeKeepsTheBaseInUse(t *testing.T) {
	t.Parallel()
	env := libvirttest.New(t)
	ctx := liveCtx(t)
	cfgA := liveConfig(env)
	urlB, shaB := env.ServeImage("tiny-b.qcow2", 32)
	cfgB := liveConfig(env)
	cfgB.Images = map[string]Image{"tiny": {URL: urlB, SHA256: shaB, Firmware: FirmwareBIOS}}
	var logs logtest.Buffer
	beA := newLive(t, cfgA, nil)
	beB := newLive(t, cfgB, slog.New(slog.NewJSONHandler(&logs, nil)))

	base := uid(t) + "sum"
	names := map[string]string{}
	ids := map[string]string{}
	for _, k := range []string{"a", "b", "c"} {
		names[k], _ = instanceName(base + k)
		t.Cleanup(func() { env.RemoveDomain(names[k]) })
	}
	create := func(be *Backend, k string) {
		t.Helper()
		in, err := be.Create(ctx, createReq(base+k, "tiny"))
		if err != nil {
			t.Fatalf("Create %s: %v", k, err)
		}
		ids[k] = in.GetProviderId()
	}
	// backing is the path the overlay of k backs onto and the digest of
	// the file there.
	backing := func(k string) (string, string) {
		t.Helper()
		var doc libvirtxml.StorageVolume
		if err := doc.Unmarshal(env.Virsh("vol-dumpxml", "--pool", env.Pool, overlayName(names[k]))); err != nil || doc.BackingStore == nil {
			t.Fatalf("overlay of %s: %v, %+v", k, err, doc.BackingStore)
		}
		b, err := readFileRoot(doc.BackingStore.Path)
		if err != nil {
			return doc.BackingStore.Path, "missing: " + err.Error()
		}
		sum := sha256.Sum256([]byte(b))
		return doc.BackingStore.Path, hex.EncodeToString(sum[:])
	}

	create(beA, "a")
	pathA, _ := backing("a")
	create(beB, "b")
	if p, sum := backing("a"); p != pathA || sum != env.ImageSHA256 {
		t.Errorf("after the checksum changed, the first overlay backs onto %s holding %s, want %s holding image A %s", p, sum, pathA, env.ImageSHA256)
	}
	pathB, sumB := backing("b")
	if pathB == pathA || sumB != shaB {
		t.Errorf("the second overlay backs onto %s holding %s, want a new base holding image B %s", pathB, sumB, shaB)
	}
	if st := env.DomainState(names["a"]); st != "running" {
		t.Errorf("first domain %s, want running", st)
	}
	baseA, baseB := filepath.Base(pathA), filepath.Base(pathB)
	if vols := env.Volumes(); !slices.Contains(vols, baseA) || !slices.Contains(vols, baseA+".sha256") || !slices.Contains(vols, baseB+".sha256") {
		t.Errorf("pool = %v, want both bases with their markers", vols)
	}

	if _, err := beB.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: ids["a"], ProxyUid: base + "a"}); err != nil {
		t.Fatal(err)
	}
	create(beB, "c")
	vols := env.Volumes()
	if slices.Contains(vols, baseA) || slices.Contains(vols, baseA+".sha256") {
		t.Errorf("pool = %v: %s or its marker left after its last overlay went", vols, baseA)
	}
	if !slices.Contains(vols, baseB) || !slices.Contains(vols, baseB+".sha256") {
		t.Errorf("pool = %v: %s or its marker gone", vols, baseB)
	}
	if p, sum := backing("c"); p != pathB || sum != shaB {
		t.Errorf("third overlay backs onto %s holding %s, want %s", p, sum, pathB)
	}
	if !strings.Contains(logs.String(), `"msg":"old base image removed: no volume backs onto it"`) || !strings.Contains(logs.String(), `"volume":"`+baseA+`"`) {
		t.Errorf("no INFO line for the removed base:\n%s", logs.String())
	}
	if env.ImageHits() != 2 {
		t.Errorf("%d downloads, want one per checksum (2)", env.ImageHits())
	}
	for _, k := range []string{"b", "c"} {
		if _, err := beB.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: ids[k], ProxyUid: base + k}); err != nil {
			t.Fatal(err)
		}
	}
}
