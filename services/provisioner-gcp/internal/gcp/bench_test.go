package gcp

import (
	"context"
	"fmt"
	"testing"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/proto"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
)

// The benchmarks run the backend through the real SDK against the fake
// and report API calls per operation next to the time; the "raw SDK"
// ones make the same request without the backend, so the difference is
// the provisioner's own overhead per call. Figures: docs/provisioner-gcp.md.

func reportCalls(b *testing.B, e *env, before int) {
	b.ReportMetric(float64(len(e.fake.Requests())-before)/float64(b.N), "api-calls/op")
}

func BenchmarkCreate(b *testing.B) {
	e := newEnv(b, nil)
	ctx := context.Background()
	before := len(e.fake.Requests())
	b.ResetTimer()
	for i := range b.N {
		if _, err := e.be.Create(ctx, createReq(fmt.Sprintf("bench-%d", i), zoneA)); err != nil {
			b.Fatal(err)
		}
	}
	reportCalls(b, e, before)
}

func BenchmarkGet(b *testing.B) {
	e := newEnv(b, nil)
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-g"), Status: proto.String("RUNNING"), Labels: ours("g"), NetworkInterfaces: nic()})
	ctx := context.Background()
	req := &provisionerv1.GetInstanceRequest{ProviderId: "zones/" + zoneA + "/instances/proxy-g", ProxyUid: "g"}
	if _, err := e.be.Get(ctx, req); err != nil { // builds the client
		b.Fatal(err)
	}
	before := len(e.fake.Requests())
	b.ResetTimer()
	for range b.N {
		if _, err := e.be.Get(ctx, req); err != nil {
			b.Fatal(err)
		}
	}
	reportCalls(b, e, before)
}

func BenchmarkGetRawSDK(b *testing.B) {
	e := newEnv(b, nil)
	e.fake.Put(zoneA, &computepb.Instance{Name: proto.String("proxy-g"), Status: proto.String("RUNNING"), Labels: ours("g"), NetworkInterfaces: nic()})
	ctx := context.Background()
	c, err := e.be.client(ctx)
	if err != nil {
		b.Fatal(err)
	}
	req := &computepb.GetInstanceRequest{Project: project, Zone: zoneA, Instance: "proxy-g"}
	b.ResetTimer()
	for range b.N {
		if _, err := c.instances.Get(ctx, req); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDelete(b *testing.B) {
	e := newEnv(b, nil)
	for i := range b.N {
		e.fake.Put(zoneA, &computepb.Instance{Name: proto.String(fmt.Sprintf("proxy-d%d", i)), Status: proto.String("RUNNING"), Labels: ours(fmt.Sprint("d", i))})
	}
	ctx := context.Background()
	before := len(e.fake.Requests())
	b.ResetTimer()
	for i := range b.N {
		if _, err := e.be.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: fmt.Sprintf("zones/%s/instances/proxy-d%d", zoneA, i), ProxyUid: fmt.Sprint("d", i)}); err != nil {
			b.Fatal(err)
		}
	}
	reportCalls(b, e, before)
}

// BenchmarkListPage lists 500 managed instances: one full page.
func BenchmarkListPage(b *testing.B) {
	e := newEnv(b, nil)
	for i := range 500 {
		e.fake.Put([]string{zoneA, zoneB}[i%2], &computepb.Instance{Name: proto.String(fmt.Sprintf("proxy-l%d", i)), Status: proto.String("RUNNING"), Labels: ours(fmt.Sprint("l", i)), NetworkInterfaces: nic()})
	}
	ctx := context.Background()
	if _, err := e.be.List(ctx); err != nil {
		b.Fatal(err)
	}
	before := len(e.fake.Requests())
	b.ResetTimer()
	for range b.N {
		got, err := e.be.List(ctx)
		if err != nil || len(got) != 500 {
			b.Fatal(len(got), err)
		}
	}
	reportCalls(b, e, before)
}

func BenchmarkListPageRawSDK(b *testing.B) {
	e := newEnv(b, nil)
	for i := range 500 {
		e.fake.Put([]string{zoneA, zoneB}[i%2], &computepb.Instance{Name: proto.String(fmt.Sprintf("proxy-l%d", i)), Status: proto.String("RUNNING"), Labels: ours(fmt.Sprint("l", i)), NetworkInterfaces: nic()})
	}
	ctx := context.Background()
	c, err := e.be.client(ctx)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for range b.N {
		it := c.instances.AggregatedList(ctx, &computepb.AggregatedListInstancesRequest{Project: project, Filter: proto.String(managedFilter), MaxResults: proto.Uint32(500)})
		n := 0
		for {
			pair, err := it.Next()
			if err != nil {
				break
			}
			n += len(pair.Value.GetInstances())
		}
		if n != 500 {
			b.Fatal(n)
		}
	}
}
