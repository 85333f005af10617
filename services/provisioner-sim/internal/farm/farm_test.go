package farm_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/egress-proxies/egress-proxies/services/provisioner-sim/internal/farm"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"))
}

// freeNetwork is a /24 of loopback of the test's own.
func freeNetwork() netip.Prefix {
	b := make([]byte, 2)
	_, _ = rand.Read(b)
	return netip.MustParsePrefix(fmt.Sprintf("127.%d.%d.0/24", 100+int(b[0])%30, b[1]))
}

// freePort is a port nothing listens on at the moment, on any address.
func freePort(t *testing.T) uint32 {
	t.Helper()
	l, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return uint32(l.Addr().(*net.TCPAddr).Port)
}

func newFarm(t *testing.T, shared uint32) (*farm.Farm, *farm.Client) {
	t.Helper()
	f := farm.New(slog.New(slog.DiscardHandler), shared)
	srv := httptest.NewServer(f.Handler())
	t.Cleanup(func() { srv.Close(); f.Close() })
	c := farm.NewClient(srv.URL)
	t.Cleanup(c.HTTP.CloseIdleConnections)
	return f, c
}

// connect opens a CONNECT tunnel through the proxy at addr to target and
// returns the tunnel.
func connect(addr, target string) (net.Conn, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", target, target)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		c.Close()
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		c.Close()
		return nil, fmt.Errorf("CONNECT answered %s", resp.Status)
	}
	return c, nil
}

// Both ways of serving: the shared port's one listener, and a listener
// per instance on other ports.
func TestInstancesLifecycleAndProxy(t *testing.T) {
	t.Parallel()
	for _, shared := range []bool{true, false} {
		t.Run(fmt.Sprintf("shared=%v", shared), func(t *testing.T) {
			t.Parallel()
			port := freePort(t)
			var sp uint32
			if shared {
				sp = port
			}
			lifecycle(t, sp, port)
		})
	}
}

func lifecycle(t *testing.T, shared, port uint32) {
	f, c := newFarm(t, shared)
	ctx := context.Background()
	network := freeNetwork()

	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "hello") }))
	t.Cleanup(target.Close)

	a, err := c.Create(ctx, farm.Instance{ID: "a", ProxyUID: "uid-a", Marked: true, Port: port}, network)
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Create(ctx, farm.Instance{ID: "b", ProxyUID: "uid-b", Marked: true, Port: port}, network)
	if err != nil {
		t.Fatal(err)
	}
	if a.Address == b.Address || !network.Contains(netip.MustParseAddr(a.Address)) || !network.Contains(netip.MustParseAddr(b.Address)) {
		t.Fatalf("addresses %s and %s: want two distinct ones in %s", a.Address, b.Address, network)
	}
	if _, err := c.Create(ctx, farm.Instance{ID: "a", Marked: true, Port: port}, network); !farm.IsStatus(err, http.StatusConflict) {
		t.Fatalf("a second create of a: %v, want 409", err)
	}
	got, err := c.Get(ctx, "a")
	if err != nil || got.Address != a.Address || got.ProxyUID != "uid-a" || !got.Marked {
		t.Fatalf("Get a = %+v, %v; want %+v", got, err, a)
	}
	if all, err := c.List(ctx); err != nil || len(all) != 2 || all[0].ID != "a" || all[1].ID != "b" {
		t.Fatalf("List = %+v, %v; want a and b", all, err)
	}
	if st, err := c.Stats(ctx); err != nil || st.Instances != 2 {
		t.Fatalf("Stats = %+v, %v; want 2 instances", st, err)
	}
	if m, err := c.Mark(ctx, "b", "uid-b", "inst", true); err != nil || m.Installation != "inst" {
		t.Fatalf("Mark b = %+v, %v", m, err)
	}

	// A CONNECT through a's proxy reaches the target, and plain HTTP in
	// absolute form is forwarded.
	addr := net.JoinHostPort(a.Address, fmt.Sprint(port))
	tun, err := connect(addr, strings.TrimPrefix(target.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(tun, "GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(tun), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	tun.Close()
	if string(body) != "hello" {
		t.Fatalf("through the tunnel: %q", body)
	}
	pc := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(must(t, "http://"+addr))}}
	t.Cleanup(pc.CloseIdleConnections)
	r2, err := pc.Get(target.URL)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(r2.Body)
	r2.Body.Close()
	if string(body) != "hello" {
		t.Fatalf("forwarded: %q", body)
	}

	// An address no instance holds serves nothing.
	unheld := netip.AddrPortFrom(network.Addr().Next().Next().Next().Next().Next(), uint16(port))
	if unheld.Addr().String() == a.Address || unheld.Addr().String() == b.Address {
		t.Fatalf("test bug: %s is held", unheld)
	}
	if _, err := connect(unheld.String(), strings.TrimPrefix(target.URL, "http://")); err == nil {
		t.Fatalf("CONNECT through %s, which no instance holds, succeeded", unheld)
	}

	// Deleted: gone from the API, and its proxy serves no more.
	if err := c.Delete(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if err := c.Delete(ctx, "a"); !farm.IsStatus(err, http.StatusNotFound) {
		t.Fatalf("second delete: %v, want 404", err)
	}
	if _, err := c.Get(ctx, "a"); !farm.IsStatus(err, http.StatusNotFound) {
		t.Fatalf("Get after delete: %v, want 404", err)
	}
	if _, err := connect(addr, strings.TrimPrefix(target.URL, "http://")); err == nil {
		t.Fatal("CONNECT through a deleted instance succeeded")
	}
	if f.Len() != 1 {
		t.Fatalf("%d instances, want 1", f.Len())
	}
}

func TestNetworkFullIsNoAddress(t *testing.T) {
	t.Parallel()
	port := freePort(t)
	_, c := newFarm(t, port)
	ctx := context.Background()
	one := netip.PrefixFrom(freeNetwork().Addr().Next(), 32)
	if _, err := c.Create(ctx, farm.Instance{ID: "x", Marked: true, Port: port}, one); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Create(ctx, farm.Instance{ID: "y", Marked: true, Port: port}, one); !farm.IsStatus(err, http.StatusInsufficientStorage) {
		t.Fatalf("create in a full network: %v, want 507", err)
	}
	if _, err := c.Create(ctx, farm.Instance{ID: "z", Marked: true, Port: port}, netip.MustParsePrefix("10.0.0.0/8")); !farm.IsStatus(err, http.StatusBadRequest) {
		t.Fatalf("create outside loopback: %v, want 400", err)
	}
}

func must(t *testing.T, raw string) *url.URL {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return u
}
