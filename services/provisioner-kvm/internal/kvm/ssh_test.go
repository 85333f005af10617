package kvm

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/libvirttest"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
)

// sshServer is an in-process x/crypto/ssh server that lets one key in and
// forwards direct-streamlocal channels to target, the machine's libvirtd
// socket, so the dialer runs its whole path against a real daemon.
type sshServer struct {
	addr          string
	hostKey       ssh.Signer
	rejectForward atomic.Bool
	muteKeepalive atomic.Bool
	keepalives    atomic.Int32
	// exec answers the commands of session channels; nil runs them with
	// sh -c on this machine, as sshd would.
	exec atomic.Pointer[execHandler]
	// sessionReject, when not 0, refuses session channels with it.
	sessionReject atomic.Uint32
	wg            sync.WaitGroup
}

// execHandler writes a command's output to stdout and stderr and returns
// its exit status; exit false ends the channel without one (a session
// killed mid-command).
type execHandler func(cmd string, stdout, stderr io.Writer) (status uint32, exit bool)

func newSigner(t *testing.T) (ssh.Signer, []byte) {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	block, err := ssh.MarshalPrivateKey(priv, "")
	if err != nil {
		t.Fatal(err)
	}
	s, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	return s, pem.EncodeToMemory(block)
}

func startSSHServer(t *testing.T, authorized ssh.PublicKey, target string) *sshServer {
	t.Helper()
	s := &sshServer{}
	s.hostKey, _ = newSigner(t)
	cfg := &ssh.ServerConfig{PublicKeyCallback: func(_ ssh.ConnMetadata, k ssh.PublicKey) (*ssh.Permissions, error) {
		if string(k.Marshal()) == string(authorized.Marshal()) {
			return nil, nil
		}
		return nil, errors.New("not authorised")
	}}
	cfg.AddHostKey(s.hostKey)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.addr = l.Addr().String()
	var conns sync.Map
	t.Cleanup(func() {
		_ = l.Close()
		conns.Range(func(k, _ any) bool { _ = k.(net.Conn).Close(); return true })
		s.wg.Wait()
	})
	s.wg.Go(func() {
		for {
			nc, err := l.Accept()
			if err != nil {
				return
			}
			conns.Store(nc, true)
			s.wg.Go(func() { s.serve(nc, cfg, target) })
		}
	})
	return s
}

func (s *sshServer) serve(nc net.Conn, cfg *ssh.ServerConfig, target string) {
	defer func() { _ = nc.Close() }()
	_, chans, reqs, err := ssh.NewServerConn(nc, cfg)
	if err != nil {
		return
	}
	s.wg.Go(func() {
		for r := range reqs {
			if r.Type == "keepalive@openssh.com" {
				s.keepalives.Add(1)
				if s.muteKeepalive.Load() {
					continue // never answered
				}
			}
			_ = r.Reply(r.Type == "keepalive@openssh.com", nil)
		}
	})
	for ch := range chans {
		if ch.ChannelType() == "session" {
			if r := s.sessionReject.Load(); r != 0 {
				_ = ch.Reject(ssh.RejectionReason(r), "session refused")
				continue
			}
			c, creqs, err := ch.Accept()
			if err != nil {
				continue
			}
			s.wg.Go(func() { s.session(c, creqs) })
			continue
		}
		if ch.ChannelType() != "direct-streamlocal@openssh.com" || s.rejectForward.Load() {
			_ = ch.Reject(ssh.ConnectionFailed, "open failed")
			continue
		}
		var msg struct {
			Path      string
			Reserved0 string
			Reserved1 uint32
		}
		if err := ssh.Unmarshal(ch.ExtraData(), &msg); err != nil {
			_ = ch.Reject(ssh.ConnectionFailed, "bad request")
			continue
		}
		uc, err := net.Dial("unix", target)
		if err != nil {
			_ = ch.Reject(ssh.ConnectionFailed, "open failed")
			continue
		}
		c, creqs, err := ch.Accept()
		if err != nil {
			_ = uc.Close()
			continue
		}
		go ssh.DiscardRequests(creqs)
		s.wg.Go(func() {
			done := make(chan struct{}, 2)
			go func() { _, _ = io.Copy(c, uc); _ = c.CloseWrite(); done <- struct{}{} }()
			go func() { _, _ = io.Copy(uc, c); done <- struct{}{} }()
			<-done
			_ = uc.Close()
			_ = c.Close()
		})
	}
}

// session serves one session channel: an exec request runs the command
// through the exec handler and reports its exit status, as sshd does.
func (s *sshServer) session(c ssh.Channel, reqs <-chan *ssh.Request) {
	defer func() { _ = c.Close() }()
	for r := range reqs {
		if r.Type != "exec" {
			_ = r.Reply(false, nil)
			continue
		}
		var msg struct{ Command string }
		if err := ssh.Unmarshal(r.Payload, &msg); err != nil {
			_ = r.Reply(false, nil)
			return
		}
		_ = r.Reply(true, nil)
		go ssh.DiscardRequests(reqs)
		h := runLocally
		if p := s.exec.Load(); p != nil {
			h = *p
		}
		status, exit := h(msg.Command, c, c.Stderr())
		if exit {
			_ = c.CloseWrite()
			_, _ = c.SendRequest("exit-status", false, ssh.Marshal(struct{ Status uint32 }{status}))
		}
		return
	}
}

// runLocally runs cmd with sh -c on this machine.
func runLocally(cmd string, stdout, stderr io.Writer) (uint32, bool) {
	c := exec.Command("sh", "-c", cmd)
	c.Stdout, c.Stderr = stdout, stderr
	err := c.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0, true
	case errors.As(err, &ee):
		return uint32(ee.ExitCode()), true //nolint:gosec // exit codes are 0-255
	default:
		_, _ = fmt.Fprintln(stderr, err)
		return 127, true
	}
}

type sshFixture struct {
	srv             *sshServer
	dir             string
	key, otherKey   string
	knownHosts      string
	wrongKnownHosts string
}

func newSSHFixture(t *testing.T) *sshFixture {
	libvirttest.Require(t)
	f := &sshFixture{dir: t.TempDir()}
	signer, pemKey := newSigner(t)
	_, otherPEM := newSigner(t)
	f.srv = startSSHServer(t, signer.PublicKey(), libvirttest.Socket)
	f.key = write(t, f.dir, "id", string(pemKey))
	f.otherKey = write(t, f.dir, "id_other", string(otherPEM))
	f.knownHosts = write(t, f.dir, "known_hosts", knownhosts.Line([]string{knownhosts.Normalize(f.srv.addr)}, f.srv.hostKey.PublicKey())+"\n")
	other, _ := newSigner(t)
	f.wrongKnownHosts = write(t, f.dir, "known_hosts_wrong", knownhosts.Line([]string{knownhosts.Normalize(f.srv.addr)}, other.PublicKey())+"\n")
	return f
}

func write(t *testing.T, dir, name, body string) string {
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func (f *sshFixture) host() Host {
	return Host{Name: "h1", Address: f.srv.addr, User: "virt", KeyFile: f.key, KnownHostsFile: f.knownHosts, Socket: "/var/run/libvirt/libvirt-sock"}
}

// dial connects to the fixture's server with the production dialer; the
// connection is closed when the test ends.
func (f *sshFixture) dial(t *testing.T) *hostClient {
	t.Helper()
	d := newSSHDialer(false, time.Minute, slog.New(slog.DiscardHandler))
	c, err := d.dial(context.Background(), f.host())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.close)
	return c
}

func TestSSHDialReachesLibvirt(t *testing.T) {
	t.Parallel()
	c := newSSHFixture(t).dial(t)
	if v, err := c.api.ConnectGetLibVersion(); err != nil || v < 1_000_000 {
		t.Fatalf("libvirt version over the forward = %d, %v", v, err)
	}
}

func TestSSHDialStages(t *testing.T) {
	t.Parallel()
	f := newSSHFixture(t)
	garbage := write(t, f.dir, "garbage", "not a key\n")
	closed := func() string {
		l, _ := net.Listen("tcp", "127.0.0.1:0")
		defer func() { _ = l.Close() }()
		return l.Addr().String()
	}()
	tests := []struct {
		name   string
		mod    func(*Host)
		reject bool
		stage  dialStage
		class  errclass.Class
		reason string
	}{
		{"missing key file", func(h *Host) { h.KeyFile = f.dir + "/nope" }, false, stageSSHMaterial, errclass.Transient, provisioner.ReasonSSHMaterialUnavailable},
		{"unparseable key", func(h *Host) { h.KeyFile = garbage }, false, stageSSHMaterial, errclass.Permanent, provisioner.ReasonSSHMaterialUnavailable},
		{"missing known_hosts", func(h *Host) { h.KnownHostsFile = f.dir + "/nope" }, false, stageSSHMaterial, errclass.Transient, provisioner.ReasonSSHMaterialUnavailable},
		{"connection refused", func(h *Host) { h.Address = closed }, false, stageTCP, errclass.Transient, provisioner.ReasonUnreachable},
		{"host key changed", func(h *Host) { h.KnownHostsFile = f.wrongKnownHosts }, false, stageSSHHandshake, errclass.Permanent, provisioner.ReasonSSHHandshakeFailed},
		{"key not authorised", func(h *Host) { h.KeyFile = f.otherKey }, false, stageSSHHandshake, errclass.Permanent, provisioner.ReasonSSHHandshakeFailed},
		{"forward rejected", func(*Host) {}, true, stageLibvirtConnect, errclass.Transient, provisioner.ReasonLibvirtConnectFailed},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := f.host()
			tc.mod(&h)
			f.srv.rejectForward.Store(tc.reject)
			defer f.srv.rejectForward.Store(false)
			d := newSSHDialer(false, time.Minute, slog.New(slog.DiscardHandler))
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			c, err := d.dial(ctx, h)
			if err == nil {
				c.close()
				t.Fatal("dial succeeded")
			}
			var de *dialError
			if !errors.As(err, &de) || de.stage != tc.stage {
				t.Fatalf("dial = %v, want stage %s", err, tc.stage)
			}
			if got := errclass.Of(classify(err)); got != tc.class {
				t.Errorf("class = %v, want %v (%v)", got, tc.class, err)
			}
			if got := checkReason(err); got != tc.reason {
				t.Errorf("reason = %s, want %s", got, tc.reason)
			}
		})
	}
}

// A key file that appears after start heals the host without a restart.
func TestSSHMaterialLoadsLazily(t *testing.T) {
	t.Parallel()
	f := newSSHFixture(t)
	h := f.host()
	h.KeyFile = filepath.Join(f.dir, "later")
	d := newSSHDialer(false, time.Minute, slog.New(slog.DiscardHandler))
	if _, err := d.dial(context.Background(), h); !errclass.Is(classify(err), errclass.Transient) {
		t.Fatalf("dial without the key = %v, want Transient", err)
	}
	key, _ := os.ReadFile(f.key)
	write(t, f.dir, "later", string(key))
	c, err := d.dial(context.Background(), h)
	if err != nil {
		t.Fatalf("dial once the key exists = %v", err)
	}
	c.close()
}

// An unanswered keepalive drops the connection; the pool redials.
func TestSSHKeepaliveDropsADeadLink(t *testing.T) {
	t.Parallel()
	f := newSSHFixture(t)
	d := newSSHDialer(false, 50*time.Millisecond, slog.New(slog.DiscardHandler))
	p := newHostPool(d.dial, 4, slog.New(slog.DiscardHandler), nil)
	defer p.close()
	if err := p.call(context.Background(), f.host(), func(api libvirtAPI) error { _, err := api.ConnectGetHostname(); return err }); err != nil {
		t.Fatal(err)
	}
	c := p.entry("h1").client
	f.srv.muteKeepalive.Store(true)
	select {
	case <-c.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the connection outlived unanswered keepalives")
	}
	f.srv.muteKeepalive.Store(false)
	if err := p.call(context.Background(), f.host(), func(api libvirtAPI) error { _, err := api.ConnectGetHostname(); return err }); err != nil {
		t.Fatalf("call after the drop = %v, want a redial", err)
	}
	if f.srv.keepalives.Load() == 0 {
		t.Error("no keepalive reached the server")
	}
}

// insecureIgnoreHostKey dials without known_hosts and says so at start.
func TestInsecureIgnoreHostKey(t *testing.T) {
	t.Parallel()
	f := newSSHFixture(t)
	h := f.host()
	h.KnownHostsFile = ""
	h.Pool = "egress-no-such-pool"
	var logs logtest.Buffer
	be, err := New("kvm-test", Config{
		Hosts:                 []Host{h},
		Images:                map[string]Image{"x": {URL: "http://127.0.0.1:1/x.qcow2"}},
		MachineTypes:          map[string]MachineType{"s": {VCPUs: 1, MemoryMiB: 64}},
		InsecureIgnoreHostKey: true,
	}.withBridge(), slog.New(slog.NewJSONHandler(&logs, nil)), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	if !strings.Contains(logs.String(), "WARNING: insecureIgnoreHostKey is set") {
		t.Errorf("no WARNING at start:\n%s", logs.String())
	}
	// Past SSH and into libvirt, which knows no such pool.
	if got := be.Check(context.Background()); got[0].GetReason() != provisioner.ReasonPoolNotFound {
		t.Fatalf("Check = %v, want PoolNotFound from libvirt", got[0])
	}
}

func (c Config) withBridge() Config {
	for i := range c.Hosts {
		c.Hosts[i].Bridge = "br0"
	}
	return c
}
