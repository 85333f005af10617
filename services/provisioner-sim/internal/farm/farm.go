// Package farm is the simulator's cloud: instances that exist the moment
// they are made, each a real HTTP forward proxy (CONNECT and plain HTTP)
// at an address of its own in 127.0.0.0/8, so that a fleet of 100,000
// proxies fits on one machine.
//
// An instance is no process and no socket of its own when it is on the
// farm's shared port: the farm holds one listener for that port, on the
// wildcard address but bound to the loopback device (SO_BINDTODEVICE),
// and routes each accepted connection by the address it was made to
// (every address of 127.0.0.0/8 is loopback on Linux). A connection to an
// address no instance holds is closed at once. So an instance costs a map
// entry, and the farm one goroutine per open connection. On any other
// port each instance gets a listener of its own at its address, and an
// address someone else listens at is skipped: the wildcard address would
// take the port from every other program on this machine, so it is used
// only on the port the farm is given for it.
//
// The farm is the backend's truth and outlives provisioners, as a cloud
// does: it runs as a process of its own (`provisioner-sim farm`) with a
// small JSON API on loopback (see Handler), which the simulator's
// provisioners and tests call.
package farm

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sort"
	"sync"
	"syscall"
	"time"
)

// Instance is one simulated instance.
type Instance struct {
	// ID is the instance's name on the farm (its providerID).
	ID string `json:"id"`
	// ProxyUID and Installation are its mark; Marked is false for an
	// instance no provisioner made (someone else's).
	ProxyUID     string `json:"proxyUid,omitempty"`
	Installation string `json:"installation,omitempty"`
	Marked       bool   `json:"marked"`
	// Name is the proxy's name it was made for.
	Name string `json:"name,omitempty"`
	// Address and Port are where its proxy listens.
	Address    string    `json:"address"`
	Port       uint32    `json:"port"`
	CreateTime time.Time `json:"createTime"`

	addr netip.AddrPort
}

// ErrExists is Create's answer for an ID already taken.
var ErrExists = errors.New("an instance of that id exists")

// ErrNoAddress is Create's answer when no address of the network is free
// on the port (the simulator's quota).
var ErrNoAddress = errors.New("no free address")

// ErrPort is Create's answer when the shared port cannot be served.
var ErrPort = errors.New("the port cannot be served")

// Farm holds the instances and serves their proxies.
type Farm struct {
	log *slog.Logger

	mu        sync.Mutex
	instances map[string]*Instance
	byAddr    map[netip.AddrPort]*Instance
	// shared is the port served on the wildcard address (0: none), and
	// listener its listener once an instance is on it.
	shared   uint32
	listener net.Listener
	// own are the listeners of instances on other ports.
	own map[netip.AddrPort]net.Listener
	// next is, per network, where the next address search starts.
	next   map[netip.Prefix]uint32
	closed bool
	wg     sync.WaitGroup
	conns  map[net.Conn]struct{}
}

// New is an empty farm serving sharedPort (0: none) on the wildcard
// address of the loopback device.
func New(log *slog.Logger, sharedPort uint32) *Farm {
	return &Farm{log: log, shared: sharedPort, instances: map[string]*Instance{}, byAddr: map[netip.AddrPort]*Instance{},
		own: map[netip.AddrPort]net.Listener{}, next: map[netip.Prefix]uint32{}, conns: map[net.Conn]struct{}{}}
}

// Create makes the instance in at an address of network on its port, or
// ErrExists when its ID is taken (nothing changed).
func (f *Farm) Create(in Instance, network netip.Prefix) (Instance, error) {
	if !network.Addr().Is4() || !network.Addr().IsLoopback() || network.Bits() < 8 {
		return Instance{}, fmt.Errorf("network %s is not a prefix of 127.0.0.0/8", network)
	}
	if in.ID == "" || in.Port == 0 || in.Port > 65535 {
		return Instance{}, fmt.Errorf("id %q, port %d: want an id and a TCP port", in.ID, in.Port)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return Instance{}, errors.New("the farm is closed")
	}
	if _, ok := f.instances[in.ID]; ok {
		return Instance{}, ErrExists
	}
	wildcard := in.Port == f.shared
	if wildcard {
		if err := f.listenShared(); err != nil {
			return Instance{}, err
		}
	}
	network = network.Masked()
	size := uint64(1) << (32 - network.Bits())
	base := binary.BigEndian.Uint32(network.Addr().AsSlice())
	start := f.next[network]
	for i := uint64(0); i < size; i++ {
		host := uint32((uint64(start) + i) % size)
		if size > 2 && (host == 0 || uint64(host) == size-1) {
			continue // the network's first and last address
		}
		var ip [4]byte
		binary.BigEndian.PutUint32(ip[:], base+host)
		ap := netip.AddrPortFrom(netip.AddrFrom4(ip), uint16(in.Port))
		if _, taken := f.byAddr[ap]; taken {
			continue
		}
		if !wildcard {
			l, err := f.bind(ap.String())
			if err != nil {
				continue // someone else's
			}
			f.own[ap] = l
			f.serveListener(l)
		}
		f.next[network] = host + 1
		in.addr, in.Address = ap, ap.Addr().String()
		if in.CreateTime.IsZero() {
			in.CreateTime = time.Now().UTC().Truncate(time.Second)
		}
		stored := in
		f.instances[in.ID], f.byAddr[ap] = &stored, &stored
		return stored, nil
	}
	return Instance{}, fmt.Errorf("%w in %s on port %d", ErrNoAddress, network, in.Port)
}

// Get returns the instance of id.
func (f *Farm) Get(id string) (Instance, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	in, ok := f.instances[id]
	if !ok {
		return Instance{}, false
	}
	return *in, true
}

// Mark rewrites the instance's mark; false when there is no such instance.
func (f *Farm) Mark(id, proxyUID, installation string, marked bool) (Instance, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	in, ok := f.instances[id]
	if !ok {
		return Instance{}, false
	}
	in.ProxyUID, in.Installation, in.Marked = proxyUID, installation, marked
	return *in, true
}

// Delete removes the instance; false when there was none. Its open
// connections end with it.
func (f *Farm) Delete(id string) bool {
	f.mu.Lock()
	in, ok := f.instances[id]
	if ok {
		delete(f.instances, id)
		delete(f.byAddr, in.addr)
		if l, own := f.own[in.addr]; own {
			delete(f.own, in.addr)
			_ = l.Close()
		}
	}
	var drop []net.Conn
	for c := range f.conns {
		if ok && localAddr(c) == in.addr {
			drop = append(drop, c)
		}
	}
	f.mu.Unlock()
	for _, c := range drop {
		_ = c.Close()
	}
	return ok
}

// List returns every instance, by ID.
func (f *Farm) List() []Instance {
	f.mu.Lock()
	out := make([]Instance, 0, len(f.instances))
	for _, in := range f.instances {
		out = append(out, *in)
	}
	f.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Len is the number of instances.
func (f *Farm) Len() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.instances)
}

// Close stops serving: the listeners and every open connection.
func (f *Farm) Close() {
	f.mu.Lock()
	f.closed = true
	if f.listener != nil {
		_ = f.listener.Close()
	}
	for _, l := range f.own {
		_ = l.Close()
	}
	for c := range f.conns {
		_ = c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// listenShared starts serving the shared port, once. Called under f.mu.
func (f *Farm) listenShared() error {
	if f.listener != nil {
		return nil
	}
	l, err := f.bind(fmt.Sprintf("0.0.0.0:%d", f.shared))
	if err != nil {
		return fmt.Errorf("%w: shared port %d: %v", ErrPort, f.shared, err)
	}
	f.listener = l
	f.serveListener(l)
	return nil
}

// bind listens at addr, on the loopback device only.
func (f *Farm) bind(addr string) (net.Listener, error) {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			// Only what arrives over loopback: the wildcard address
			// is for the many addresses of 127.0.0.0/8, not the network.
			serr = syscall.SetsockoptString(int(fd), syscall.SOL_SOCKET, syscall.SO_BINDTODEVICE, "lo")
		}); err != nil {
			return err
		}
		return serr
	}}
	return lc.Listen(context.Background(), "tcp4", addr)
}

// serveListener accepts on l until it is closed. Called under f.mu.
func (f *Farm) serveListener(l net.Listener) {
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		f.accept(l)
	}()
}

func localAddr(c net.Conn) netip.AddrPort {
	if a, ok := c.LocalAddr().(*net.TCPAddr); ok {
		return a.AddrPort()
	}
	return netip.AddrPort{}
}

func (f *Farm) accept(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return // closed
		}
		ap := localAddr(c)
		ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
		f.mu.Lock()
		_, ok := f.byAddr[ap]
		if ok && !f.closed {
			f.conns[c] = struct{}{}
			f.wg.Add(1)
		}
		f.mu.Unlock()
		if !ok {
			_ = c.Close() // no instance there: as if nothing listened
			continue
		}
		go func() {
			defer f.wg.Done()
			defer func() {
				f.mu.Lock()
				delete(f.conns, c)
				f.mu.Unlock()
				_ = c.Close()
			}()
			serve(c)
		}()
	}
}

// dialTimeout bounds the proxy's connection to a target.
const dialTimeout = 10 * time.Second

// transport forwards plain HTTP requests.
var transport = &http.Transport{Proxy: nil, DialContext: (&net.Dialer{Timeout: dialTimeout}).DialContext,
	MaxIdleConnsPerHost: 4, IdleConnTimeout: 30 * time.Second}

// serve is one client connection to a proxy: CONNECT tunnels, and plain
// HTTP requests in absolute form forwarded, keep-alive.
func serve(c net.Conn) {
	br := bufio.NewReader(c)
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if req.Method == http.MethodConnect {
			tunnel(c, br, req.Host)
			return
		}
		if req.URL.Host == "" {
			_, _ = io.WriteString(c, "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
			return
		}
		req.RequestURI = ""
		req.Header.Del("Proxy-Connection")
		req.Header.Del("Proxy-Authorization")
		resp, err := transport.RoundTrip(req)
		if err != nil {
			_, _ = io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
			return
		}
		err = resp.Write(c)
		_ = resp.Body.Close()
		if err != nil || req.Close || resp.Close {
			return
		}
	}
}

func tunnel(c net.Conn, br *bufio.Reader, host string) {
	up, err := net.DialTimeout("tcp", host, dialTimeout)
	if err != nil {
		_, _ = io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
		return
	}
	defer up.Close()
	if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = io.Copy(up, br) // what the client sent, buffered first
		if tc, ok := up.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
	}()
	_, _ = io.Copy(c, up)
	_ = c.Close()
	<-done
}
