// Package libvirttest gives a test a real libvirt host reached the way the
// KVM backend reaches one: the machine's libvirtd (started by
// scripts/ensure-libvirt.sh) behind an sshd of the test's own on a loopback
// port, for a non-root user in the libvirt group with its own key and
// known_hosts. Each Env has its own storage pool in a temporary directory,
// its own bridge, a console log directory and a tiny qcow2 image served
// over HTTP. On request it also serves a bootable guest
// (scripts/kvm-guest-image.sh) and runs a DHCP server on the bridge
// (guest.go). Nothing is shared between tests but the daemon and the
// cached guest image.
//
// The tests need root (to run sshd, create the user and the bridge). When
// something is missing they fail, saying what to install; they never skip.
package libvirttest

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// User is the non-root account the tests' sshd lets in; it is created
// (in the libvirt group, with no password and /bin/sh: the backend runs
// one command over SSH, and authorized_keys allows only that) when missing.
const User = "egress-kvm-test"

// Socket is libvirtd's read-write socket.
const Socket = "/var/run/libvirt/libvirt-sock"

const installHint = "install and start libvirt: run scripts/ensure-libvirt.sh as root " +
	"(apt-get install libvirt-daemon-system qemu-system-x86 qemu-utils openssh-server ovmf, and for the bootable guest " +
	"linux-image-cloud-amd64 busybox-static syslinux mtools cpio kmod dnsmasq-base; virtlogd -d; libvirtd -d -f <config with auth_unix_rw = \"none\">)"

// Env is one test's libvirt host.
type Env struct {
	Dir string
	// SSHAddress is the test's sshd, 127.0.0.1:<port>.
	SSHAddress string
	User       string
	// KeyFile is authorised for User; OtherKeyFile is a valid key that is
	// not. KnownHostsFile holds the sshd's host key, WrongKnownHostsFile
	// another key for the same address.
	KeyFile, OtherKeyFile               string
	KnownHostsFile, WrongKnownHostsFile string
	Socket                              string
	// Pool is a running dir pool in PoolDir.
	Pool, PoolDir string
	Bridge        string
	ConsoleDir    string
	// ImageURL serves a 16 MiB qcow2 made with qemu-img; ImageSHA256 is its
	// digest. ImageHits counts its downloads.
	ImageURL, ImageSHA256 string

	mu        sync.Mutex
	imageHits int
	leaseFile string
	t         testing.TB
}

// Require fails t, naming what to install, unless the tools and a
// libvirtd answering on Socket are there.
func Require(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatalf("libvirttest: the KVM integration tests run as root (they start sshd, add a user and a bridge); %s", installHint)
	}
	for _, bin := range []string{"virsh", "qemu-img", "qemu-system-x86_64", "/usr/sbin/sshd", "ssh-keygen", "ip"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("libvirttest: %s is missing: %s", bin, installHint)
		}
	}
	if out, err := exec.Command("virsh", "-c", "qemu:///system", "version").CombinedOutput(); err != nil {
		t.Fatalf("libvirttest: libvirtd does not answer on %s (%v: %s): %s", Socket, err, strings.TrimSpace(string(out)), installHint)
	}
}

// New sets up a host for t; everything is removed when t ends.
func New(t testing.TB) *Env {
	t.Helper()
	Require(t)
	e := &Env{t: t, User: User, Socket: Socket}
	e.Dir = t.TempDir()
	// libvirt runs QEMU as its own user, which must reach the pool and
	// console directories.
	chmodPath(t, e.Dir)
	suffix := randHex(4)
	e.ensureUser()
	e.startSSHD()
	e.Bridge = "egk" + suffix
	run(t, "ip", "link", "add", e.Bridge, "type", "bridge")
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", e.Bridge).Run() })
	run(t, "ip", "link", "set", e.Bridge, "up")
	e.Pool = "egress-test-" + suffix
	e.PoolDir = filepath.Join(e.Dir, "pool")
	e.DefinePool(e.Pool, e.PoolDir, true)
	e.ConsoleDir = filepath.Join(e.Dir, "console")
	mkdir(t, e.ConsoleDir)
	e.serveImage()
	return e
}

func chmodPath(t testing.TB, dir string) {
	for d := dir; d != "/" && d != "."; d = filepath.Dir(d) {
		st, err := os.Stat(d)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm()&0o005 != 0o005 {
			if err := os.Chmod(d, st.Mode().Perm()|0o005); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func mkdir(t testing.TB, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func run(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// Virsh runs virsh against the system libvirtd as root.
func (e *Env) Virsh(args ...string) string {
	e.t.Helper()
	return run(e.t, "virsh", append([]string{"-q", "-c", "qemu:///system"}, args...)...)
}

// VirshErr is Virsh returning the error instead of failing.
func (e *Env) VirshErr(args ...string) (string, error) {
	out, err := exec.Command("virsh", append([]string{"-q", "-c", "qemu:///system"}, args...)...).CombinedOutput()
	return string(out), err
}

var userOnce sync.Mutex

func (e *Env) ensureUser() {
	userOnce.Lock()
	defer userOnce.Unlock()
	// The account needs a shell: the backend reads the host's neighbour
	// table with a command over SSH.
	if exec.Command("id", "-u", User).Run() != nil {
		run(e.t, "useradd", "--system", "--no-create-home", "--shell", "/bin/sh", "--groups", "libvirt", User)
	}
	// A "!" password is a locked account to sshd without PAM; "*" is not.
	run(e.t, "usermod", "-p", "*", "-s", "/bin/sh", "-a", "-G", "libvirt", User)
}

func (e *Env) keygen(name string) string {
	p := filepath.Join(e.Dir, name)
	run(e.t, "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", p)
	return p
}

func readFile(t testing.TB, p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func writeFile(t testing.TB, p, body string, mode os.FileMode) {
	if err := os.WriteFile(p, []byte(body), mode); err != nil {
		t.Fatal(err)
	}
}

// startSSHD runs sshd on a free loopback port with a config, host key and
// authorized_keys of the test's own.
func (e *Env) startSSHD() {
	t := e.t
	mkdir(t, "/run/sshd")
	hostKey := e.keygen("ssh_host_ed25519_key")
	otherHostKey := e.keygen("other_host_key")
	e.KeyFile = e.keygen("id_ed25519")
	e.OtherKeyFile = e.keygen("id_other")
	auth := filepath.Join(e.Dir, "authorized_keys")
	// The provisioner needs port forwarding (the libvirt socket) and one
	// command (the neighbour table), nothing else.
	writeFile(t, auth, `restrict,port-forwarding,command="ip -j -4 neigh show" `+readFile(t, e.KeyFile+".pub")+"\n", 0o644)
	for attempt := 0; ; attempt++ {
		port := freePort(t)
		e.SSHAddress = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		cfg := filepath.Join(e.Dir, "sshd_config")
		writeFile(t, cfg, strings.Join([]string{
			"ListenAddress " + e.SSHAddress,
			"HostKey " + hostKey,
			"PidFile none",
			"UsePAM no",
			"StrictModes no",
			"PasswordAuthentication no",
			"KbdInteractiveAuthentication no",
			"PubkeyAuthentication yes",
			"AuthorizedKeysFile " + auth,
			"AllowUsers " + User,
			"AllowStreamLocalForwarding yes",
			// sshd only opens stream-local forwards when TCP forwarding is
			// allowed too (AllowTcpForwarding no denies both).
			"AllowTcpForwarding local",
			"X11Forwarding no",
			"PermitTTY no",
			"LogLevel VERBOSE",
		}, "\n")+"\n", 0o644)
		logFile := filepath.Join(e.Dir, "sshd.log")
		exited := e.startDaemon("sshd", logFile, "/usr/sbin/sshd", "-D", "-e", "-f", cfg)
		if waitListening(e.SSHAddress, exited, 10*time.Second) {
			break
		}
		if attempt == 3 {
			t.Fatalf("sshd does not listen on %s: %s", e.SSHAddress, readFile(t, logFile))
		}
	}
	host := "[127.0.0.1]:" + strings.TrimPrefix(e.SSHAddress, "127.0.0.1:")
	pub := strings.Fields(readFile(t, hostKey+".pub"))
	e.KnownHostsFile = filepath.Join(e.Dir, "known_hosts")
	writeFile(t, e.KnownHostsFile, host+" "+pub[0]+" "+pub[1]+"\n", 0o644)
	other := strings.Fields(readFile(t, otherHostKey+".pub"))
	e.WrongKnownHostsFile = filepath.Join(e.Dir, "known_hosts_wrong")
	writeFile(t, e.WrongKnownHostsFile, host+" "+other[0]+" "+other[1]+"\n", 0o644)
}

// startDaemon runs a daemon in the foreground with its output in
// logFile, kills it when the test ends (showing the log if the test
// failed) and returns a channel closed when it exits.
func (e *Env) startDaemon(what, logFile, name string, args ...string) <-chan struct{} {
	t := e.t
	t.Helper()
	log, err := os.Create(logFile)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", what, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		_ = log.Close()
		if t.Failed() {
			b, _ := os.ReadFile(logFile)
			t.Logf("%s log:\n%s", what, b)
		}
	})
	return exited
}

func freePort(t testing.TB) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port
}

// ClosedAddress is a loopback address nothing listens on.
func (e *Env) ClosedAddress() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(freePort(e.t)))
}

func waitListening(addr string, exited <-chan struct{}, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			return false
		default:
		}
		if c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond); err == nil {
			_ = c.Close()
			return true
		}
		time.Sleep(20 * time.Millisecond) // polling a port that is not bound yet
	}
	return false
}

// DefinePool defines a dir pool at dir, started when active; it is
// destroyed and undefined when the test ends.
func (e *Env) DefinePool(name, dir string, active bool) {
	mkdir(e.t, dir)
	chmodPath(e.t, dir)
	e.Virsh("pool-define-as", name, "dir", "--target", dir)
	e.t.Cleanup(func() {
		_, _ = e.VirshErr("pool-destroy", name)
		_, _ = e.VirshErr("pool-undefine", name)
	})
	if active {
		e.Virsh("pool-start", name)
	}
}

// Volumes lists the pool's volumes (after a refresh, so files are seen as
// they are).
func (e *Env) Volumes() []string {
	e.Virsh("pool-refresh", e.Pool)
	var out []string
	for _, l := range strings.Split(e.Virsh("vol-list", e.Pool), "\n") {
		if f := strings.Fields(l); len(f) > 0 {
			out = append(out, f[0])
		}
	}
	return out
}

// DomainState is virsh's state of a domain, "" when it does not exist.
func (e *Env) DomainState(name string) string {
	out, err := e.VirshErr("domstate", name)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(out)
}

// DomainXML is the domain's live XML.
func (e *Env) DomainXML(name string) string { return e.Virsh("dumpxml", name) }

// RemoveDomain destroys and undefines a domain if it exists; tests
// register it with t.Cleanup for what they create.
func (e *Env) RemoveDomain(name string) {
	_, _ = e.VirshErr("destroy", name)
	_, _ = e.VirshErr("undefine", "--nvram", name)
}

// serveImage makes a 16 MiB qcow2 (a few hundred KiB on the wire) and
// serves it.
func (e *Env) serveImage() {
	e.ImageURL, e.ImageSHA256 = e.ServeImage("tiny.qcow2", 16)
}

// ServeImage makes an empty qcow2 of sizeMiB (images of different sizes
// differ in content, hence in digest) and serves it at /name; its
// downloads count in ImageHits.
func (e *Env) ServeImage(name string, sizeMiB int) (url, sha256Hex string) {
	p := filepath.Join(e.Dir, name)
	run(e.t, "qemu-img", "create", "-q", "-f", "qcow2", p, strconv.Itoa(sizeMiB)+"M")
	body, err := os.ReadFile(p)
	if err != nil {
		e.t.Fatal(err)
	}
	sum := sha256.Sum256(body)
	return e.serve(name, body), hex.EncodeToString(sum[:])
}

// ImageHits is how often the image was downloaded.
func (e *Env) ImageHits() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.imageHits
}

// String describes the env for failure messages.
func (e *Env) String() string {
	return fmt.Sprintf("sshd %s user %s pool %s (%s) bridge %s", e.SSHAddress, e.User, e.Pool, e.PoolDir, e.Bridge)
}
