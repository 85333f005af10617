package proxmox

import (
	"context"
	"fmt"
	"testing"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
)

// The API calls and time of a fresh Create, a running Get and a Delete
// against the fake (docs/provisioner-proxmox.md records the figures).
// Tasks end at once on the fake, so this is the provisioner's own cost
// plus TLS/HTTP on loopback, not Proxmox's.

func BenchmarkCreate(b *testing.B) {
	e := newEnv(b, nil)
	ctx := context.Background()
	e.fake.ResetCalls()
	b.ResetTimer()
	for i := range b.N {
		if _, err := e.be.Create(ctx, createReq(fmt.Sprintf("be0c0000-0000-4000-8000-%012d", i))); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(e.fake.TotalCalls())/float64(b.N), "calls/op")
}

func BenchmarkGet(b *testing.B) {
	e := newEnv(b, nil)
	ctx := context.Background()
	in, err := e.be.Create(ctx, createReq("be0c0000-0000-4000-8000-000000000000"))
	if err != nil {
		b.Fatal(err)
	}
	req := &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: in.GetProxyUid()}
	e.fake.ResetCalls()
	b.ResetTimer()
	for range b.N {
		if _, err := e.be.Get(ctx, req); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(e.fake.TotalCalls())/float64(b.N), "calls/op")
}

func BenchmarkDelete(b *testing.B) {
	e := newEnv(b, nil)
	ctx := context.Background()
	reqs := make([]*provisionerv1.DeleteInstanceRequest, b.N)
	for i := range b.N {
		in, err := e.be.Create(ctx, createReq(fmt.Sprintf("be0c0000-0000-4000-8000-%012d", i)))
		if err != nil {
			b.Fatal(err)
		}
		reqs[i] = &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: in.GetProxyUid()}
	}
	e.fake.ResetCalls()
	b.ResetTimer()
	for i := range b.N {
		if ok, err := e.be.Delete(ctx, reqs[i]); err != nil || !ok {
			b.Fatal(ok, err)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(e.fake.TotalCalls())/float64(b.N), "calls/op")
}
