//go:build bench

package bench

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// farmProxy is one upstream forward proxy of the farm: CONNECT (answered
// 200, then bytes relayed with io.Copy between the two TCP connections, so
// the kernel splices them) and absolute-URI requests forwarded over a
// keep-alive pool to the target. It counts what it served, so the bench
// can show where the gateway sent its tunnels.
type farmProxy struct {
	addr      string
	tunnels   atomic.Int64
	forwarded atomic.Int64
	transport *http.Transport
}

// startFarm starts n proxies on n loopback addresses (127.0.0.11 and up).
func startFarm(t *testing.T, n int) []*farmProxy {
	t.Helper()
	farm := make([]*farmProxy, n)
	for i := range farm {
		ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.%d:0", 11+i))
		if err != nil {
			t.Fatal(err)
		}
		p := &farmProxy{addr: ln.Addr().String(), transport: &http.Transport{
			MaxIdleConnsPerHost: 256, DisableCompression: true, IdleConnTimeout: time.Minute,
		}}
		var wg sync.WaitGroup
		t.Cleanup(func() {
			_ = ln.Close()
			p.transport.CloseIdleConnections()
			wg.Wait()
		})
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				go p.serve(c)
			}
		}()
		farm[i] = p
	}
	return farm
}

func (p *farmProxy) serve(c net.Conn) {
	defer c.Close()
	br := bufio.NewReader(c)
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if req.Method == http.MethodConnect {
			p.tunnels.Add(1)
			up, err := net.DialTimeout("tcp", req.Host, 5*time.Second)
			if err != nil {
				_, _ = io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
				return
			}
			defer up.Close()
			if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
				return
			}
			if n := br.Buffered(); n > 0 {
				b, _ := br.Peek(n)
				if _, err := up.Write(b); err != nil {
					return
				}
			}
			relay(c, up)
			return
		}
		p.forwarded.Add(1)
		req.RequestURI = ""
		req.Header.Del("Proxy-Connection")
		resp, err := p.transport.RoundTrip(req)
		if err != nil {
			_, _ = io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
			return
		}
		err = resp.Write(c)
		_ = resp.Body.Close()
		if err != nil || req.Close {
			return
		}
	}
}

// relay copies both ways until both directions end.
func relay(a, b net.Conn) {
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(b, a)
		closeWrite(b)
		close(done)
	}()
	_, _ = io.Copy(a, b)
	closeWrite(a)
	<-done
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}

// smallBody is what a target answers to GET /.
var smallBody = []byte(fmt.Sprintf("%01024d", 0))

// bulkChunk is what /bulk streams until the client goes away.
var bulkChunk = make([]byte, 256<<10)

func targetHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Proxy-Authorization") != "" {
			http.Error(w, "proxy credentials reached the target", http.StatusInternalServerError)
			return
		}
		if r.URL.Path == "/bulk" {
			w.Header().Set("Content-Type", "application/octet-stream")
			for {
				if _, err := w.Write(bulkChunk); err != nil {
					return
				}
			}
		}
		w.Header().Set("Content-Length", strconv.Itoa(len(smallBody)))
		_, _ = w.Write(smallBody)
	})
}

// targets are the TLS target (a certificate of its own CA, which the
// clients trust) and the plain-HTTP target.
type targets struct {
	tlsAddr, plainAddr string
	tlsConfig          *tls.Config
}

func startTargets(t *testing.T) targets {
	t.Helper()
	ts := httptest.NewUnstartedServer(targetHandler())
	ts.StartTLS()
	t.Cleanup(ts.Close)
	plain := httptest.NewServer(targetHandler())
	t.Cleanup(plain.Close)
	roots := x509.NewCertPool()
	roots.AddCert(ts.Certificate())
	return targets{
		tlsAddr:   ts.Listener.Addr().String(),
		plainAddr: plain.Listener.Addr().String(),
		// No session cache: every tunnel makes a full handshake, as a new
		// crawler connection does.
		tlsConfig: &tls.Config{RootCAs: roots, ServerName: "127.0.0.1"},
	}
}
