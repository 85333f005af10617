package dispatch

import (
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// An event encoded around its stored snapshot decodes to the event with
// the snapshot decoded into it.
func TestEncodeEvent(t *testing.T) {
	t.Parallel()
	proxy := &proxyv1.Proxy{
		Uid: "0b6f1f4e-8d3c-4c55-9a55-7a0e0e0e0e0e", Name: "p1", Labels: map[string]string{"team": "a"},
		Revision: 42, Etag: "42", Spec: &proxyv1.ProxySpec{Provider: "fake"},
		Status: &proxyv1.ProxyStatus{Phase: proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, Ip: "10.0.0.1", Port: 3128},
	}
	snap, err := proto.Marshal(proxy)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		c    store.EncodedChange
	}{
		{"updated", store.EncodedChange{Revision: 42, Type: proxyv1.ChangeType_CHANGE_TYPE_UPDATED, Snapshot: snap, Time: time.Date(2026, 12, 6, 8, 0, 0, 123456000, time.UTC)}},
		{"whole second", store.EncodedChange{Revision: 1 << 40, Type: proxyv1.ChangeType_CHANGE_TYPE_DELETED, Snapshot: snap, Time: time.Date(2026, 12, 6, 8, 0, 0, 0, time.UTC)}},
		{"empty snapshot, zero time", store.EncodedChange{Revision: 7, Type: proxyv1.ChangeType_CHANGE_TYPE_CREATED, Time: time.Unix(0, 0)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			decoded := &proxyv1.Proxy{}
			if err := proto.Unmarshal(tc.c.Snapshot, decoded); err != nil {
				t.Fatal(err)
			}
			want := &busv1.ProxyEvent{Revision: tc.c.Revision, Type: tc.c.Type, Proxy: decoded, ChangeTime: timestamppb.New(tc.c.Time)}
			got, err := encodeEvent(tc.c)
			if err != nil {
				t.Fatal(err)
			}
			ev := &busv1.ProxyEvent{}
			if err := proto.Unmarshal(got, ev); err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(ev, want) {
				t.Errorf("decoded %v\nwant    %v", ev, want)
			}
		})
	}
}

// BenchmarkEncodeEvent compares a ProxyEvent encoded around its stored
// snapshot (as the outbox does) with the snapshot decoded and the event
// encoded again (as it did before).
func BenchmarkEncodeEvent(b *testing.B) {
	now := time.Date(2026, 12, 6, 8, 0, 0, 123456000, time.UTC)
	snap, err := proto.Marshal(&proxyv1.Proxy{
		Uid: "0b6f1f4e-8d3c-4c55-9a55-7a0e0e0e0e0e", Name: "bench-000001", Labels: map[string]string{"team": "a"},
		Revision: 42, Etag: "42", Generation: 1, CreateTime: timestamppb.New(now), UpdateTime: timestamppb.New(now),
		Spec: &proxyv1.ProxySpec{Provider: "fake", Port: 3128},
		Status: &proxyv1.ProxyStatus{Phase: proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, ProviderId: "fake-0b6f1f4e", Ip: "10.0.0.1",
			Port: 3128, Reason: "Running", ObservedGeneration: 1, PhaseTransitionTime: timestamppb.New(now), CredentialsTime: timestamppb.New(now)},
	})
	if err != nil {
		b.Fatal(err)
	}
	c := store.EncodedChange{Revision: 42, Type: proxyv1.ChangeType_CHANGE_TYPE_UPDATED, Snapshot: snap, Time: now}
	b.Run("stored", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := encodeEvent(c); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decoded", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			p := &proxyv1.Proxy{}
			if err := proto.Unmarshal(c.Snapshot, p); err != nil {
				b.Fatal(err)
			}
			if _, err := proto.Marshal(&busv1.ProxyEvent{Revision: c.Revision, Type: c.Type, Proxy: p, ChangeTime: timestamppb.New(c.Time)}); err != nil {
				b.Fatal(err)
			}
		}
	})
}
