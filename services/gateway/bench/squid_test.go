//go:build bench

package bench

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/proctest"
)

// squidBinary is Squid's path when it is installed (on PATH or where
// Debian puts it), "" when not.
func squidBinary() string {
	if p, err := exec.LookPath("squid"); err == nil {
		return p
	}
	if _, err := os.Stat("/usr/sbin/squid"); err == nil {
		return "/usr/sbin/squid"
	}
	return ""
}

// squidConfig is a Squid that only relays: every CONNECT and request goes
// to one of the farm's proxies in turn (round robin over parents, never
// straight to the target), nothing is cached or logged per request, and
// there are no port ACLs, so a CONNECT to any port is allowed (it listens
// on loopback only).
func squidConfig(dir, listen, effectiveUser string, farm []*farmProxy) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "http_port %s\n", listen)
	for i, p := range farm {
		host, port, err := net.SplitHostPort(p.addr)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(&b, "cache_peer %s parent %s 0 no-query no-digest round-robin name=p%d\n", host, port, i)
	}
	b.WriteString(`never_direct allow all
http_access allow all
cache deny all
cache_mem 0
access_log none
client_db off
netdb_filename none
digest_generation off
pinger_enable off
shutdown_lifetime 0 seconds
max_filedescriptors 16384
workers 1
`)
	fmt.Fprintf(&b, "cache_log %s\npid_filename %s\ncoredump_dir %s\n",
		filepath.Join(dir, "cache.log"), filepath.Join(dir, "squid.pid"), dir)
	if effectiveUser != "" {
		fmt.Fprintf(&b, "cache_effective_user %s\n", effectiveUser)
	}
	return b.String(), nil
}

// startSquid starts Squid in the foreground (-N: one process, no
// daemon, so its CPU time and RSS are one /proc entry) in front of the
// farm and returns it and its listening address. As root Squid drops to
// an unprivileged user, which must be able to write its log and pid file:
// its directory is made under os.TempDir (t.TempDir's parent is private
// to root) and given to that user.
func startSquid(t *testing.T, bin string, farm []*farmProxy) (*proctest.Process, string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "gwbench-squid-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	effectiveUser := ""
	if os.Geteuid() == 0 {
		for _, name := range []string{"proxy", "nobody"} {
			u, err := user.Lookup(name)
			if err != nil {
				continue
			}
			uid, _ := strconv.Atoi(u.Uid)
			gid, _ := strconv.Atoi(u.Gid)
			if err := os.Chown(dir, uid, gid); err != nil {
				t.Fatal(err)
			}
			effectiveUser = name
			break
		}
		if effectiveUser == "" {
			t.Fatal("squid: running as root and neither user proxy nor nobody exists for cache_effective_user")
		}
	}
	addr := freeLoopbackAddr(t)
	conf, err := squidConfig(dir, addr, effectiveUser, farm)
	if err != nil {
		t.Fatal(err)
	}
	confPath := filepath.Join(dir, "squid.conf")
	if err := os.WriteFile(confPath, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	p := proctest.Start(t, bin, []string{"-N", "-f", confPath})
	t.Cleanup(func() {
		if t.Failed() {
			if b, err := os.ReadFile(filepath.Join(dir, "cache.log")); err == nil {
				t.Logf("squid cache.log:\n%s", b)
			}
		}
	})
	return p, addr
}

// squidVersion is the first line of `squid -v` ("Squid Cache: Version
// 5.7").
func squidVersion(bin string) string {
	out, err := exec.Command(bin, "-v").Output()
	if err != nil {
		return "version unknown"
	}
	line, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimSpace(line)
}
