package kvm

// Benchmarks against the real libvirtd through the real sshd (see
// live_test.go). They report wall time and libvirt calls per operation;
// the figures are in docs/provisioner-kvm.md. Run with
//
//	go test -run '^$' -bench BenchmarkLive -benchtime 5x ./services/provisioner-kvm/internal/kvm/

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/libvirttest"
)

// callCounter counts the trace's "libvirt call" records.
type callCounter struct{ n atomic.Int64 }

func (c *callCounter) Enabled(context.Context, slog.Level) bool { return true }
func (c *callCounter) Handle(_ context.Context, r slog.Record) error {
	if r.Message == "libvirt call" {
		c.n.Add(1)
	}
	return nil
}
func (c *callCounter) WithAttrs([]slog.Attr) slog.Handler { return c }
func (c *callCounter) WithGroup(string) slog.Handler      { return c }

func BenchmarkLive(b *testing.B) {
	env := libvirttest.New(b)
	var calls callCounter
	cfg := Config{
		Hosts:        []Host{{Name: "h1", Address: env.SSHAddress, User: env.User, KeyFile: env.KeyFile, KnownHostsFile: env.KnownHostsFile, Socket: env.Socket, Bridge: env.Bridge, Pool: env.Pool, ConsoleLogDir: env.ConsoleDir}},
		DomainType:   DomainQEMU,
		Images:       map[string]Image{"tiny": {URL: env.ImageURL, SHA256: env.ImageSHA256, Firmware: FirmwareBIOS}},
		MachineTypes: map[string]MachineType{"small": {VCPUs: 1, MemoryMiB: 128, DiskSizeGB: 1}},
	}
	be, err := New("kvm-bench", cfg, slog.New(&calls), Options{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(be.Close)
	ctx := context.Background()
	// Warm: the connection and the cached base image.
	if _, err := be.List(ctx); err != nil {
		b.Fatal(err)
	}
	seq := 0
	create := func(b *testing.B) *provisionerv1.Instance {
		seq++
		in, err := be.Create(ctx, createReq(fmt.Sprintf("bench-%d-%d", time.Now().UnixNano(), seq), "tiny"))
		if err != nil {
			b.Fatal(err)
		}
		return in
	}
	del := func(b *testing.B, in *provisionerv1.Instance) {
		if _, err := be.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: in.GetProxyUid()}); err != nil {
			b.Fatal(err)
		}
	}
	measure := func(b *testing.B, op func(b *testing.B) func()) {
		var n int64
		for b.Loop() {
			b.StopTimer()
			before := calls.n.Load()
			b.StartTimer()
			after := op(b)
			b.StopTimer()
			n += calls.n.Load() - before
			if after != nil {
				after()
			}
			b.StartTimer()
		}
		b.ReportMetric(float64(n)/float64(b.N), "calls/op")
	}
	// The first Create of a key also downloads and uploads the base; this
	// is the steady state with the base cached.
	warm := create(b)
	del(b, warm)
	b.Run("Create", func(b *testing.B) {
		measure(b, func(b *testing.B) func() { in := create(b); return func() { del(b, in) } })
	})
	b.Run("Get", func(b *testing.B) {
		in := create(b)
		defer del(b, in)
		req := &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: in.GetProxyUid()}
		measure(b, func(b *testing.B) func() {
			if _, err := be.Get(ctx, req); err != nil {
				b.Fatal(err)
			}
			return nil
		})
	})
	b.Run("Delete", func(b *testing.B) {
		var pending *provisionerv1.Instance
		for b.Loop() {
			b.StopTimer()
			pending = create(b)
			before := calls.n.Load()
			b.StartTimer()
			del(b, pending)
			b.StopTimer()
			b.ReportMetric(float64(calls.n.Load()-before), "calls/op")
			b.StartTimer()
		}
	})
	b.Run("List100", func(b *testing.B) {
		// 100 marked domains, defined but not started: List reads marks
		// and states, it never looks at the guests.
		err := be.hosts.call(ctx, cfg.Hosts[0].withTestDefaults(), func(api libvirtAPI) error {
			for i := range 100 {
				name := fmt.Sprintf("proxy-list-%d-%03d", time.Now().UnixNano(), i)
				b.Cleanup(func() { env.RemoveDomain(name) })
				x, err := domainXML(domainSpec{Name: name, Type: DomainQEMU, VCPUs: 1, MemoryMiB: 64, Firmware: FirmwareBIOS,
					OverlayPath: env.PoolDir + "/none.qcow2", SeedPath: env.PoolDir + "/none.iso", Bridge: env.Bridge,
					ConsoleLog: env.ConsoleDir + "/" + name + ".log", Mark: markXML("kvm-bench", "", name, time.Now())})
				if err != nil {
					return err
				}
				if _, err := api.DomainDefineXML(x); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
		measure(b, func(b *testing.B) func() {
			list, err := be.List(ctx)
			if err != nil || len(list) < 100 {
				b.Fatalf("List = %d, %v", len(list), err)
			}
			return nil
		})
	})
}

func (h Host) withTestDefaults() Host {
	return Config{Hosts: []Host{h}}.WithDefaults().Hosts[0]
}
