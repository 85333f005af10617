//go:build bench

package bench

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/proctest"
)

// gliderBinary is glider's path when it is on PATH, "" when not. glider
// (github.com/nadoo/glider) is a forward proxy in Go that rotates over
// upstream proxies; it is not packaged for Debian, so it is measured
// only where someone has built it and put it on PATH.
func gliderBinary() string {
	p, err := exec.LookPath("glider")
	if err != nil {
		return ""
	}
	return p
}

// startGlider starts glider with an HTTP proxy listener (CONNECT and
// absolute-URI requests) in front of the farm: every farm proxy a
// forwarder, chosen round robin, its health check off (the default
// checks a public address, which this machine cannot reach, and would
// take every forwarder out). glider carries each plain-HTTP request
// over a CONNECT tunnel through the farm proxy it chose, one request
// per client connection.
func startGlider(t *testing.T, bin string, farm []*farmProxy) (*proctest.Process, string) {
	t.Helper()
	addr := freeLoopbackAddr(t)
	args := []string{"-listen", "http://" + addr, "-strategy", "rr", "-check", "disable"}
	for _, p := range farm {
		args = append(args, "-forward", "http://"+p.addr)
	}
	return proctest.Start(t, bin, args), addr
}

// gliderVersion is the version line its usage text ends with ("glider
// 0.17.0, https://…").
func gliderVersion(bin string) string {
	out, _ := exec.Command(bin, "-help").CombinedOutput()
	for _, line := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(line, "glider ") {
			v, _, _ := strings.Cut(line, ",")
			return v
		}
	}
	return "version unknown"
}
