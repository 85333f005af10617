package lifecycle

import (
	"testing"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// BenchmarkConvergeOneProxy runs the rules one proxy goes through from
// creation to Ready and one resync: Decide (Create), Apply (running),
// ApplyHealth (healthy), Decide (Get), Apply (running). The CPU cost of the
// state machine itself, without database or NATS:
//
//	go test -run '^$' -bench BenchmarkConvergeOneProxy -benchmem ./services/orchestrator/internal/lifecycle/
func BenchmarkConvergeOneProxy(b *testing.B) {
	m := machine()
	verdict := healthVerdict()
	b.ReportAllocs()
	for range b.N {
		p := &Proxy{
			UID: "u1", Name: "p1", Generation: 1, SpecHash: "h1", Phase: pending, Port: 3128,
			Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve", Port: 3128},
		}
		now := t0
		create := m.Decide(p, now).Command
		now = now.Add(time.Second)
		m.Apply(p, result(create, nil, runningInst), now)
		verdict.ProviderId = p.ProviderID
		ApplyHealth(p, verdict, now)
		now = now.Add(m.Timing.Resync)
		get := m.Decide(p, now).Command
		m.Apply(p, result(get, nil, runningInst), now.Add(time.Second))
		if p.Phase != ready {
			b.Fatalf("phase %v, want READY", p.Phase)
		}
	}
}
