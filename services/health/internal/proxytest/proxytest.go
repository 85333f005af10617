// Package proxytest starts real forward proxies on loopback for tests: a Go
// CONNECT-capable proxy whose behaviour a test can steer, and Debian's
// squid with a generated configuration. Both are real TCP servers speaking
// real HTTP; nothing is mocked.
package proxytest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/squid"
)

// Behaviour steers the Go proxy.
type Behaviour struct {
	// Status answers CONNECT with this status instead of tunnelling (0:
	// tunnel).
	Status int
	// Delay holds every request this long before answering.
	Delay time.Duration
}

// Proxy is a Go forward proxy: CONNECT tunnels and absolute-URL GETs.
type Proxy struct {
	ln net.Listener

	mu        sync.Mutex
	behaviour Behaviour
	agents    map[string]int

	connects atomic.Int64
	wg       sync.WaitGroup
	conns    sync.Map // net.Conn -> struct{}
}

// StartProxy starts a Go proxy on a loopback port; it stops when the test
// ends.
func StartProxy(t testing.TB, b Behaviour) *Proxy {
	t.Helper()
	p, err := NewProxy(b)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// NewProxy starts a Go proxy on a loopback port; Close stops it.
func NewProxy(b Behaviour) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, behaviour: b, agents: map[string]int{}}
	p.wg.Add(1)
	go p.serve()
	return p, nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Close stops the proxy and every connection it holds, and waits for them.
func (p *Proxy) Close() {
	_ = p.ln.Close()
	p.conns.Range(func(k, _ any) bool {
		_ = k.(net.Conn).Close()
		return true
	})
	p.wg.Wait()
}

// SetBehaviour changes what the proxy does from the next request on.
func (p *Proxy) SetBehaviour(b Behaviour) {
	p.mu.Lock()
	p.behaviour = b
	p.mu.Unlock()
}

// Requests is how many requests (CONNECT or forward) the proxy received.
func (p *Proxy) Requests() int64 { return p.connects.Load() }

// Agents counts the requests by User-Agent.
func (p *Proxy) Agents() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]int, len(p.agents))
	for k, v := range p.agents {
		out[k] = v
	}
	return out
}

// ResetAgents forgets the counted User-Agents.
func (p *Proxy) ResetAgents() {
	p.mu.Lock()
	p.agents = map[string]int{}
	p.mu.Unlock()
}

func (p *Proxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.conns.Store(c, struct{}{})
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			defer p.conns.Delete(c)
			defer c.Close()
			p.handle(c)
		}()
	}
}

func (p *Proxy) handle(c net.Conn) {
	br := bufio.NewReader(c)
	req, err := http.ReadRequest(br)
	if err != nil {
		return
	}
	p.connects.Add(1)
	p.mu.Lock()
	b := p.behaviour
	p.agents[req.UserAgent()]++
	p.mu.Unlock()
	if b.Delay > 0 {
		t := time.NewTimer(b.Delay)
		done := make(chan struct{})
		go func() {
			// A closed client (probe timeout) or Close ends the wait.
			_, _ = c.Read(make([]byte, 1))
			close(done)
		}()
		select {
		case <-t.C:
			// Unblock the watcher; the client sends nothing before the
			// answer, so it read nothing.
			_ = c.SetReadDeadline(time.Now())
			<-done
			_ = c.SetReadDeadline(time.Time{})
		case <-done:
			t.Stop()
			return
		}
	}
	if b.Status != 0 {
		fmt.Fprintf(c, "HTTP/1.1 %d %s\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", b.Status, http.StatusText(b.Status))
		return
	}
	if req.Method == http.MethodConnect {
		up, err := net.DialTimeout("tcp", req.Host, 5*time.Second)
		if err != nil {
			fmt.Fprintf(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
			return
		}
		defer up.Close()
		p.conns.Store(up, struct{}{})
		defer p.conns.Delete(up)
		if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
			return
		}
		done := make(chan struct{}, 2)
		go func() { _, _ = io.Copy(up, br); closeWrite(up); done <- struct{}{} }()
		go func() { _, _ = io.Copy(c, up); closeWrite(c); done <- struct{}{} }()
		<-done
		<-done
		return
	}
	// A plain forward: the request line carries the absolute URL.
	if req.URL.Host == "" {
		fmt.Fprintf(c, "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
		return
	}
	req.RequestURI = ""
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		fmt.Fprintf(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
		return
	}
	defer resp.Body.Close()
	resp.Close = true
	_ = resp.Write(c)
}

func closeWrite(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.CloseWrite()
	}
}

// FreePort returns a loopback port nothing listens on right now.
func FreePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// SquidOptions shape the generated squid configuration.
type SquidOptions struct {
	// DenyConnectPorts are target ports squid refuses to CONNECT to (403).
	DenyConnectPorts []int
	// Extra is appended to the generated configuration as it is.
	Extra string
}

// Squid is a running squid.
type Squid struct {
	addr string
}

// Addr is squid's host:port.
func (s *Squid) Addr() string { return s.addr }

// SquidBinary finds squid, failing the test with how to install it.
func SquidBinary(t testing.TB) string {
	t.Helper()
	for _, p := range []string{"squid"} {
		if path, err := exec.LookPath(p); err == nil {
			return path
		}
	}
	for _, p := range []string{"/usr/sbin/squid", "/usr/local/sbin/squid"} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	t.Fatal("squid is not installed: run scripts/ensure-deps.sh (apt-get install -y squid); the probe tests need a real squid")
	return ""
}

// StartSquid runs squid in the foreground with a generated configuration on
// a free loopback port, its files in a temporary directory, and stops it
// when the test ends.
func StartSquid(t testing.TB, o SquidOptions) *Squid {
	t.Helper()
	bin := SquidBinary(t)
	dir, err := os.MkdirTemp("", "squid-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	// squid started as root drops to its effective user, which must write
	// its logs and pid file here.
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	port := FreePort(t)
	var deny strings.Builder
	if len(o.DenyConnectPorts) > 0 {
		deny.WriteString("acl denied_ports port")
		for _, p := range o.DenyConnectPorts {
			fmt.Fprintf(&deny, " %d", p)
		}
		deny.WriteString("\nhttp_access deny CONNECT denied_ports\n")
	}
	conf := fmt.Sprintf(`http_port 127.0.0.1:%d
pid_filename %[2]s/squid.pid
cache_log %[2]s/cache.log
access_log %[2]s/access.log
cache_store_log none
coredump_dir %[2]s
cache deny all
visible_hostname squid-test
shutdown_lifetime 0 seconds
dns_v4_first on
acl localnet src 127.0.0.0/8
%[3]shttp_access allow localnet
http_access deny all
%[4]s
`, port, dir, deny.String(), o.Extra)
	confPath := filepath.Join(dir, "squid.conf")
	if err := os.WriteFile(confPath, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	// A service name of its own: squids of one name collide in /dev/shm.
	service := squid.ServiceName(filepath.Base(dir))
	cmd := exec.Command(bin, "-N", "-n", service, "-f", confPath)
	var out lockedBuffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting squid: %v", err)
	}
	// One Wait, whose end closes exited: the wait for squid to listen and
	// the cleanup both read it, so an early exit seen by the first never
	// leaves the second waiting forever.
	exited := make(chan struct{})
	var waitErr error
	go func() {
		waitErr = cmd.Wait()
		close(exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		squid.RemoveStaleSegments(service)
	})
	logs := func() string {
		log, _ := os.ReadFile(filepath.Join(dir, "cache.log"))
		return out.String() + "\n" + string(log)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	deadline := time.NewTimer(30 * time.Second)
	defer deadline.Stop()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			_ = c.Close()
			return &Squid{addr: addr}
		}
		select {
		case <-exited:
			t.Fatalf("squid exited (%v) before listening:\n%s", waitErr, logs())
		case <-deadline.C:
			t.Fatalf("squid not listening on %s after 30s:\n%s", addr, logs())
		case <-tick.C:
		}
	}
}

// lockedBuffer collects output written from several goroutines.
type lockedBuffer = logtest.Buffer
