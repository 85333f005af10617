//go:build bench

package bench

import (
	"net"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/proctest"
)

// peerKind is a forward proxy the bench can measure beside the gateway
// in front of the same farm, its rows' mode named after it.
type peerKind struct {
	name    string
	find    func() string // its binary's path, "" when not installed
	version func(bin string) string
	start   func(t *testing.T, bin string, farm []*farmProxy) (*proctest.Process, string)
}

var peerKinds = []peerKind{
	{"squid", squidBinary, squidVersion, startSquid},
	{"glider", gliderBinary, gliderVersion, startGlider},
}

// peer is an installed peerKind.
type peer struct {
	peerKind
	bin, version string
}

// choosePeers reads BENCH_PEER: unset, every peer that is installed;
// "none", no peer; otherwise the peers it names (spaces or commas
// between), each of which must be installed.
func choosePeers(t *testing.T) []peer {
	t.Helper()
	v := os.Getenv("BENCH_PEER")
	names := strings.Fields(strings.ReplaceAll(v, ",", " "))
	if slices.Equal(names, []string{"none"}) {
		return nil
	}
	for _, n := range names {
		if !slices.ContainsFunc(peerKinds, func(k peerKind) bool { return k.name == n }) {
			t.Fatalf("BENCH_PEER: %q is none of squid, glider, none", n)
		}
	}
	var peers []peer
	for _, k := range peerKinds {
		asked := slices.Contains(names, k.name)
		if len(names) > 0 && !asked {
			continue
		}
		bin := k.find()
		if bin == "" {
			if asked {
				t.Fatalf("BENCH_PEER asks for %s, which is not installed", k.name)
			}
			continue
		}
		peers = append(peers, peer{peerKind: k, bin: bin, version: k.version(bin)})
	}
	return peers
}

// freeLoopbackAddr is a loopback address whose port was free a moment
// ago, for a peer that must be told where to listen.
func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
