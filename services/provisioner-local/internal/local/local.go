// Package local is the backend that runs proxies on this machine, for local
// runs and end-to-end tests. An instance is a real forward proxy process —
// Debian's squid when installed, otherwise the built-in Go proxy (this
// binary's `forward-proxy` subcommand) — listening on the proxy's port at a
// loopback address of its own (127.0.0.0/8 is all loopback on Linux), so
// every instance has its own IP like a VM and listens on spec.port.
//
// Instances live in the state directory, one directory per proxy UID with
// an instance.json; that file is the instance's mark. Proxy processes run
// in their own session, so they outlive the provisioner as VMs outlive
// theirs; a provisioner that starts again finds them there, and starts a
// proxy whose process died when the instance is next read.
package local

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/crashpoint"
	"github.com/egress-proxies/egress-proxies/pkg/squid"
)

// Config is the `local:` block of a provider.
type Config struct {
	// StateDir holds the instances. Default: <tmp>/egress-local-<provider>.
	StateDir string `yaml:"stateDir"`
	// Network is the loopback prefix instance addresses come from.
	// Default 127.77.0.0/16.
	Network string `yaml:"network"`
	// Proxy is squid, builtin, or auto (squid when installed). Default auto.
	Proxy string `yaml:"proxy"`
	// SquidPath is the squid binary. Default: squid on PATH or /usr/sbin/squid.
	SquidPath string `yaml:"squidPath"`
	// StartTimeout bounds how long a new proxy may take to listen. Default 30s.
	StartTimeout time.Duration `yaml:"startTimeout"`
}

// Backend implements provisioner.Backend on this machine.
type Backend struct {
	provider string
	dir      string
	network  netip.Prefix
	kind     string // squid or builtin
	squid    string
	// ncsaAuth is squid's basic_ncsa_auth helper; empty when not found.
	ncsaAuth string
	self     string // this binary, for the builtin proxy
	timeout  time.Duration
	log      *slog.Logger

	// stopping holds the PIDs Delete is stopping, so that their exit is
	// not reported as a crash.
	stopping sync.Map
}

// FromProvider builds the backend from its provider block.
func FromProvider(p providers.Provider, log *slog.Logger) (*Backend, error) {
	var c Config
	if err := p.DecodeBackend(&c); err != nil {
		return nil, err
	}
	// log carries provider already: the runtime adds it.
	b := &Backend{provider: p.Name, log: log, timeout: c.StartTimeout}
	if b.timeout <= 0 {
		b.timeout = 30 * time.Second
	}
	b.dir = c.StateDir
	if b.dir == "" {
		b.dir = filepath.Join(os.TempDir(), "egress-local-"+p.Name)
	}
	dir, err := filepath.Abs(b.dir)
	if err != nil {
		return nil, err
	}
	b.dir = dir
	network := c.Network
	if network == "" {
		network = "127.77.0.0/16"
	}
	if b.network, err = netip.ParsePrefix(network); err != nil || !b.network.Addr().Is4() || !b.network.Addr().IsLoopback() || b.network.Bits() > 24 {
		return nil, fmt.Errorf("%s.local.network: %q must be an IPv4 loopback prefix of /24 or wider", p.Path, network)
	}
	b.network = b.network.Masked()
	squid := c.SquidPath
	if squid == "" {
		if path, err := exec.LookPath("squid"); err == nil {
			squid = path
		} else if _, err := os.Stat("/usr/sbin/squid"); err == nil {
			squid = "/usr/sbin/squid"
		}
	}
	switch c.Proxy {
	case "", "auto":
		b.kind = "builtin"
		if squid != "" {
			b.kind, b.squid = "squid", squid
		}
	case "squid":
		if squid == "" {
			return nil, fmt.Errorf("%s.local.proxy: squid is not installed (apt-get install squid) and squidPath is not set", p.Path)
		}
		b.kind, b.squid = "squid", squid
	case "builtin":
		b.kind = "builtin"
	default:
		return nil, fmt.Errorf("%s.local.proxy: %q is not squid, builtin or auto", p.Path, c.Proxy)
	}
	for _, p := range []string{"/usr/lib/squid/basic_ncsa_auth", "/usr/lib64/squid/basic_ncsa_auth", "/usr/libexec/squid/basic_ncsa_auth"} {
		if _, err := os.Stat(p); err == nil {
			b.ncsaAuth = p
			break
		}
	}
	if b.self, err = os.Executable(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(b.dir, 0o755); err != nil {
		return nil, fmt.Errorf("%s.local.stateDir: %w", p.Path, err)
	}
	b.log.Info("local backend ready", "stateDir", b.dir, "proxy", b.kind, "network", b.network.String())
	return b, nil
}

// state is an instance's record: its mark.
type state struct {
	UID       string    `json:"uid"`
	Name      string    `json:"name"`
	ProxyName string    `json:"proxyName"`
	Address   string    `json:"address"`
	Port      uint32    `json:"port"`
	Kind      string    `json:"kind"`
	CreatedAt time.Time `json:"createdAt"`
	PID       int       `json:"pid"`
	// Auth means the proxy demands the credentials in the instance's
	// htpasswd file (squid's basic_ncsa_auth).
	Auth bool `json:"auth,omitempty"`
	// Installation is the installation (pkg/installation) the instance is
	// for; records written before installations have none.
	Installation string `json:"installation,omitempty"`
}

// foreignInstallation reports whether the record names an installation
// other than installation: another installation's instance, left alone.
func (s *state) foreignInstallation(installation string) bool {
	return s.Installation != "" && s.Installation != installation
}

// claim writes installation into uid's record when it names none (written
// before records did), so that it is this installation's from now on.
func (b *Backend) claim(s *state, installation string) error {
	if installation == "" || s.Installation != "" {
		return nil
	}
	unlock, err := b.lock()
	if err != nil {
		return err
	}
	defer unlock()
	s.Installation = installation
	if err := b.write(s); err != nil {
		return err
	}
	b.log.Info("local instance recorded before installations claimed for this installation", "provider_id", providerID(s.UID), "installation", installation)
	return nil
}

func providerID(uid string) string { return "instances/" + uid }

func (b *Backend) instDir(uid string) string { return filepath.Join(b.dir, uid) }

// read returns uid's record: NotFound when there is none, or when the
// directory of that name holds another proxy's.
func (b *Backend) read(uid string) (*state, error) {
	raw, err := os.ReadFile(filepath.Join(b.instDir(uid), "instance.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, errclass.New(errclass.NotFound, "instance %s does not exist", providerID(uid))
	}
	if err != nil {
		return nil, errclass.Wrap(errclass.Transient, err)
	}
	var s state
	if err := json.Unmarshal(raw, &s); err != nil {
		return nil, errclass.New(errclass.Permanent, "instance %s has an unreadable record: %v", providerID(uid), err)
	}
	if s.UID != uid {
		return nil, errclass.New(errclass.NotFound, "the directory of instance %s holds the record of proxy %s", providerID(uid), s.UID)
	}
	return &s, nil
}

// foreign reports whether uid's directory exists without being uid's
// instance: no provisioner made it (allocate makes it whole, record
// included, in one rename).
func (b *Backend) foreign(uid string) bool {
	_, err := os.Lstat(b.instDir(uid))
	return err == nil
}

func (b *Backend) write(s *state) error {
	raw, _ := json.MarshalIndent(s, "", "  ")
	tmp := filepath.Join(b.instDir(s.UID), "instance.json.tmp")
	if err := os.WriteFile(tmp, raw, 0o644); err != nil {
		return errclass.Wrap(errclass.Transient, err)
	}
	return errclass.Wrap(errclass.Transient, os.Rename(tmp, filepath.Join(b.instDir(s.UID), "instance.json")))
}

// uidFromProviderID checks the providerID and that it is the proxy's.
func uidFromProviderID(pid, proxyUID string) (string, error) {
	uid, ok := strings.CutPrefix(pid, "instances/")
	if !ok || uid == "" || strings.ContainsAny(uid, "/.") {
		return "", errclass.New(errclass.Permanent, "providerID %q is not instances/<uid>", pid)
	}
	if proxyUID != "" && uid != proxyUID {
		return "", errclass.New(errclass.NotFound, "instance %s belongs to proxy %s, not %s", pid, uid, proxyUID)
	}
	return uid, nil
}

func (b *Backend) instance(s *state, st provisionerv1.InstanceState) *provisionerv1.Instance {
	return &provisionerv1.Instance{
		ProviderId:   providerID(s.UID),
		ProxyUid:     s.UID,
		Name:         s.Name,
		Installation: s.Installation,
		State:        st,
		Ip:           s.Address,
		CreateTime:   timestamppb.New(s.CreatedAt),
		Details: map[string]string{
			"proxy": s.Kind, "port": strconv.Itoa(int(s.Port)), "pid": strconv.Itoa(s.PID),
		},
	}
}

// Create implements provisioner.Backend: idempotent per proxy UID.
func (b *Backend) Create(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.Instance, error) {
	uid := req.GetProxyUid()
	if uid == "" || strings.ContainsAny(uid, "/.") {
		return nil, errclass.New(errclass.Permanent, "proxy UID %q is not usable", uid)
	}
	port := req.GetPort()
	if port == 0 || port > 65535 {
		return nil, errclass.New(errclass.Permanent, "port %d is not a TCP port", port)
	}
	unlock, err := b.lock()
	if err != nil {
		return nil, err
	}
	s, err := b.read(uid)
	switch {
	case errclass.Is(err, errclass.NotFound) && b.foreign(uid):
		err = errclass.New(errclass.Permanent, "%s exists and is not an instance of this provisioner (no record of proxy %s in it); it was left untouched, remove it",
			b.instDir(uid), uid).WithMetadata("path", b.instDir(uid))
	case errclass.Is(err, errclass.NotFound):
		s, err = b.allocate(uid, req.GetInstallation(), req.GetProxyName(), port)
	case err == nil && s.foreignInstallation(req.GetInstallation()):
		err = errclass.New(errclass.Permanent, "instance %s is installation %s's, not %s: two installations hold proxy UID %s (a copied database?); it was left untouched",
			providerID(uid), s.Installation, req.GetInstallation(), uid)
	}
	if err == nil {
		err = b.setCredentials(s, req.GetCredentials())
	}
	unlock()
	if err != nil {
		return nil, err
	}
	if err := b.claim(s, req.GetInstallation()); err != nil {
		return nil, err
	}
	crashpoint.After(ctx, "local.recorded")
	if err := b.ensureRunning(ctx, s); err != nil {
		return nil, err
	}
	return b.instance(s, provisionerv1.InstanceState_INSTANCE_STATE_RUNNING), nil
}

// allocate picks the instance's address (from the UID's hash, probing on
// from a taken one) and records it. Called under the state lock.
func (b *Backend) allocate(uid, installation, proxyName string, port uint32) (*state, error) {
	taken := map[string]bool{}
	all, err := b.all()
	if err != nil {
		return nil, err
	}
	for _, s := range all {
		taken[s.Address] = true
	}
	size := uint32(1) << (32 - b.network.Bits())
	base := binary.BigEndian.Uint32(b.network.Addr().AsSlice())
	h := fnv.New32a()
	_, _ = h.Write([]byte(uid))
	start := h.Sum32()
	for i := uint32(0); i < size; i++ {
		host := (start + i) % size
		if host == 0 || host == size-1 {
			continue // network and broadcast-style addresses
		}
		var ip [4]byte
		binary.BigEndian.PutUint32(ip[:], base+host)
		addr := netip.AddrFrom4(ip).String()
		if taken[addr] || !free(addr, port) {
			continue
		}
		s := &state{UID: uid, Name: "proxy-" + uid, ProxyName: proxyName, Address: addr, Port: port, Kind: b.kind,
			CreatedAt: time.Now().UTC().Truncate(time.Second), Installation: installation}
		if err := b.makeDir(s); err != nil {
			return nil, err
		}
		return s, nil
	}
	return nil, errclass.New(errclass.QuotaExceeded, "no free address in %s for port %d", b.network, port)
}

// makeDir makes s's directory with its record in it, in one rename: a
// directory of that name without a record is never ours. What a crash
// before the rename left of an earlier attempt is removed first.
func (b *Backend) makeDir(s *state) error {
	prefix := ".new-" + s.UID + "-"
	if stale, err := filepath.Glob(filepath.Join(b.dir, prefix+"*")); err == nil {
		for _, d := range stale {
			_ = os.RemoveAll(d)
		}
	}
	tmp, err := os.MkdirTemp(b.dir, prefix)
	if err != nil {
		return errclass.Wrap(errclass.Transient, err)
	}
	// squid started as root drops privileges and writes here.
	_ = os.Chmod(tmp, 0o777)
	raw, _ := json.MarshalIndent(s, "", "  ")
	if err := os.WriteFile(filepath.Join(tmp, "instance.json"), raw, 0o644); err != nil {
		_ = os.RemoveAll(tmp)
		return errclass.Wrap(errclass.Transient, err)
	}
	if err := os.Rename(tmp, b.instDir(s.UID)); err != nil {
		_ = os.RemoveAll(tmp)
		return errclass.Wrap(errclass.Transient, err)
	}
	return nil
}

func free(addr string, port uint32) bool {
	l, err := net.Listen("tcp", net.JoinHostPort(addr, strconv.Itoa(int(port))))
	if err != nil {
		return false
	}
	_ = l.Close()
	return true
}

// lock serialises allocations across provisioner replicas sharing the
// state directory.
func (b *Backend) lock() (func(), error) {
	f, err := os.OpenFile(filepath.Join(b.dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, errclass.Wrap(errclass.Transient, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, errclass.Wrap(errclass.Transient, err)
	}
	return func() {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		f.Close()
	}, nil
}

// alive reports whether s's proxy process runs: the PID exists and its
// arguments name the instance directory (so a reused PID is not taken for
// ours).
func (b *Backend) alive(s *state) bool {
	return !gone(s.PID) && b.serves(s.PID, s.UID)
}

// serves reports whether pid's arguments are those of uid's proxy: the
// built-in one's --instance-dir, or squid's -f of the instance's config.
func (b *Backend) serves(pid int, uid string) bool {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	dir := b.instDir(uid)
	args := strings.Split(strings.TrimRight(string(raw), "\x00"), "\x00")
	for i := 0; i+1 < len(args); i++ {
		if (args[i] == "--instance-dir" && args[i+1] == dir) || (args[i] == "-f" && args[i+1] == filepath.Join(dir, "squid.conf")) {
			return true
		}
	}
	return false
}

// orphan finds a live proxy process of uid that its record does not name:
// one started by a provisioner that crashed before recording its PID.
func (b *Backend) orphan(uid string) int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil && !gone(pid) && b.serves(pid, uid) {
			return pid
		}
	}
	return 0
}

// gone reports whether pid has exited: no such process, or a zombie.
func gone(pid int) bool {
	if pid <= 0 || syscall.Kill(pid, 0) != nil {
		return true
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	return err != nil || strings.Contains(string(stat), ") Z ")
}

// waitExit waits until s's process has exited and its address is free
// again. A killed multi-threaded process shows as a zombie (or with an
// empty command line) while its other threads still hold its sockets: a
// proxy started then could not bind, while the dying socket still accepted
// connections. So the address itself is the test.
func (b *Backend) waitExit(ctx context.Context, s *state) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		ours := false
		if !gone(s.PID) {
			cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", s.PID))
			ours = err != nil || len(cmdline) == 0 || strings.Contains(string(cmdline), b.instDir(s.UID))
		}
		if !ours && free(s.Address, s.Port) {
			return nil
		}
		if time.Now().After(deadline) {
			return errclass.New(errclass.Transient, "the old proxy of %s still holds %s:%d after 10s", providerID(s.UID), s.Address, s.Port)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// ensureRunning starts the proxy process unless it runs, and waits until it
// accepts connections.
func (b *Backend) ensureRunning(ctx context.Context, s *state) error {
	addr := net.JoinHostPort(s.Address, strconv.Itoa(int(s.Port)))
	alive := func() bool { return b.alive(s) }
	if alive() {
		return b.waitListening(ctx, s, addr, alive)
	}
	if pid := b.orphan(s.UID); pid != 0 {
		s.PID = pid
		if err := b.write(s); err != nil {
			return err
		}
		b.log.Info("local proxy adopted", "name", s.Name, "provider_id", providerID(s.UID), "pid", pid)
		err := b.waitListening(ctx, s, addr, alive)
		if err == nil || alive() || ctx.Err() != nil {
			return err
		}
		// It ended without listening: not the proxy but a child it forked
		// a moment before it died (a helper, between its fork and its
		// exec, carries the proxy's command line). Start the proxy.
		b.log.Info("local proxy adopted by mistake: it ended before listening; starting one", "name", s.Name,
			"provider_id", providerID(s.UID), "pid", pid)
	}
	if err := b.waitExit(ctx, s); err != nil {
		return err
	}
	dir := b.instDir(s.UID)
	logf, err := os.OpenFile(filepath.Join(dir, "proxy.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return errclass.Wrap(errclass.Transient, err)
	}
	defer logf.Close()
	var cmd *exec.Cmd
	switch s.Kind {
	case "squid":
		conf := filepath.Join(dir, "squid.conf")
		if err := os.WriteFile(conf, []byte(squidConf(s, dir, b.ncsaAuth)), 0o644); err != nil {
			return errclass.Wrap(errclass.Transient, err)
		}
		// A service name per instance: squids of one name collide in
		// /dev/shm; one killed left its segments (it is not running now).
		name := squid.ServiceName(s.UID)
		squid.RemoveStaleSegments(name)
		cmd = exec.Command(b.squid, "-N", "-n", name, "-f", conf)
	default:
		cmd = exec.Command(b.self, "forward-proxy", "--listen", addr, "--instance-dir", dir)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Dir = dir
	// Its own session: the proxy outlives the provisioner, like a VM.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return errclass.New(errclass.Transient, "starting the %s proxy: %v", s.Kind, err)
	}
	crashpoint.After(ctx, "local.started")
	exited := make(chan struct{})
	var exitErr error
	go func() { // reap it, and say so if it dies while we run
		exitErr = cmd.Wait()
		close(exited)
		pid := cmd.Process.Pid
		if _, asked := b.stopping.LoadAndDelete(pid); asked {
			b.log.Info("local proxy stopped", "name", s.Name, "provider_id", providerID(s.UID), "pid", pid)
			return
		}
		b.log.Warn("WARNING: local proxy exited on its own; the next Get starts it again", "name", s.Name, "provider_id", providerID(s.UID),
			"pid", pid, "exit", exitDescription(exitErr))
	}()
	s.PID = cmd.Process.Pid
	if err := b.write(s); err != nil {
		return err
	}
	b.log.Info("local proxy started", "name", s.Name, "provider_id", providerID(s.UID), "address", addr, "proxy", s.Kind, "pid", s.PID)
	// Our own child has exited when its waiter says so; /proc is only for
	// processes another provisioner started.
	running := func() bool {
		select {
		case <-exited:
			return false
		default:
			return true
		}
	}
	err = b.waitListening(ctx, s, addr, running)
	if err != nil && !errors.Is(err, context.Canceled) {
		// Its exit, if it has exited, is part of the reason; the process
		// may be gone a moment before its waiter has reaped it.
		select {
		case <-exited:
			err = errclass.New(errclass.Transient, "%v (%s)", err, exitDescription(exitErr))
		case <-time.After(2 * time.Second):
		}
	}
	return err
}

// exitDescription says how a proxy process ended: "exit status 1",
// "signal: killed", or "exit status 0" for a clean exit.
func exitDescription(err error) string {
	if err == nil {
		return "exit status 0"
	}
	return err.Error()
}

// startFailure is why a proxy exited before listening: the end of its
// output and, for squid, of its cache.log, where squid writes its FATAL
// lines once cache_log is set.
func (b *Backend) startFailure(s *state) string {
	dir := b.instDir(s.UID)
	var parts []string
	if out, _ := os.ReadFile(filepath.Join(dir, "proxy.log")); len(strings.TrimSpace(string(out))) > 0 {
		parts = append(parts, tail(string(out), 400))
	}
	if s.Kind == "squid" {
		if cl, _ := os.ReadFile(filepath.Join(dir, "cache.log")); len(strings.TrimSpace(string(cl))) > 0 {
			parts = append(parts, "cache.log: "+tail(squidErrors(string(cl)), 400))
		}
	}
	if len(parts) == 0 {
		return "it wrote nothing"
	}
	return strings.Join(parts, "; ")
}

// squidErrors keeps the lines of a cache.log that say what went wrong
// (squid goes on logging after its FATAL line: usage figures, its
// helpers); all of it when none does.
func squidErrors(log string) string {
	var keep []string
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, "FATAL") || strings.Contains(line, "ERROR") || strings.Contains(line, "Cannot") || strings.Contains(line, "cannot") {
			keep = append(keep, strings.TrimSpace(line))
		}
	}
	if len(keep) == 0 {
		return log
	}
	return strings.Join(keep, " | ")
}

// waitListening waits until addr accepts connections while running says
// s's process runs.
func (b *Backend) waitListening(ctx context.Context, s *state, addr string, running func() bool) error {
	ctx, cancel := context.WithTimeout(ctx, b.timeout)
	defer cancel()
	for {
		c, err := (&net.Dialer{Timeout: time.Second}).DialContext(ctx, "tcp", addr)
		if err == nil {
			_ = c.Close()
			return nil
		}
		if !running() {
			return errclass.New(errclass.Transient, "the %s proxy for %s exited before listening on %s: %s",
				s.Kind, providerID(s.UID), addr, b.startFailure(s))
		}
		select {
		case <-ctx.Done():
			return errclass.New(errclass.Transient, "the %s proxy for %s is not listening on %s after %s", s.Kind, providerID(s.UID), addr, b.timeout)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func tail(s string, n int) string {
	s = strings.TrimSpace(s)
	if len(s) > n {
		return "…" + s[len(s)-n:]
	}
	return s
}

// squidConf is an instance's squid.conf: open to the loopback network, or,
// for an instance with credentials, to those who present them (HTTP Basic
// Proxy-Authorization, checked by basic_ncsa_auth against the instance's
// htpasswd file). No pinger: a forward proxy without cache peers has no
// use for ICMP round trips, and squid forks it into a session of its own,
// so it outlived a kill of the proxy's process group.
func squidConf(s *state, dir, ncsaAuth string) string {
	access := "http_access allow localnet\n"
	if s.Auth {
		access = squid.BasicAuth(ncsaAuth, filepath.Join(dir, htpasswdFile)) +
			"http_access allow localnet " + squid.AuthACL + "\n"
	}
	return fmt.Sprintf(`http_port %s:%d
pid_filename %[3]s/squid.pid
cache_log %[3]s/cache.log
access_log %[3]s/access.log
cache_store_log none
coredump_dir %[3]s
pinger_enable off
cache deny all
max_filedescriptors 1024
visible_hostname %[4]s
shutdown_lifetime 0 seconds
acl localnet src 127.0.0.0/8
%[5]shttp_access deny all
`, s.Address, s.Port, dir, s.Name, access)
}

// Get implements provisioner.Backend. A record whose process died is
// started again: the instance exists; its proxy crashed.
func (b *Backend) Get(ctx context.Context, req *provisionerv1.GetInstanceRequest) (*provisionerv1.Instance, error) {
	uid, err := uidFromProviderID(req.GetProviderId(), req.GetProxyUid())
	if err != nil {
		return nil, err
	}
	s, err := b.read(uid)
	if err != nil {
		return nil, err
	}
	if s.foreignInstallation(req.GetInstallation()) {
		return nil, errclass.New(errclass.NotFound, "instance %s is installation %s's", req.GetProviderId(), s.Installation)
	}
	if req.GetProxyUid() != "" {
		if err := b.claim(s, req.GetInstallation()); err != nil {
			return nil, err
		}
	}
	if !b.alive(s) {
		b.log.Warn("local proxy process is gone; starting it again", "name", s.Name, "provider_id", providerID(uid))
		if err := b.ensureRunning(ctx, s); err != nil {
			return nil, err
		}
	}
	return b.instance(s, provisionerv1.InstanceState_INSTANCE_STATE_RUNNING), nil
}

// Delete implements provisioner.Backend.
func (b *Backend) Delete(ctx context.Context, req *provisionerv1.DeleteInstanceRequest) (bool, error) {
	uid, err := uidFromProviderID(req.GetProviderId(), req.GetProxyUid())
	if errclass.Is(err, errclass.NotFound) {
		return false, nil // another proxy's instance: left alone
	}
	if err != nil {
		return false, err
	}
	s, err := b.read(uid)
	if errclass.Is(err, errclass.NotFound) {
		return false, nil
	}
	if err != nil && !errclass.Is(err, errclass.Permanent) {
		return false, err
	}
	if s != nil && s.foreignInstallation(req.GetInstallation()) {
		b.log.Info("local instance is another installation's; left alone", "provider_id", providerID(uid), "installation", s.Installation)
		return false, nil
	}
	if s != nil {
		if err := b.stop(ctx, s); err != nil {
			return false, err
		}
	}
	if s != nil && s.Kind == "squid" {
		squid.RemoveStaleSegments(squid.ServiceName(uid)) // left if it was killed
	}
	if err := os.RemoveAll(b.instDir(uid)); err != nil {
		return false, errclass.Wrap(errclass.Transient, err)
	}
	b.log.Info("local instance deleted", "provider_id", providerID(uid))
	return true, nil
}

// stop ends the instance's proxy process, if it runs, and returns once its
// address is free again.
func (b *Backend) stop(ctx context.Context, s *state) error {
	if !b.alive(s) {
		return nil
	}
	b.stopping.Store(s.PID, struct{}{})
	_ = syscall.Kill(-s.PID, syscall.SIGTERM) // its whole session
	deadline := time.Now().Add(10 * time.Second)
	for b.alive(s) && time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	if b.alive(s) {
		_ = syscall.Kill(-s.PID, syscall.SIGKILL)
	}
	return b.waitExit(ctx, s)
}

// all reads every instance record; unreadable ones are skipped.
func (b *Backend) all() ([]*state, error) {
	entries, err := os.ReadDir(b.dir)
	if err != nil {
		return nil, errclass.Wrap(errclass.Transient, err)
	}
	var out []*state
	for _, e := range entries {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		s, err := b.read(e.Name())
		if err != nil {
			continue
		}
		out = append(out, s)
	}
	return out, nil
}

// List implements provisioner.Backend.
func (b *Backend) List(context.Context) ([]*provisionerv1.Instance, error) {
	all, err := b.all()
	if err != nil {
		return nil, err
	}
	out := make([]*provisionerv1.Instance, 0, len(all))
	for _, s := range all {
		st := provisionerv1.InstanceState_INSTANCE_STATE_RUNNING
		if !b.alive(s) {
			st = provisionerv1.InstanceState_INSTANCE_STATE_STOPPED
		}
		out = append(out, b.instance(s, st))
	}
	return out, nil
}

// Check implements provisioner.Checker: the state directory is usable and
// the proxy program is there.
func (b *Backend) Check(context.Context) []*provisionerv1.TargetStatus {
	start := time.Now()
	t := &provisionerv1.TargetStatus{Name: "localhost", Address: b.dir, Ready: true, Reason: provisioner.ReasonReachable,
		Details: map[string]string{"proxy": b.kind, "network": b.network.String()}}
	probe := filepath.Join(b.dir, ".check")
	if err := os.WriteFile(probe, []byte("ok"), 0o644); err != nil {
		t.Ready, t.Reason, t.Message = false, provisioner.ReasonStateDirNotWritable, err.Error()
	} else {
		_ = os.Remove(probe)
	}
	bin := b.self
	if b.kind == "squid" {
		bin = b.squid
	}
	if _, err := os.Stat(bin); err != nil {
		t.Ready, t.Reason, t.Message = false, provisioner.ReasonProxyMissing, err.Error()
	}
	if all, err := b.all(); err == nil {
		t.Details["instances"] = strconv.Itoa(len(all))
	}
	t.Latency = durationSince(start)
	return []*provisionerv1.TargetStatus{t}
}

func durationSince(t time.Time) *durationpb.Duration { return durationpb.New(time.Since(t)) }
