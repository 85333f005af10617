package kvm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// libvirtAPI is the subset of go-libvirt the backend uses; *libvirt.Libvirt
// implements it, tests use a fake and the trace wraps it.
type libvirtAPI interface {
	ConnectGetLibVersion() (uint64, error)
	ConnectGetVersion() (uint64, error)
	ConnectGetHostname() (string, error)
	ConnectGetAllDomainStats(doms []libvirt.Domain, stats uint32, flags uint32) ([]libvirt.DomainStatsRecord, error)
	DomainLookupByName(name string) (libvirt.Domain, error)
	DomainDefineXML(xml string) (libvirt.Domain, error)
	DomainCreate(dom libvirt.Domain) error
	DomainGetState(dom libvirt.Domain, flags uint32) (int32, int32, error)
	DomainGetMetadata(dom libvirt.Domain, typ int32, uri libvirt.OptString, flags libvirt.DomainModificationImpact) (string, error)
	DomainSetMetadata(dom libvirt.Domain, typ int32, metadata, key, uri libvirt.OptString, flags libvirt.DomainModificationImpact) error
	DomainGetXMLDesc(dom libvirt.Domain, flags libvirt.DomainXMLFlags) (string, error)
	DomainInterfaceAddresses(dom libvirt.Domain, source uint32, flags uint32) ([]libvirt.DomainInterface, error)
	DomainDestroy(dom libvirt.Domain) error
	DomainUndefineFlags(dom libvirt.Domain, flags libvirt.DomainUndefineFlagsValues) error
	StoragePoolLookupByName(name string) (libvirt.StoragePool, error)
	StoragePoolGetInfo(pool libvirt.StoragePool) (uint8, uint64, uint64, uint64, error)
	StorageVolLookupByName(pool libvirt.StoragePool, name string) (libvirt.StorageVol, error)
	StorageVolGetPath(vol libvirt.StorageVol) (string, error)
	StorageVolCreateXML(pool libvirt.StoragePool, xml string, flags libvirt.StorageVolCreateFlags) (libvirt.StorageVol, error)
	StorageVolUpload(vol libvirt.StorageVol, r io.Reader, offset, length uint64, flags libvirt.StorageVolUploadFlags) error
	StorageVolDownload(vol libvirt.StorageVol, w io.Writer, offset, length uint64, flags libvirt.StorageVolDownloadFlags) error
	StorageVolDelete(vol libvirt.StorageVol, flags libvirt.StorageVolDeleteFlags) error
	StoragePoolListAllVolumes(pool libvirt.StoragePool, needResults int32, flags uint32) ([]libvirt.StorageVol, uint32, error)
	StorageVolGetXMLDesc(vol libvirt.StorageVol, flags uint32) (string, error)
}

// hostClient is one live connection to a host.
type hostClient struct {
	api libvirtAPI
	// run runs a command on the host over the same SSH link (nil when the
	// connection cannot).
	run   commandRunner
	done  <-chan struct{} // closed when the connection is gone
	close func()
}

func (c *hostClient) alive() bool {
	select {
	case <-c.done:
		return false
	default:
		return true
	}
}

// dialTimeout bounds one dial: TCP connect, SSH handshake and libvirt
// handshake together.
const dialTimeout = 30 * time.Second

// hostDialer opens a connection to a host: the real one goes over SSH,
// tests inject their own.
type hostDialer func(ctx context.Context, host Host) (*hostClient, error)

// dialStage names the step of a connection attempt that failed, so Check
// can say where a host broke without parsing messages.
type dialStage string

const (
	stageSSHMaterial    dialStage = "ssh-material"
	stageTCP            dialStage = "tcp"
	stageSSHHandshake   dialStage = "ssh-handshake"
	stageLibvirtConnect dialStage = "libvirt-connect"
)

// dialError tags a dial failure with its stage; it keeps the cause's
// message and unwraps to it.
type dialError struct {
	stage dialStage
	err   error
}

func (e *dialError) Error() string { return e.err.Error() }
func (e *dialError) Unwrap() error { return e.err }

// hostPool keeps one connection per host, dialled lazily and again after
// it failed. Dials of different hosts do not wait on each other; callers of
// one host share its dial. Operations on one host are bounded by a
// semaphore so a burst of creates cannot flood one hypervisor.
type hostPool struct {
	dial    hostDialer
	perHost int
	log     *slog.Logger
	wrap    func(libvirtAPI) libvirtAPI
	mu      sync.Mutex
	entries map[string]*hostEntry
}

type hostEntry struct {
	// lock is a one-slot semaphore rather than a mutex so that waiting for
	// it ends with the caller's context: the holder may be dialling a dead
	// host for as long as that takes.
	lock   chan struct{}
	client *hostClient
	// ops bounds the operations running against the host.
	ops chan struct{}
	// probing is set while a probe's RPCs run, an abandoned one included.
	probing atomic.Bool
}

func newHostPool(dial hostDialer, perHost int, log *slog.Logger, wrap func(libvirtAPI) libvirtAPI) *hostPool {
	return &hostPool{dial: dial, perHost: perHost, log: log, wrap: wrap, entries: map[string]*hostEntry{}}
}

func (p *hostPool) entry(name string) *hostEntry {
	p.mu.Lock()
	defer p.mu.Unlock()
	e, ok := p.entries[name]
	if !ok {
		e = &hostEntry{lock: make(chan struct{}, 1), ops: make(chan struct{}, p.perHost)}
		p.entries[name] = e
	}
	return e
}

// acquire takes a slot of ch, giving up when ctx ends first.
func acquire(ctx context.Context, ch chan struct{}) error {
	select {
	case ch <- struct{}{}:
		return nil
	default:
	}
	select {
	case ch <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// get returns host's live connection, dialling when there is none.
func (p *hostPool) get(ctx context.Context, host Host) (*hostClient, error) {
	e := p.entry(host.Name)
	if err := acquire(ctx, e.lock); err != nil {
		return nil, fmt.Errorf("waiting for the connection to host %s (%s): %w", host.Name, host.Address, err)
	}
	defer func() { <-e.lock }()
	if e.client != nil {
		if e.client.alive() {
			return e.client, nil
		}
		e.client.close()
		e.client = nil
	}
	start := time.Now()
	// A black-holed host must not hold the slot for the OS connect timeout
	// or, mid-handshake, forever: a dial never takes longer than this.
	dctx, cancel := context.WithTimeout(ctx, dialTimeout)
	defer cancel()
	c, err := p.dial(dctx, host)
	if err != nil {
		p.log.DebugContext(ctx, "libvirt dial failed", "host", host.Name, "duration", time.Since(start), "error", err.Error())
		return nil, err
	}
	p.log.DebugContext(ctx, "libvirt connected", "host", host.Name, "address", host.Address, "duration", time.Since(start))
	e.client = c
	return c, nil
}

// drop forgets c (and closes it) unless a redial already replaced it.
func (p *hostPool) drop(host string, c *hostClient) {
	e := p.entry(host)
	e.lock <- struct{}{}
	defer func() { <-e.lock }()
	if e.client == c {
		e.client = nil
	}
	c.close()
}

// call runs fn against host's connection within the host's operation
// bound. go-libvirt's RPCs take no context and block until the daemon
// answers, so when ctx ends first the connection is closed, which unblocks
// fn, and ctx's error is returned. A transport error also drops the
// connection, so the next call redials.
func (p *hostPool) call(ctx context.Context, host Host, fn func(api libvirtAPI) error) error {
	return p.callHost(ctx, host, func(api libvirtAPI, _ commandRunner) error { return fn(api) })
}

// callHost is call for operations that also run commands on the host over
// the connection's SSH link.
func (p *hostPool) callHost(ctx context.Context, host Host, fn func(api libvirtAPI, run commandRunner) error) error {
	e := p.entry(host.Name)
	if err := acquire(ctx, e.ops); err != nil {
		return fmt.Errorf("waiting for a free operation slot on host %s: %w", host.Name, err)
	}
	defer func() { <-e.ops }()
	c, err := p.get(ctx, host)
	if err != nil {
		return err
	}
	err = awaitOrCancel(ctx, func() error { return fn(p.traced(ctx, host, c), c.run) }, func() {
		p.log.DebugContext(ctx, "libvirt connection dropped", "host", host.Name, "reason", "context ended", "error", ctx.Err().Error())
		p.drop(host.Name, c)
	})
	p.dropOnTransportError(ctx, host, c, err)
	return err
}

// errProbeBusy refuses a probe while the previous one of the same host is
// still waiting for libvirt.
var errProbeBusy = errors.New("the previous check of this host is still waiting for libvirt to answer")

// probe is call for Check, which must never cost the operations their
// connection: when ctx ends first, fn is abandoned and the connection kept
// (a link that is really dead is closed by the keepalive, which ends fn
// too). At most one probe per host runs, an abandoned one included, so a
// daemon that stopped answering cannot pile up goroutines.
func (p *hostPool) probe(ctx context.Context, host Host, fn func(api libvirtAPI) error) error {
	e := p.entry(host.Name)
	if !e.probing.CompareAndSwap(false, true) {
		return errProbeBusy
	}
	c, err := p.get(ctx, host)
	if err != nil {
		e.probing.Store(false)
		return err
	}
	err = awaitOrCancel(ctx, func() error {
		defer e.probing.Store(false)
		return fn(p.traced(ctx, host, c))
	}, func() {
		p.log.DebugContext(ctx, "libvirt probe abandoned, connection kept", "host", host.Name, "error", ctx.Err().Error())
	})
	p.dropOnTransportError(ctx, host, c, err)
	return err
}

// dropOnTransportError drops c when err is evidence against the link:
// neither a libvirt error, nor a verdict already classified here, nor the
// caller's context ending.
func (p *hostPool) dropOnTransportError(ctx context.Context, host Host, c *hostClient, err error) {
	if err == nil || isLibvirtError(err) || isClassified(err) || (ctx.Err() != nil && errors.Is(err, ctx.Err())) {
		return
	}
	p.log.DebugContext(ctx, "libvirt connection dropped", "host", host.Name, "reason", "transport error", "error", err.Error())
	p.drop(host.Name, c)
}

func (p *hostPool) traced(ctx context.Context, host Host, c *hostClient) libvirtAPI {
	api := c.api
	if p.wrap != nil {
		api = p.wrap(api)
	}
	if p.log.Enabled(ctx, slog.LevelDebug) {
		return &tracingAPI{inner: api, log: p.log.With("host", host.Name), ctx: ctx}
	}
	return api
}

// close closes every connection.
func (p *hostPool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, e := range p.entries {
		e.lock <- struct{}{}
		if e.client != nil {
			e.client.close()
			e.client = nil
		}
		<-e.lock
	}
}

// awaitOrCancel runs fn in the background and returns its result, unless
// ctx ends first: then abort runs and ctx's error is returned while fn is
// left to finish on its own.
func awaitOrCancel(ctx context.Context, fn func() error, abort func()) error {
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		abort()
		return ctx.Err()
	}
}

// ---- SSH ----

// sshMaterial is a host's private key and host-key policy.
type sshMaterial struct {
	signer  ssh.Signer
	hostKey ssh.HostKeyCallback
}

// loadSSHMaterial reads a host's key material. A file that is not there
// (yet) is Transient, so operations heal once it appears; content that does
// not parse is Permanent, since retrying cannot fix it.
func loadSSHMaterial(h Host, insecure bool) (*sshMaterial, error) {
	fileErr := func(field, file string, err error) error {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, fs.ErrPermission) {
			return errclass.Wrap(errclass.Transient, fmt.Errorf("host %s: reading %s %s: %w", h.Name, field, file, err))
		}
		return errclass.Wrap(errclass.Permanent, fmt.Errorf("host %s: %s %s: %w", h.Name, field, file, err))
	}
	key, err := os.ReadFile(h.KeyFile)
	if err != nil {
		return nil, fileErr("keyFile", h.KeyFile, err)
	}
	signer, err := ssh.ParsePrivateKey(key)
	if err != nil {
		// The parser's message never quotes the key.
		return nil, errclass.Wrap(errclass.Permanent, fmt.Errorf("host %s: keyFile %s: %w", h.Name, h.KeyFile, err))
	}
	hostKey := ssh.InsecureIgnoreHostKey() //nolint:gosec // opt-in, logged as a WARNING at start
	if !insecure {
		hostKey, err = knownhosts.New(h.KnownHostsFile)
		if err != nil {
			return nil, fileErr("knownHostsFile", h.KnownHostsFile, err)
		}
	}
	return &sshMaterial{signer: signer, hostKey: hostKey}, nil
}

// sshDialer is the production hostDialer. Key material is loaded on the
// first connection of each host and cached once it loads.
type sshDialer struct {
	insecure  bool
	keepalive time.Duration
	log       *slog.Logger

	mu       sync.Mutex
	material map[string]*sshMaterial
}

func newSSHDialer(insecure bool, keepalive time.Duration, log *slog.Logger) *sshDialer {
	return &sshDialer{insecure: insecure, keepalive: keepalive, log: log, material: map[string]*sshMaterial{}}
}

func (d *sshDialer) load(h Host) (*sshMaterial, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if m, ok := d.material[h.Name]; ok {
		return m, nil
	}
	m, err := loadSSHMaterial(h, d.insecure)
	if err != nil {
		return nil, err
	}
	d.material[h.Name] = m
	return m, nil
}

// dial SSHes to the host, forwards its libvirt socket through the
// connection and opens a libvirt session over it. The handshakes are
// bounded by ctx.
func (d *sshDialer) dial(ctx context.Context, h Host) (*hostClient, error) {
	m, err := d.load(h)
	if err != nil {
		return nil, &dialError{stage: stageSSHMaterial, err: err}
	}
	var nd net.Dialer
	nc, err := nd.DialContext(ctx, "tcp", h.Address)
	if err != nil {
		return nil, &dialError{stage: stageTCP, err: fmt.Errorf("host %s: ssh dial: %w", h.Name, err)}
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = nc.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = nc.Close() })
	conn, chans, reqs, err := ssh.NewClientConn(nc, h.Address, &ssh.ClientConfig{
		User:            h.User,
		Auth:            []ssh.AuthMethod{ssh.PublicKeys(m.signer)},
		HostKeyCallback: m.hostKey,
	})
	if !stop() || err != nil {
		_ = nc.Close()
		switch cerr := ctx.Err(); {
		case cerr != nil && err != nil:
			// The context cut the handshake (its read fails on the closed
			// connection): the deadline is why.
			err = fmt.Errorf("%w (%v)", cerr, err)
		case cerr != nil:
			err = cerr
		}
		return nil, &dialError{stage: stageSSHHandshake, err: fmt.Errorf("host %s: ssh handshake: %w", h.Name, err)}
	}
	_ = nc.SetDeadline(time.Time{})
	client := ssh.NewClient(conn, chans, reqs)
	lv := libvirt.NewWithDialer(unixForward{client: client, path: h.Socket})
	if err := awaitOrCancel(ctx, lv.Connect, func() { _ = client.Close() }); err != nil {
		_ = client.Close()
		return nil, &dialError{stage: stageLibvirtConnect, err: fmt.Errorf("host %s: libvirt connect via %s: %w", h.Name, h.Socket, err)}
	}
	done := make(chan struct{})
	var once sync.Once
	closeAll := func() {
		once.Do(func() {
			close(done)
			// The link goes first and the libvirt goodbye runs on its own:
			// go-libvirt can wedge a connection for good (a stream packet
			// arriving after its caller returned blocks its router while it
			// holds the lock every call and Disconnect need), and a close
			// must never hang the host's slot with it.
			_ = client.Close()
			go func() { _ = lv.Disconnect() }()
		})
	}
	go func() {
		// The SSH connection ending (keepalive failure, peer gone) ends the
		// libvirt session too.
		_ = client.Wait()
		closeAll()
	}()
	go func() {
		select {
		case <-lv.Disconnected():
			closeAll()
		case <-done:
		}
	}()
	go d.keepAlive(h, client, done, closeAll)
	return &hostClient{api: lv, run: sshRunner(client), done: done, close: closeAll}, nil
}

// keepAlive sends an SSH keepalive every interval and closes the
// connection when one is not answered within the next interval, so a dead
// link is noticed even while no operation runs.
func (d *sshDialer) keepAlive(h Host, client *ssh.Client, done <-chan struct{}, closeAll func()) {
	t := time.NewTicker(d.keepalive)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
		}
		answered := make(chan error, 1)
		go func() {
			_, _, err := client.SendRequest("keepalive@openssh.com", true, nil)
			answered <- err
		}()
		select {
		case err := <-answered:
			if err != nil {
				d.log.Warn("WARNING: ssh keepalive failed; dropping the connection", "host", h.Name, "error", err.Error())
				closeAll()
				return
			}
		case <-time.After(d.keepalive):
			d.log.Warn("WARNING: ssh keepalive unanswered; dropping the connection", "host", h.Name)
			closeAll()
			return
		case <-done:
			return
		}
	}
}

// unixForward dials the host's libvirt socket through the SSH connection.
type unixForward struct {
	client *ssh.Client
	path   string
}

func (u unixForward) Dial() (net.Conn, error) { return u.client.Dial("unix", u.path) }
