package app_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/app"
	lt "github.com/egress-proxies/egress-proxies/services/lease/internal/leasetest"
)

func inPool(pool string) func(*proxyv1.Proxy) {
	return func(p *proxyv1.Proxy) { p.Pool = pool; p.Labels["pool"] = pool }
}

func draining(p *proxyv1.Proxy) {
	p.Draining = true
	p.DrainTime = timestamppb.Now()
}

// lastDemand reads the latest demand report of a pool from NATS.
func lastDemand(t *testing.T, env *lt.Env, pool string) *busv1.PoolDemandEvent {
	t.Helper()
	js := env.NATS.JetStream(t)
	names := bus.Names{Prefix: env.Config.NATS.Prefix}
	s, err := js.Stream(context.Background(), names.DemandStream())
	if err != nil {
		return nil
	}
	m, err := s.GetLastMsgForSubject(context.Background(), names.DemandSubject(pool))
	if err != nil {
		return nil
	}
	ev := &busv1.PoolDemandEvent{}
	if err := proto.Unmarshal(m.Data, ev); err != nil {
		t.Fatal(err)
	}
	return ev
}

// demandReports collects every demand report of a pool published from now
// on; seen reports whether one of them satisfies cond. A refusal is in one
// report only, which the next replaces within a demand interval: reading
// the latest alone can miss it on a loaded machine.
func demandReports(t *testing.T, env *lt.Env, pool string) (seen func(cond func(*busv1.PoolDemandEvent) bool) bool) {
	t.Helper()
	js := env.NATS.JetStream(t)
	names := bus.Names{Prefix: env.Config.NATS.Prefix}
	cons, err := js.OrderedConsumer(lt.Ctx(t), names.DemandStream(), jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{names.DemandSubject(pool)}, DeliverPolicy: jetstream.DeliverNewPolicy})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var got []*busv1.PoolDemandEvent
	cc, err := cons.Consume(func(m jetstream.Msg) {
		ev := &busv1.PoolDemandEvent{}
		if err := proto.Unmarshal(m.Data(), ev); err == nil {
			mu.Lock()
			got = append(got, ev)
			mu.Unlock()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cc.Stop)
	return func(cond func(*busv1.PoolDemandEvent) bool) bool {
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range got {
			if cond(ev) {
				return true
			}
		}
		return false
	}
}

// Pools in the lease service: AcquireLease selects by pool, a draining
// proxy keeps its leases but gets no new one, and the demand on each pool
// (leases, capacity, refusals, leases per proxy) is published on NATS.
func TestPoolSelectionDrainingAndDemand(t *testing.T) {
	t.Parallel()
	env := lt.Start(t, lt.Options{Config: func(c *app.Config) { c.DemandInterval = 50 * time.Millisecond }})
	c := env.Client("grpc", "crawler-a")
	a1 := lt.Proxy("00000000-0000-4000-8000-0000000000a1", "web-aaaa1", inPool("web"))
	a2 := lt.Proxy("00000000-0000-4000-8000-0000000000a2", "web-aaaa2", inPool("web"))
	b1 := lt.Proxy("00000000-0000-4000-8000-0000000000b1", "solo")
	for _, p := range []*proxyv1.Proxy{a1, a2, b1} {
		env.Apply(t, p, 1)
	}
	web := &leasev1.ProxySelector{Pool: "web"}
	webReports := demandReports(t, env, "web")
	// The publisher's first report leaves out refusals counted before it
	// (another replica reported them); a slow start must not make the
	// refusal below that report's.
	waittest.For(t, 30*time.Second, "a first report of web's demand", func() bool {
		return webReports(func(*busv1.PoolDemandEvent) bool { return true })
	})
	got := map[string]string{} // proxy name -> lease id
	for range 2 {
		resp, r := c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{Selector: web})
		if r.Code() != codes.OK {
			t.Fatalf("acquire in pool web: %v", r.Status)
		}
		got[resp.GetLease().GetProxyName()] = resp.GetLease().GetLeaseId()
	}
	if got["web-aaaa1"] == "" || got["web-aaaa2"] == "" {
		t.Fatalf("pool web leased %v, want both of its proxies", got)
	}
	// The pool is full: refused, counted as its demand.
	if _, r := c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{Selector: web}); r.Code() != codes.ResourceExhausted {
		t.Fatalf("third acquire in web: %v, want RESOURCE_EXHAUSTED", r.Status)
	}
	waittest.For(t, 10*time.Second, "web's demand shows 2 leases and the refusal", func() bool {
		return webReports(func(ev *busv1.PoolDemandEvent) bool {
			d := ev.GetDemand()
			return d.GetActiveLeases() == 2 && d.GetLeasableProxies() == 2 && d.GetCapacity() == 2 &&
				ev.GetLeasesByProxy()[a1.GetUid()] == 1 && ev.GetLeasesByProxy()[a2.GetUid()] == 1 && d.GetRefusedAcquires() >= 1
		})
	})
	waittest.For(t, 10*time.Second, "the refusal is reported once", func() bool {
		return lastDemand(t, env, "web").GetDemand().GetRefusedAcquires() == 0
	})

	// Draining: a1 keeps its lease, leaves the leasable list, and a freed
	// place on it is not handed out again.
	a1d := proto.Clone(a1).(*proxyv1.Proxy)
	draining(a1d)
	env.Apply(t, a1d, 2)
	if listed(t, c)["web-aaaa1"] {
		t.Fatal("a draining proxy is listed as leasable")
	}
	waittest.For(t, 10*time.Second, "web's demand counts one leasable proxy and a1's lease", func() bool {
		ev := lastDemand(t, env, "web")
		return ev.GetDemand().GetLeasableProxies() == 1 && ev.GetLeasesByProxy()[a1.GetUid()] == 1
	})
	// Proxies of no pool are reported under the empty pool.
	waittest.For(t, 10*time.Second, "the demand of proxies of no pool", func() bool {
		ev := lastDemand(t, env, "")
		return ev != nil && ev.GetDemand().GetLeasableProxies() == 1
	})
	// Releasing a1's lease: the demand shows no lease on it (the
	// orchestrator then deletes it), and the free place is not leased.
	if _, r := c.Release(lt.Ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: got["web-aaaa1"]}); r.Code() != codes.OK {
		t.Fatal(r.Status)
	}
	waittest.For(t, 10*time.Second, "a1 shows no lease", func() bool {
		ev := lastDemand(t, env, "web")
		_, held := ev.GetLeasesByProxy()[a1.GetUid()]
		return !held && ev.GetDemand().GetActiveLeases() == 1
	})
	if resp, r := c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{Selector: web}); r.Code() != codes.ResourceExhausted {
		t.Fatalf("acquire with only a draining proxy free: %v %v, want RESOURCE_EXHAUSTED", resp, r.Status)
	}
}
