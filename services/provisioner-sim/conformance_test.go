package main

import (
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
	"github.com/egress-proxies/egress-proxies/services/provisioner-sim/internal/farm"
)

var binary = provisionertest.Binary{Package: ".", Service: "provisioner-sim"}

// startFarm runs `provisioner-sim farm` as a process of the test's and
// returns its API URL and a client.
func startFarm(t *testing.T) (string, *farm.Client) {
	t.Helper()
	p := proctest.Start(t, proctest.Build(t, "."), []string{"farm", "--listen=127.0.0.1:0"})
	ready := p.WaitLog(t, time.Minute, proctest.Msg("farm ready"))
	api, _ := ready["api"].(string)
	c := farm.NewClient(api)
	t.Cleanup(c.HTTP.CloseIdleConnections)
	return api, c
}

// freeNetwork is a /24 of loopback of the test's own (127.100-129.x.0).
func freeNetwork() netip.Prefix {
	b := make([]byte, 2)
	_, _ = rand.Read(b)
	return netip.MustParsePrefix(fmt.Sprintf("127.%d.%d.0/24", 100+int(b[0])%30, b[1]))
}

func simBlock(api string, network netip.Prefix) string {
	return fmt.Sprintf("sim: {farm: %q, network: %s}\n", api, network)
}

// The contract on a farm process: the farm is the backend's truth, read
// by the test without the provisioner.
func TestConformance(t *testing.T) {
	t.Parallel()
	api, fc := startFarm(t)
	network := freeNetwork()
	ctx := context.Background()
	id := func(uid string) string { return "sim-" + uid }
	provisionertest.TestAll(t, provisionertest.Tester{
		Binary:  binary,
		Type:    "sim",
		Backend: func(*testing.T) string { return simBlock(api, network) },
		Observe: func(t *testing.T, uid string) provisionertest.Observed {
			var o provisionertest.Observed
			in, err := fc.Get(ctx, id(uid))
			if farm.IsStatus(err, http.StatusNotFound) {
				return o
			}
			if err != nil {
				t.Fatal(err)
			}
			o.Instances = append(o.Instances, fmt.Sprintf("instance %s marked=%v", in.ID, in.Marked))
			if c, err := net.DialTimeout("tcp", net.JoinHostPort(in.Address, fmt.Sprint(in.Port)), 5*time.Second); err == nil {
				_ = c.Close()
				o.Parts = append(o.Parts, "proxy listening")
			}
			return o
		},
		// An instance of the proxy's id that no provisioner made.
		Foreign: func(t *testing.T, uid string) provisionertest.Foreign {
			if _, err := fc.Create(ctx, farm.Instance{ID: id(uid), Name: "someone's", Port: 3128}, network); err != nil {
				t.Fatal(err)
			}
			return provisionertest.Foreign{ProviderID: id(uid), Unchanged: func() error {
				in, err := fc.Get(ctx, id(uid))
				if err != nil || in.Marked || in.ProxyUID != "" || in.Name != "someone's" {
					return fmt.Errorf("the instance is %+v (%v), want it unmarked as made", in, err)
				}
				return nil
			}}
		},
		// The mark as written before installations: without one.
		Unclaim: func(t *testing.T, uid string) {
			if _, err := fc.Mark(ctx, id(uid), uid, "", true); err != nil {
				t.Fatal(err)
			}
		},
		// A farm nothing answers at.
		Unreachable: func(t *testing.T) provisionertest.Outage {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			down := "http://" + l.Addr().String()
			_ = l.Close()
			return provisionertest.Outage{Backend: simBlock(down, freeNetwork())}
		},
		// A network of one address, taken on the proxy's port.
		Quota: func(t *testing.T) provisionertest.Quota {
			one := netip.PrefixFrom(freeNetwork().Addr().Next(), 32)
			if _, err := fc.Create(ctx, farm.Instance{ID: "quota-" + one.Addr().String(), Port: 3128}, one); err != nil {
				t.Fatal(err)
			}
			return provisionertest.Quota{Backend: simBlock(api, one)}
		},
	})
}
