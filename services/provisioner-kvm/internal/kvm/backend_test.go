package kvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"golang.org/x/crypto/ssh/knownhosts"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
)

var testImage = []byte("a qcow2 image, as far as this test is concerned")

func testImageSHA() string {
	s := sha256.Sum256(testImage)
	return hex.EncodeToString(s[:])
}

// imageServer serves testImage and counts requests.
type imageServer struct {
	*httptest.Server
	hits     atomic.Int32
	noLength bool
	status   int
	release  chan struct{} // when set, answers wait for it
}

func newImageServer(t *testing.T) *imageServer {
	s := &imageServer{status: http.StatusOK}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.hits.Add(1)
		if s.release != nil {
			<-s.release
		}
		if s.status != http.StatusOK {
			w.WriteHeader(s.status)
			return
		}
		if s.noLength {
			w.(http.Flusher).Flush()
		} else {
			w.Header().Set("Content-Length", strconv.Itoa(len(testImage)))
		}
		_, _ = w.Write(testImage)
	}))
	t.Cleanup(s.Close)
	return s
}

func fakeBackend(t *testing.T, api *fakeAPI, srv *imageServer, mod func(*Config)) (*Backend, *fakeDialer) {
	t.Helper()
	cfg := Config{
		Hosts:        []Host{{Name: "h1", Address: "h1:22", User: "virt", KeyFile: "/k", KnownHostsFile: "/kh", Bridge: "br0"}},
		Images:       map[string]Image{"debian": {URL: srv.URL + "/d.qcow2", SHA256: testImageSHA()}},
		MachineTypes: map[string]MachineType{"small": {VCPUs: 1, MemoryMiB: 512}},
	}
	if mod != nil {
		mod(&cfg)
	}
	d := &fakeDialer{api: api}
	be, err := New("kvm-test", cfg, nil, Options{dial: d.dial, Now: func() time.Time { return time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC) }})
	if err != nil {
		t.Fatal(err)
	}
	return be, d
}

func req(uid string) *provisionerv1.CreateInstanceRequest {
	return &provisionerv1.CreateInstanceRequest{ProxyUid: uid, Placement: &proxyv1.Placement{}, CloudInit: "#cloud-config\n"}
}

func TestCreateGetDeleteOverTheFake(t *testing.T) {
	t.Parallel()
	api := newFakeAPI("default")
	be, _ := fakeBackend(t, api, newImageServer(t), nil)
	ctx := context.Background()
	in, err := be.Create(ctx, req("u1"))
	if err != nil {
		t.Fatal(err)
	}
	if in.GetProviderId() != "hosts/h1/domains/proxy-u1" || in.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING ||
		!in.GetCreateTime().AsTime().Equal(time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)) {
		t.Fatalf("Create = %v", in)
	}
	ov := api.pools["default"]["proxy-u1.qcow2"]
	if ov == nil || ov.backing != "/pools/default/"+testBase() || ov.format != "qcow2" {
		t.Errorf("overlay = %+v", ov)
	}
	if api.domains["proxy-u1"].state != libvirt.DomainRunning {
		t.Error("domain not started")
	}
	getReq := &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: "u1"}
	// No agent, no ARP entry: booting.
	if got, err := be.Get(ctx, getReq); err != nil || got.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING {
		t.Fatalf("Get = %v, %v", got, err)
	}
	// The ARP table for the NIC's MAC.
	x := api.domains["proxy-u1"].xml
	api.domains["proxy-u1"].xml = strings.Replace(x, "<interface type=\"bridge\">", "<interface type=\"bridge\"><mac address=\"52:54:00:AA:BB:CC\"></mac>", 1)
	api.arp["52:54:00:aa:bb:cc"] = "192.0.2.7"
	if got, err := be.Get(ctx, getReq); err != nil || got.GetIp() != "192.0.2.7" || got.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_RUNNING {
		t.Fatalf("Get via ARP = %v, %v", got, err)
	}
	// The guest agent wins when it answers.
	api.agentIP = "198.51.100.9"
	if got, err := be.Get(ctx, getReq); err != nil || got.GetIp() != "198.51.100.9" {
		t.Fatalf("Get via the agent = %v, %v", got, err)
	}
	if _, err := be.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: "someone-else"}); !errclass.Is(err, errclass.NotFound) {
		t.Errorf("Get with another UID = %v, want NotFound", err)
	}
	deleted, err := be.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: "u1"})
	if err != nil || !deleted {
		t.Fatalf("Delete = %v, %v", deleted, err)
	}
	vols := api.volNames("default")
	slices.Sort(vols)
	if want := []string{testBase(), testBase() + ".sha256"}; !slices.Equal(vols, want) {
		t.Errorf("pool after Delete = %v, want %v", vols, want)
	}
	if _, err := be.Get(ctx, getReq); !errclass.Is(err, errclass.NotFound) {
		t.Errorf("Get after Delete = %v, want NotFound", err)
	}
}

func TestStateMapping(t *testing.T) {
	t.Parallel()
	S := provisionerv1.InstanceState_INSTANCE_STATE_STOPPED
	starting := int32(libvirt.DomainPausedStartingUp)
	for _, tc := range []struct {
		st     libvirt.DomainState
		reason int32
		ip     string
		want   provisionerv1.InstanceState
	}{
		{libvirt.DomainRunning, 0, "", provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING},
		{libvirt.DomainRunning, 0, "10.0.0.2", provisionerv1.InstanceState_INSTANCE_STATE_RUNNING},
		{libvirt.DomainBlocked, 0, "10.0.0.2", provisionerv1.InstanceState_INSTANCE_STATE_RUNNING},
		// libvirtd starting the domain (its caller may be gone).
		{libvirt.DomainPaused, starting, "", provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING},
		{libvirt.DomainPaused, int32(libvirt.DomainPausedUser), "", S},
		{libvirt.DomainPaused, 0, "", S}, {libvirt.DomainShutdown, 0, "", S}, {libvirt.DomainShutoff, 0, "", S}, {libvirt.DomainPmsuspended, 0, "", S},
		{libvirt.DomainCrashed, 0, "", provisionerv1.InstanceState_INSTANCE_STATE_FAILED},
		{libvirt.DomainNostate, 0, "", provisionerv1.InstanceState_INSTANCE_STATE_UNSPECIFIED},
	} {
		if got := mapState(tc.st, tc.reason, tc.ip); got != tc.want {
			t.Errorf("mapState(%v, %d, %q) = %v, want %v", tc.st, tc.reason, tc.ip, got, tc.want)
		}
	}
}

func TestResolvePlacement(t *testing.T) {
	t.Parallel()
	api := newFakeAPI("default")
	be, _ := fakeBackend(t, api, newImageServer(t), func(c *Config) {
		c.Hosts = append(c.Hosts, Host{Name: "h2", Address: "h2:22", User: "v", KeyFile: "/k", KnownHostsFile: "/kh", Bridge: "br0"})
	})
	for _, tc := range []struct {
		name string
		pl   *proxyv1.Placement
		want string
	}{
		{"zone needed with two hosts", &proxyv1.Placement{}, `placement.zone "" is not a host`},
		{"unknown zone", &proxyv1.Placement{Zone: "h9"}, `placement.zone "h9"`},
		{"unknown machine type", &proxyv1.Placement{Zone: "h1", MachineType: "huge"}, `placement.machineType "huge"`},
		{"file image", &proxyv1.Placement{Zone: "h1", Image: "file:///etc/passwd"}, "neither a key of images nor an http(s) URL"},
	} {
		r := req("u")
		r.Placement = tc.pl
		if _, err := be.Create(context.Background(), r); !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want Permanent with %q", tc.name, err, tc.want)
		}
	}
	if len(api.calls) != 0 {
		t.Errorf("bad placements reached libvirt: %v", api.calls)
	}
}

// testBase is the base volume of testImage under the key debian.
func testBase() string { return "base-debian@" + testImageSHA()[:16] + ".qcow2" }

func TestImageCache(t *testing.T) {
	t.Parallel()
	long := time.Now().Add(-time.Hour)
	tests := []struct {
		name     string
		base     []byte
		marker   string
		mtime    time.Time
		wantHits int32
	}{
		{"cached and verified", testImage, testImageSHA(), long, 0},
		{"base without marker left by a dead upload", []byte("half"), "", long, 1},
		{"marker of other content", []byte("older"), strings.Repeat("0", 64), long, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := newImageServer(t)
			api := newFakeAPI("default")
			api.pools["default"][testBase()] = &fakeVol{format: "qcow2", data: tc.base, mtime: tc.mtime}
			if tc.marker != "" {
				api.pools["default"][testBase()+".sha256"] = &fakeVol{format: "raw", data: []byte(tc.marker), mtime: tc.mtime}
			}
			be, _ := fakeBackend(t, api, srv, nil)
			if _, err := be.Create(context.Background(), req("u")); err != nil {
				t.Fatal(err)
			}
			if srv.hits.Load() != tc.wantHits {
				t.Errorf("downloads = %d, want %d", srv.hits.Load(), tc.wantHits)
			}
			if b := api.pools["default"][testBase()]; string(b.data) != string(testImage) {
				t.Errorf("base = %q", b.data)
			}
			if m := api.pools["default"][testBase()+".sha256"]; string(m.data) != testImageSHA() {
				t.Errorf("marker = %q", m.data)
			}
		})
	}
}

// A base without marker written recently is another process's upload: it
// is left alone and the Create is Transient.
func TestImageCacheLeavesAnotherProcessesUpload(t *testing.T) {
	t.Parallel()
	srv := newImageServer(t)
	api := newFakeAPI("default")
	api.pools["default"][testBase()] = &fakeVol{format: "qcow2", data: []byte("half"), mtime: time.Now()}
	be, _ := fakeBackend(t, api, srv, nil)
	_, err := be.Create(context.Background(), req("u"))
	if !errclass.Is(err, errclass.Transient) || !strings.Contains(err.Error(), "another process is uploading it") {
		t.Fatalf("Create = %v, want Transient naming the other upload", err)
	}
	if b := api.pools["default"][testBase()]; b == nil || string(b.data) != "half" || srv.hits.Load() != 0 {
		t.Errorf("the other upload was touched (base %+v, %d downloads)", b, srv.hits.Load())
	}
}

// Left by a dead process or an accident: a marker without its base is
// replaced by the new upload's; a base without marker that volumes back
// onto is never deleted.
func TestImageCacheLeftovers(t *testing.T) {
	t.Parallel()
	long := time.Now().Add(-time.Hour)
	t.Run("marker without its base", func(t *testing.T) {
		t.Parallel()
		srv := newImageServer(t)
		api := newFakeAPI("default")
		api.pools["default"][testBase()+".sha256"] = &fakeVol{format: "raw", data: []byte(strings.Repeat("0", 64)), mtime: long}
		be, _ := fakeBackend(t, api, srv, nil)
		if _, err := be.Create(context.Background(), req("u")); err != nil {
			t.Fatal(err)
		}
		if m := api.pools["default"][testBase()+".sha256"]; string(m.data) != testImageSHA() || srv.hits.Load() != 1 {
			t.Errorf("marker = %q after %d downloads", m.data, srv.hits.Load())
		}
	})
	t.Run("base without marker with an overlay", func(t *testing.T) {
		t.Parallel()
		srv := newImageServer(t)
		api := newFakeAPI("default")
		api.pools["default"][testBase()] = &fakeVol{format: "qcow2", data: testImage, mtime: long}
		api.pools["default"]["proxy-x.qcow2"] = &fakeVol{format: "qcow2", backing: "/pools/default/" + testBase()}
		be, _ := fakeBackend(t, api, srv, nil)
		_, err := be.Create(context.Background(), req("u"))
		if !errclass.Is(err, errclass.Transient) || !strings.Contains(err.Error(), "1 volumes back onto it") {
			t.Fatalf("Create = %v, want Transient naming the overlay", err)
		}
		if api.pools["default"][testBase()] == nil || srv.hits.Load() != 0 {
			t.Errorf("the base in use was replaced (%d downloads)", srv.hits.Load())
		}
	})
	t.Run("base created by another process meanwhile", func(t *testing.T) {
		t.Parallel()
		srv := newImageServer(t)
		api := newFakeAPI("default")
		api.fail["StorageVolCreateXML"] = lvErr(libvirt.ErrStorageVolExist, "storage volume '%s' exists already", testBase())
		be, _ := fakeBackend(t, api, srv, nil)
		_, err := be.Create(context.Background(), req("u"))
		if !errclass.Is(err, errclass.Transient) || !strings.Contains(err.Error(), "another process is uploading it") {
			t.Fatalf("Create = %v, want Transient naming the other upload", err)
		}
	})
}

// The image's other versions go once no volume backs onto them; a recent
// one without marker (another process's upload) and other images stay.
func TestImageCacheSweepsOldVersions(t *testing.T) {
	t.Parallel()
	srv := newImageServer(t)
	api := newFakeAPI("default")
	long := time.Now().Add(-time.Hour)
	old := "base-debian@" + strings.Repeat("0", 16) + ".qcow2"
	legacy := "base-debian.qcow2"
	uploading := "base-debian@" + strings.Repeat("1", 16) + ".qcow2"
	abandoned := "base-debian@" + strings.Repeat("2", 16) + ".qcow2"
	orphan := "base-debian@" + strings.Repeat("3", 16) + ".qcow2.sha256"
	other := "base-debian-13.qcow2"
	p := api.pools["default"]
	for _, n := range []string{old, legacy, other} {
		p[n] = &fakeVol{format: "qcow2", mtime: long}
		p[n+".sha256"] = &fakeVol{format: "raw", data: []byte(strings.Repeat("0", 64)), mtime: long}
	}
	p[uploading] = &fakeVol{format: "qcow2", mtime: time.Now()}
	p[abandoned] = &fakeVol{format: "qcow2", mtime: long}
	p[orphan] = &fakeVol{format: "raw", mtime: long}
	p["proxy-old.qcow2"] = &fakeVol{format: "qcow2", backing: "/pools/default/" + old}
	p["proxy-old-seed.iso"] = &fakeVol{format: "raw"}
	var logs logtest.Buffer
	be, _ := fakeBackend(t, api, srv, nil)
	be.images.log = slog.New(slog.NewJSONHandler(&logs, nil))
	if _, err := be.Create(context.Background(), req("u")); err != nil {
		t.Fatal(err)
	}
	has := func(n string) bool { _, ok := api.pools["default"][n]; return ok }
	for _, n := range []string{old, old + ".sha256", uploading, other, other + ".sha256", testBase(), testBase() + ".sha256"} {
		if !has(n) {
			t.Errorf("%s removed", n)
		}
	}
	for _, n := range []string{legacy, legacy + ".sha256", abandoned, orphan} {
		if has(n) {
			t.Errorf("%s left", n)
		}
	}
	if !strings.Contains(logs.String(), `"level":"INFO","msg":"old base image removed: no volume backs onto it"`) || !strings.Contains(logs.String(), `"volume":"`+legacy+`"`) {
		t.Errorf("no INFO line for the removed base:\n%s", logs.String())
	}
	// Once its overlay is gone, the next ensure removes the old base.
	delete(api.pools["default"], "proxy-old.qcow2")
	if _, err := be.Create(context.Background(), req("u2")); err != nil {
		t.Fatal(err)
	}
	if has(old) || has(old+".sha256") {
		t.Errorf("%s left after its last overlay went", old)
	}
}

func TestImageCacheFailures(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		mod   func(*imageServer, *Config)
		class errclass.Class
		want  string
	}{
		{"checksum mismatch names both sums", func(_ *imageServer, c *Config) {
			img := c.Images["debian"]
			img.SHA256 = strings.Repeat("a", 64)
			c.Images["debian"] = img
		}, errclass.Permanent, "configured " + strings.Repeat("a", 64) + ", downloaded " + testImageSHA()},
		{"no Content-Length", func(s *imageServer, _ *Config) { s.noLength = true }, errclass.Permanent, "Content-Length"},
		{"404", func(s *imageServer, _ *Config) { s.status = http.StatusNotFound }, errclass.Permanent, "404"},
		{"503", func(s *imageServer, _ *Config) { s.status = http.StatusServiceUnavailable }, errclass.Transient, "503"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := newImageServer(t)
			api := newFakeAPI("default")
			be, _ := fakeBackend(t, api, srv, func(c *Config) { tc.mod(srv, c) })
			_, err := be.Create(context.Background(), req("u"))
			if !errclass.Is(err, tc.class) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Create = %v (%v), want %v with %q", err, errclass.Of(err), tc.class, tc.want)
			}
			if v := api.volNames("default"); len(v) != 0 {
				t.Errorf("volumes left: %v", v)
			}
		})
	}
}

// Concurrent creates on one host share one download.
func TestImageCacheOneDownloadForConcurrentCallers(t *testing.T) {
	t.Parallel()
	srv := newImageServer(t)
	srv.release = make(chan struct{})
	api := newFakeAPI("default")
	be, _ := fakeBackend(t, api, srv, nil)
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() { _, errs[i] = be.Create(context.Background(), req("u"+strconv.Itoa(i))) })
	}
	deadline := time.Now().Add(10 * time.Second)
	for srv.hits.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond) // waiting for the first download to start
	}
	close(srv.release)
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if srv.hits.Load() != 1 {
		t.Errorf("downloads = %d, want 1", srv.hits.Load())
	}
}

func TestListOverTheFake(t *testing.T) {
	t.Parallel()
	api := newFakeAPI("default")
	be, _ := fakeBackend(t, api, newImageServer(t), nil)
	for _, u := range []string{"a", "b"} {
		if _, err := be.Create(context.Background(), req(u)); err != nil {
			t.Fatal(err)
		}
	}
	api.domains["proxy-unmarked"] = &fakeDomain{state: libvirt.DomainRunning}
	api.domains["web01"] = &fakeDomain{state: libvirt.DomainRunning}
	list, err := be.List(context.Background())
	if err != nil || len(list) != 2 || list[0].GetProxyUid() != "a" || list[1].GetProxyUid() != "b" || list[0].GetCreateTime() == nil ||
		list[0].GetState() != provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING || list[0].GetDetails()["libvirtState"] != "running" {
		t.Fatalf("List = %v, %v", list, err)
	}
}

func TestCheckOverTheFake(t *testing.T) {
	t.Parallel()
	api := newFakeAPI("default")
	be, _ := fakeBackend(t, api, newImageServer(t), nil)
	got := be.Check(context.Background())
	if len(got) != 1 || !got[0].GetReady() || got[0].GetReason() != provisioner.ReasonReachable ||
		got[0].GetDetails()["libvirtVersion"] != "9.0.0" || got[0].GetDetails()["hypervisorVersion"] != "7.2.0" ||
		got[0].GetDetails()["poolAvailable"] != "60.0GiB" || got[0].GetDetails()["hostname"] != "fake-host" {
		t.Fatalf("Check = %v", got)
	}
	api.states["default"] = libvirt.StoragePoolInactive
	if got := be.Check(context.Background()); got[0].GetReady() || got[0].GetReason() != provisioner.ReasonPoolNotActive {
		t.Fatalf("Check with a stopped pool = %v", got)
	}
}

func TestClassify(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		err  error
		want errclass.Class
	}{
		{"no domain", lvErr(libvirt.ErrNoDomain, "x"), errclass.NotFound},
		{"no volume", lvErr(libvirt.ErrNoStorageVol, "x"), errclass.NotFound},
		{"no pool", lvErr(libvirt.ErrNoStoragePool, "x"), errclass.Permanent},
		{"kvm without /dev/kvm", lvErr(libvirt.ErrConfigUnsupported, "unsupported configuration: Emulator does not support virt type 'kvm'"), errclass.Permanent},
		{"xml", lvErr(libvirt.ErrXMLError, "x"), errclass.Permanent},
		{"access denied", lvErr(libvirt.ErrAccessDenied, "x"), errclass.Permanent},
		{"missing bridge", lvErr(libvirt.ErrSystemError, "Cannot get interface MTU on 'br9': No such device"), errclass.Transient},
		{"internal", lvErr(libvirt.ErrInternalError, "x"), errclass.Transient},
		{"agent", lvErr(libvirt.ErrAgentUnresponsive, "x"), errclass.Transient},
		{"host key mismatch", &dialError{stage: stageSSHHandshake, err: &knownhosts.KeyError{Want: []knownhosts.KnownKey{{}}}}, errclass.Permanent},
		{"host key unknown", &dialError{stage: stageSSHHandshake, err: &knownhosts.KeyError{}}, errclass.Permanent},
		{"not authorised", &dialError{stage: stageSSHHandshake, err: errors.New("ssh: handshake failed: ssh: unable to authenticate, attempted methods [none publickey], no supported methods remain")}, errclass.Permanent},
		{"refused", &dialError{stage: stageTCP, err: errors.New("dial tcp 127.0.0.1:1: connect: connection refused")}, errclass.Transient},
		{"socket rejected", &dialError{stage: stageLibvirtConnect, err: errors.New(`ssh: rejected: connect failed ("open failed")`)}, errclass.Transient},
		{"eof", io.ErrUnexpectedEOF, errclass.Transient},
		{"kept", errclass.New(errclass.Permanent, "x"), errclass.Permanent},
	}
	for _, tc := range tests {
		if got := errclass.Of(classify(tc.err)); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
	if err := classify(context.DeadlineExceeded); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a deadline lost its identity: %v", err)
	}
}

func TestCheckReason(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err  error
		want string
	}{
		{&dialError{stage: stageSSHMaterial, err: errors.New("x")}, provisioner.ReasonSSHMaterialUnavailable},
		{&dialError{stage: stageTCP, err: context.DeadlineExceeded}, provisioner.ReasonUnreachable},
		{&dialError{stage: stageSSHHandshake, err: errors.New("x")}, provisioner.ReasonSSHHandshakeFailed},
		{&dialError{stage: stageLibvirtConnect, err: errors.New("x")}, provisioner.ReasonLibvirtConnectFailed},
		// A host that accepted the connection and then said nothing.
		{&dialError{stage: stageSSHHandshake, err: fmt.Errorf("ssh: handshake failed: %w", &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded})}, provisioner.ReasonTimeout},
		{&dialError{stage: stageLibvirtConnect, err: fmt.Errorf("libvirt connect: %w", context.DeadlineExceeded)}, provisioner.ReasonTimeout},
		{context.DeadlineExceeded, provisioner.ReasonTimeout},
		{errProbeBusy, provisioner.ReasonTimeout},
		{lvErr(libvirt.ErrNoStoragePool, "x"), provisioner.ReasonPoolNotFound},
		{lvErr(libvirt.ErrInternalError, "x"), provisioner.ReasonLibvirtError},
		{io.EOF, provisioner.ReasonUnreachable},
	} {
		if got := checkReason(tc.err); got != tc.want {
			t.Errorf("checkReason(%v) = %s, want %s", tc.err, got, tc.want)
		}
	}
}

// Two providers on one host: each sees only the domains it marked. A
// legacy mark (no provider) is left out of List until its proxy's Get or
// Create claims it; a stopped domain is claimed in its definition only.
func TestProviderMarkOverTheFake(t *testing.T) {
	t.Parallel()
	api := newFakeAPI("default")
	srv := newImageServer(t)
	a, _ := fakeBackend(t, api, srv, nil)
	var logs logtest.Buffer
	a.log = slog.New(slog.NewJSONHandler(&logs, nil))
	b, _ := fakeBackend(t, api, srv, nil)
	b.name = "kvm-other"
	ctx := context.Background()
	in, err := a.Create(ctx, req("u1"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(api.domains["proxy-u1"].meta, "<egress:provider>kvm-test</egress:provider>") {
		t.Fatalf("mark = %s", api.domains["proxy-u1"].meta)
	}
	names := func(be *Backend) []string {
		list, err := be.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, i := range list {
			out = append(out, i.GetName())
		}
		return out
	}
	if got := names(b); len(got) != 0 {
		t.Errorf("the other provider lists %v", got)
	}
	getReq := &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: "u1"}
	if _, err := b.Get(ctx, getReq); !errclass.Is(err, errclass.NotFound) {
		t.Errorf("the other provider's Get = %v, want NotFound", err)
	}
	if _, err := b.Create(ctx, req("u1")); !errclass.Is(err, errclass.Permanent) || !strings.Contains(err.Error(), `provider "kvm-test"'s mark`) {
		t.Errorf("the other provider's Create = %v, want Permanent naming the owner", err)
	}
	if deleted, err := b.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: "u1"}); err != nil || deleted || api.domains["proxy-u1"] == nil {
		t.Errorf("the other provider's Delete = %v, %v; want the domain left alone", deleted, err)
	}

	legacyMark := func(uid string) string {
		return `<instance><managed>true</managed><uid>` + uid + `</uid><createdAt>2026-01-02T03:04:05Z</createdAt></instance>`
	}
	api.domains["proxy-old1"] = &fakeDomain{state: libvirt.DomainRunning, meta: legacyMark("old1")}
	api.domains["proxy-old2"] = &fakeDomain{state: libvirt.DomainShutoff, meta: legacyMark("old2")}
	for range 2 {
		if got := names(a); !slices.Equal(got, []string{"proxy-u1"}) {
			t.Fatalf("List with legacy domains = %v, want only proxy-u1", got)
		}
	}
	if n := strings.Count(logs.String(), "WARNING: domain carries a mark without provider"); n != 2 {
		t.Errorf("%d WARNINGs for two legacy domains over two Lists, want 2:\n%s", n, logs.String())
	}
	// A claim that fails does not fail Get: the domain is the proxy's by
	// its UID either way; the next Get tries again.
	api.fail["DomainSetMetadata"] = lvErr(libvirt.ErrAccessDenied, "access denied: 'set metadata' not allowed")
	if got, err := a.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: "hosts/h1/domains/proxy-old1", ProxyUid: "old1"}); err != nil || got.GetProxyUid() != "old1" {
		t.Fatalf("Get of a legacy domain whose claim fails = %v, %v", got, err)
	}
	if m, _ := parseMark(api.domains["proxy-old1"].meta); m.Provider != "" || !strings.Contains(logs.String(), "WARNING: claiming a domain with a mark without provider failed") {
		t.Errorf("after a failed claim: mark %+v, logs:\n%s", m, logs.String())
	}
	delete(api.fail, "DomainSetMetadata")
	// Get claims a running one (live and definition), Create a stopped one
	// (its definition; libvirt refuses the live change).
	if got, err := a.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: "hosts/h1/domains/proxy-old1", ProxyUid: "old1"}); err != nil || got.GetProxyUid() != "old1" {
		t.Fatalf("Get of a legacy domain = %v, %v", got, err)
	}
	if got, err := a.Create(ctx, req("old2")); err != nil || got.GetCreateTime().AsTime() != time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC) {
		t.Fatalf("Create over a stopped legacy domain = %v, %v", got, err)
	}
	for _, n := range []string{"proxy-old1", "proxy-old2"} {
		m, err := parseMark(api.domains[n].meta)
		if err != nil || m.Provider != "kvm-test" || m.CreatedAt != "2026-01-02T03:04:05Z" {
			t.Errorf("%s's mark after the claim = %+v, %v", n, m, err)
		}
	}
	if got := names(a); !slices.Equal(got, []string{"proxy-old1", "proxy-old2", "proxy-u1"}) {
		t.Errorf("List after the claims = %v", got)
	}
	if api.domains["proxy-old2"].state != libvirt.DomainRunning {
		t.Error("the adopted legacy domain was not started")
	}
}

// A lookup of the cached base that never returns (its libvirt connection
// stopped answering) costs the Create that made it one step timeout; the
// next Create looks up afresh instead of joining the call still stuck.
func TestStuckCacheLookupIsNotJoined(t *testing.T) {
	t.Parallel()
	api := newFakeAPI("default")
	// The step timeout leaves room for a loaded machine: the second Create
	// must finish within it.
	be, _ := fakeBackend(t, api, newImageServer(t), func(c *Config) { c.StepTimeout = 5 * time.Second })
	if _, err := be.Create(context.Background(), req("first")); err != nil {
		t.Fatal(err)
	}
	stuck := make(chan struct{})
	t.Cleanup(func() { close(stuck) })
	api.mu.Lock()
	api.block["StorageVolDownload"] = stuck
	api.mu.Unlock()
	_, err := be.Create(context.Background(), req("second"))
	if !errclass.Is(err, errclass.Transient) {
		t.Fatalf("Create while the cache lookup is stuck: %v, want Transient", err)
	}
	// The stuck download stays stuck; new ones answer.
	api.mu.Lock()
	delete(api.block, "StorageVolDownload")
	api.mu.Unlock()
	if _, err := be.Create(context.Background(), req("second")); err != nil {
		t.Fatalf("Create after the stuck lookup: %v, want it to look up afresh", err)
	}
}
