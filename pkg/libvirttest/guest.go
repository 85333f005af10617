package libvirttest

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/xml"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// GuestImage is a bootable guest served over HTTP: see ServeGuestImage.
type GuestImage struct {
	URL, SHA256 string
	// Path is the cached image on this machine.
	Path string
}

// ServeGuestImage builds (or reuses, from the cache outside the checkout)
// the bootable test guest with scripts/kvm-guest-image.sh and serves it.
// The guest boots with BIOS firmware, takes an address by DHCP on its
// NIC's network (see StartDHCP) and then pings the router every few
// seconds; it runs no guest agent.
func (e *Env) ServeGuestImage() GuestImage {
	e.t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		e.t.Fatal("libvirttest: cannot locate the repository's scripts")
	}
	script := filepath.Join(filepath.Dir(file), "..", "..", "scripts", "kvm-guest-image.sh")
	out, err := exec.Command(script).Output()
	if err != nil {
		msg := err.Error()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			msg = strings.TrimSpace(string(ee.Stderr))
		}
		e.t.Fatalf("libvirttest: building the guest image: %s; %s", msg, installHint)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	p := lines[len(lines)-1]
	body, err := os.ReadFile(p)
	if err != nil {
		e.t.Fatal(err)
	}
	sum := sha256.Sum256(body)
	return GuestImage{URL: e.serve("guest.qcow2", body), SHA256: hex.EncodeToString(sum[:]), Path: p}
}

// serve serves body at /name on a server of the test's own and returns
// its URL; every download counts in ImageHits.
func (e *Env) serve(name string, body []byte) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		e.imageHits++
		e.mu.Unlock()
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body)
	}))
	e.t.Cleanup(srv.Close)
	return srv.URL + "/" + name
}

// StartDHCP gives the env's bridge the first address of a /24 that no
// interface or route of this machine uses and runs dnsmasq on it as the
// bridge's DHCP server (no DNS). It returns the bridge's address, which
// is the leases' router. dnsmasq is stopped when the test ends.
func (e *Env) StartDHCP() string {
	t := e.t
	t.Helper()
	if _, err := exec.LookPath("dnsmasq"); err != nil {
		t.Fatalf("libvirttest: dnsmasq is missing (apt-get install dnsmasq-base): %s", installHint)
	}
	prefix := e.freeSubnet()
	router := prefix + ".1"
	run(t, "ip", "addr", "add", router+"/24", "dev", e.Bridge)
	e.leaseFile = filepath.Join(e.Dir, "dnsmasq.leases")
	logFile := filepath.Join(e.Dir, "dnsmasq.log")
	// dnsmasq writes its log (with every DHCP exchange) to logFile,
	// anything before that to its output.
	exited := e.startDaemon("dnsmasq on "+e.Bridge+" ("+prefix+".0/24)", filepath.Join(e.Dir, "dnsmasq.out"),
		"dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--port=0",
		"--bind-interfaces", "--interface="+e.Bridge, "--except-interface=lo",
		"--dhcp-range="+prefix+".50,"+prefix+".250,255.255.255.0,1h", "--dhcp-authoritative",
		"--dhcp-leasefile="+e.leaseFile, "--pid-file=", "--user=root", "--group=root",
		"--log-dhcp", "--log-facility="+logFile)
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(logFile)
			t.Logf("dnsmasq log:\n%s", b)
		}
	})
	// dnsmasq logs its start once its DHCP socket is bound.
	deadline := time.Now().Add(10 * time.Second)
	for {
		select {
		case <-exited:
			o, _ := os.ReadFile(filepath.Join(e.Dir, "dnsmasq.out"))
			b, _ := os.ReadFile(logFile)
			t.Fatalf("dnsmasq on %s exited: %s%s", e.Bridge, o, b)
		default:
		}
		if b, _ := os.ReadFile(logFile); strings.Contains(string(b), "DHCP, sockets bound") {
			return router
		}
		if time.Now().After(deadline) {
			t.Fatalf("dnsmasq on %s did not start in 10s", e.Bridge)
		}
		time.Sleep(20 * time.Millisecond) // polling a log file being written
	}
}

// freeSubnet picks 10.x.y (a /24) that no local address or route is in.
func (e *Env) freeSubnet() string {
	used := run(e.t, "ip", "-4", "-o", "addr", "show") + run(e.t, "ip", "-4", "route", "show", "table", "all")
	for range 100 {
		p := fmt.Sprintf("10.%d.%d", 64+rand.IntN(64), rand.IntN(256)) //nolint:gosec // not a secret
		if !strings.Contains(used, p+".") {
			return p
		}
	}
	e.t.Fatal("libvirttest: no free 10.x.y.0/24 for the bridge")
	return ""
}

// Leases are dnsmasq's current leases, MAC (lower case) → address.
func (e *Env) Leases() map[string]string {
	out := map[string]string{}
	f, err := os.Open(e.leaseFile)
	if err != nil {
		return out
	}
	defer func() { _ = f.Close() }()
	s := bufio.NewScanner(f)
	for s.Scan() {
		// expiry MAC address hostname client-id
		if fs := strings.Fields(s.Text()); len(fs) >= 3 {
			if mac, err := net.ParseMAC(fs[1]); err == nil {
				out[mac.String()] = fs[2]
			}
		}
	}
	return out
}

// DomainMAC is the MAC address of the domain's first NIC, lower case.
func (e *Env) DomainMAC(name string) string {
	var d struct {
		Interfaces []struct {
			MAC struct {
				Address string `xml:"address,attr"`
			} `xml:"mac"`
		} `xml:"devices>interface"`
	}
	if err := xml.Unmarshal([]byte(e.DomainXML(name)), &d); err != nil {
		e.t.Fatal(err)
	}
	if len(d.Interfaces) == 0 {
		e.t.Fatalf("domain %s has no NIC", name)
	}
	mac, err := net.ParseMAC(d.Interfaces[0].MAC.Address)
	if err != nil {
		e.t.Fatalf("domain %s: NIC MAC: %v", name, err)
	}
	return mac.String()
}

// ConsoleLog is what the domain wrote to its serial console.
func (e *Env) ConsoleLog(name string) string {
	b, _ := os.ReadFile(filepath.Join(e.ConsoleDir, name+".log"))
	return string(b)
}
