//go:build bench

package bench

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/egress-proxies/egress-proxies/pkg/proctest"
)

// via is where a client sends its tunnels and requests: a farm proxy
// straight (no credentials) or the gateway (the crawler's token as the
// password, options as the username).
type via struct {
	addr string // host:port of the HTTP proxy (CONNECT and absolute URIs)
	// socks is the gateway's SOCKS5 address, when the load uses it.
	socks string
	// auth is the Proxy-Authorization value; empty for the farm.
	auth       string
	user, pass string
}

func gatewayVia(addr, socks, user, token string) via {
	return via{addr: addr, socks: socks, user: user, pass: token,
		auth: "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+token))}
}

// connect opens a CONNECT tunnel to target through v.
func (v via) connect(ctx context.Context, target string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", v.addr)
	if err != nil {
		return nil, err
	}
	req := "CONNECT " + target + " HTTP/1.1\r\nHost: " + target + "\r\n"
	if v.auth != "" {
		req += "Proxy-Authorization: " + v.auth + "\r\n"
	}
	if _, err := io.WriteString(c, req+"\r\n"); err != nil {
		_ = c.Close()
		return nil, err
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		_ = c.Close()
		return nil, fmt.Errorf("CONNECT answered %d", resp.StatusCode)
	}
	if br.Buffered() > 0 {
		_ = c.Close()
		return nil, errors.New("bytes after the CONNECT answer")
	}
	return c, nil
}

// socks5 opens a SOCKS5 tunnel (username/password) to target through the
// gateway.
func (v via) socks5(ctx context.Context, target string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", v.socks)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (net.Conn, error) { _ = c.Close(); return nil, err }
	host, portStr, _ := net.SplitHostPort(target)
	port, _ := strconv.Atoi(portStr)
	msg := []byte{5, 1, 2}
	msg = append(msg, 1, byte(len(v.user)))
	msg = append(msg, v.user...)
	msg = append(msg, byte(len(v.pass)))
	msg = append(msg, v.pass...)
	msg = append(msg, 5, 1, 0, 3, byte(len(host)))
	msg = append(msg, host...)
	msg = append(msg, byte(port>>8), byte(port))
	// Method selection, authentication and the request in one write, as
	// fast clients pipeline them; the answers are read in order.
	if _, err := c.Write(msg); err != nil {
		return fail(err)
	}
	var b [10]byte
	if _, err := io.ReadFull(c, b[:2]); err != nil || b[1] != 2 {
		return fail(fmt.Errorf("SOCKS5 method %v %v", b[:2], err))
	}
	if _, err := io.ReadFull(c, b[:2]); err != nil || b[1] != 0 {
		return fail(fmt.Errorf("SOCKS5 auth %v %v", b[:2], err))
	}
	if _, err := io.ReadFull(c, b[:4]); err != nil || b[1] != 0 {
		return fail(fmt.Errorf("SOCKS5 reply %v %v", b[:4], err))
	}
	skip := 0
	switch b[3] {
	case 1:
		skip = 4 + 2
	case 4:
		skip = 16 + 2
	case 3:
		if _, err := io.ReadFull(c, b[:1]); err != nil {
			return fail(err)
		}
		skip = int(b[0]) + 2
	}
	if _, err := io.ReadFull(c, make([]byte, skip)); err != nil {
		return fail(err)
	}
	return c, nil
}

// getOnce sends one GET / over conn (TLS first when cfg is set), reads the
// whole answer and checks its body.
func getOnce(conn net.Conn, cfg *tls.Config) error {
	defer conn.Close()
	var rw net.Conn = conn
	if cfg != nil {
		tc := tls.Client(conn, cfg)
		if err := tc.Handshake(); err != nil {
			return err
		}
		rw = tc
	}
	if _, err := io.WriteString(rw, "GET / HTTP/1.1\r\nHost: target\r\nConnection: close\r\n\r\n"); err != nil {
		return err
	}
	resp, err := http.ReadResponse(bufio.NewReader(rw), nil)
	if err != nil {
		return err
	}
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || !bytes.Equal(body, smallBody) {
		return fmt.Errorf("answer %d with %d bytes", resp.StatusCode, len(body))
	}
	return nil
}

// op is one closed-loop iteration of a client; it returns the bytes it
// moved (for the bulk load) and its error.
type op func(ctx context.Context) (int64, error)

func tlsTunnelOp(v via, tg targets, socks bool) op {
	return func(ctx context.Context) (int64, error) {
		open := v.connect
		if socks {
			open = v.socks5
		}
		c, err := open(ctx, tg.tlsAddr)
		if err != nil {
			return 0, err
		}
		return 0, getOnce(c, tg.tlsConfig)
	}
}

func plainTunnelOp(v via, tg targets) op {
	return func(ctx context.Context) (int64, error) {
		c, err := v.connect(ctx, tg.plainAddr)
		if err != nil {
			return 0, err
		}
		return 0, getOnce(c, nil)
	}
}

// httpClient forwards absolute-URI requests through v over one kept-alive
// connection.
func httpClient(v via) *http.Client {
	u := &url.URL{Scheme: "http", Host: v.addr}
	if v.auth != "" {
		u.User = url.UserPassword(v.user, v.pass)
	}
	return &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(u), MaxIdleConnsPerHost: 1, DisableCompression: true}}
}

func httpForwardOp(v via, tg targets) func() op {
	return func() op {
		client := httpClient(v)
		target := "http://" + tg.plainAddr + "/"
		return func(ctx context.Context) (int64, error) {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
			resp, err := client.Do(req)
			if err != nil {
				return 0, err
			}
			body, err := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if err != nil {
				return 0, err
			}
			if resp.StatusCode != http.StatusOK || !bytes.Equal(body, smallBody) {
				return 0, fmt.Errorf("answer %d with %d bytes", resp.StatusCode, len(body))
			}
			return 0, nil
		}
	}
}

// bulkOp reads /bulk over one tunnel (TLS or not) until ctx ends, adding
// the body bytes it reads to progress as they arrive.
func bulkOp(v via, tg targets, useTLS bool, progress *atomic.Int64) op {
	return func(ctx context.Context) (int64, error) {
		addr, cfg := tg.plainAddr, (*tls.Config)(nil)
		if useTLS {
			addr, cfg = tg.tlsAddr, tg.tlsConfig
		}
		c, err := v.connect(ctx, addr)
		if err != nil {
			return 0, err
		}
		defer c.Close()
		stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
		defer stop()
		var rw net.Conn = c
		if cfg != nil {
			tc := tls.Client(c, cfg)
			if err := tc.Handshake(); err != nil {
				return 0, err
			}
			rw = tc
		}
		if _, err := io.WriteString(rw, "GET /bulk HTTP/1.1\r\nHost: target\r\nConnection: close\r\n\r\n"); err != nil {
			return 0, err
		}
		resp, err := http.ReadResponse(bufio.NewReaderSize(rw, 64<<10), nil)
		if err != nil {
			return 0, err
		}
		n, err := io.CopyBuffer(counter{progress}, resp.Body, make([]byte, 256<<10))
		if ctx.Err() != nil {
			return n, nil
		}
		if err == nil {
			err = errors.New("the bulk answer ended")
		}
		return n, err
	}
}

// counter counts what is written to it.
type counter struct{ n *atomic.Int64 }

func (c counter) Write(p []byte) (int, error) {
	c.n.Add(int64(len(p)))
	return len(p), nil
}

// result is one measured run.
type result struct {
	ops, errs int64
	firstErr  error
	bytes     int64
	elapsed   time.Duration
	lat       []time.Duration
	// cpu is the gateway process's user+system CPU time over the
	// measured window (0 for runs that do not touch it); rss its resident
	// set at the end.
	cpu time.Duration
	// rss and anon are the resident set and its anonymous part (the
	// rest is the binary's pages, shared and reclaimable), hwm its peak.
	rss, anon, hwm int64
	// mem is the Go runtime's account of the gateway's memory at the end.
	mem  memClasses
	load string
	// self is this process's CPU time over the window (the clients, the
	// farm and the targets); lease the lease service's.
	self, lease time.Duration
	// acquires and acquireTime are the lease acquires the gateway made
	// over the window and the time they took (from its metrics).
	acquires    float64
	acquireTime time.Duration
}

// acquireMs is the mean acquire's duration in ms.
func (r result) acquireMs() float64 {
	if r.acquires == 0 {
		return 0
	}
	return ms(r.acquireTime) / r.acquires
}

func (r result) rate() float64 { return float64(r.ops) / r.elapsed.Seconds() }

func (r result) pct(p float64) time.Duration {
	if len(r.lat) == 0 {
		return 0
	}
	s := slices.Clone(r.lat)
	slices.Sort(s)
	return s[min(len(s)-1, int(float64(len(s))*p))]
}

// runLoad runs c clients in a closed loop for warmup, then measures for
// dur: ops that start and end within the window are counted. newOp makes
// each client's op (a client's own keep-alive pool, say).
// progress, when set, counts bytes as they move: the run's bytes are
// what it counted within the window.
func runLoad(t testing.TB, c int, warmup, dur time.Duration, gwPID, leasePID int, metricsURL string, progress *atomic.Int64, newOp func() op) result {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var (
		measuring atomic.Bool
		mu        sync.Mutex
		res       result
		wg        sync.WaitGroup
		t0, t1    atomic.Int64
	)
	for range c {
		o := newOp()
		wg.Add(1)
		go func() {
			defer wg.Done()
			var lat []time.Duration
			var ops, errs, nbytes int64
			var firstErr error
			for ctx.Err() == nil {
				start := time.Now()
				counted := measuring.Load()
				n, err := o(ctx)
				end := time.Now()
				if !counted || (t1.Load() != 0 && end.UnixNano() > t1.Load()) {
					continue
				}
				nbytes += n
				if err != nil {
					if ctx.Err() == nil {
						errs++
						if firstErr == nil {
							firstErr = err
						}
					}
					continue
				}
				ops++
				lat = append(lat, end.Sub(start))
			}
			mu.Lock()
			res.ops += ops
			res.errs += errs
			res.bytes += nbytes
			res.lat = append(res.lat, lat...)
			if res.firstErr == nil {
				res.firstErr = firstErr
			}
			mu.Unlock()
		}()
	}
	time.Sleep(warmup)
	n0, s0 := scrape(metricsURL).acquires()
	cpu0, self0, lease0 := procCPU(t, gwPID), procCPU(t, os.Getpid()), procCPU(t, leasePID)
	var b0, b1 int64
	if progress != nil {
		b0 = progress.Load()
	}
	t0.Store(time.Now().UnixNano())
	measuring.Store(true)
	time.Sleep(dur)
	t1.Store(time.Now().UnixNano())
	if progress != nil {
		b1 = progress.Load()
	}
	cpu1, self1, lease1 := procCPU(t, gwPID), procCPU(t, os.Getpid()), procCPU(t, leasePID)
	res.self, res.lease = self1-self0, lease1-lease0
	end := scrape(metricsURL)
	n1, s1 := end.acquires()
	res.acquires, res.acquireTime = n1-n0, time.Duration((s1-s0)*float64(time.Second))
	res.rss, res.anon, res.hwm = procRSS(t, gwPID)
	res.mem = end.memClasses()
	res.load = loadAvg()
	cancel()
	wg.Wait()
	res.elapsed = time.Duration(t1.Load() - t0.Load())
	if progress != nil {
		res.bytes = b1 - b0
	}
	res.cpu = cpu1 - cpu0
	return res
}

// procCPU is the user+system CPU time of process pid (0: none, for the
// direct runs).
func procCPU(t testing.TB, pid int) time.Duration {
	if pid == 0 {
		return 0
	}
	return proctest.CPUTime(t, pid)
}

// metrics is one reading of the gateway's /metrics, its families by name
// (empty without a URL or when it could not be read).
type metrics map[string]*dto.MetricFamily

func scrape(metricsURL string) metrics {
	if metricsURL == "" {
		return nil
	}
	resp, err := http.Get(metricsURL)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil
	}
	return families
}

// acquires is the gateway's lease acquire count and total seconds
// (egress_gateway_lease_call_seconds{call="acquire"}).
func (m metrics) acquires() (count, sum float64) {
	for _, s := range m["egress_gateway_lease_call_seconds"].GetMetric() {
		for _, l := range s.GetLabel() {
			if l.GetName() == "call" && l.GetValue() == "acquire" {
				return float64(s.GetHistogram().GetSampleCount()), s.GetHistogram().GetSampleSum()
			}
		}
	}
	return 0, 0
}

// gauge is the value of an unlabelled gauge.
func (m metrics) gauge(name string) float64 {
	for _, s := range m[name].GetMetric() {
		return s.GetGauge().GetValue()
	}
	return 0
}

// memClasses is where the Go runtime says the gateway's memory is (from
// the go_memstats_* series of its /metrics), in bytes: the heap's spans
// in use, its free spans not yet returned to the system (resident),
// goroutine stacks, the runtime's other memory (GC metadata, span and
// cache structures, buffers), and the heap size at which the next
// collection starts.
type memClasses struct {
	heapInuse, heapIdleKept, stacks, runtimeOther, gcGoal float64
}

func (m metrics) memClasses() memClasses {
	return memClasses{
		heapInuse:    m.gauge("go_memstats_heap_inuse_bytes"),
		heapIdleKept: m.gauge("go_memstats_heap_idle_bytes") - m.gauge("go_memstats_heap_released_bytes"),
		stacks:       m.gauge("go_memstats_stack_sys_bytes"),
		runtimeOther: m.gauge("go_memstats_sys_bytes") - m.gauge("go_memstats_heap_sys_bytes") - m.gauge("go_memstats_stack_sys_bytes"),
		gcGoal:       m.gauge("go_memstats_next_gc_bytes"),
	}
}

// procRSS is the resident set, its anonymous part and its peak (bytes)
// of process pid.
func procRSS(t testing.TB, pid int) (rss, anon, hwm int64) {
	if pid == 0 {
		return 0, 0, 0
	}
	return proctest.StatusBytes(t, pid, "VmRSS"), proctest.StatusBytes(t, pid, "RssAnon"), proctest.StatusBytes(t, pid, "VmHWM")
}

func loadAvg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
