package membership_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/membership"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestOwner_spreadsAndMovesLittle(t *testing.T) {
	t.Parallel()
	const n = 10000
	three := []string{"health-a", "health-b", "health-c"}
	counts := map[string]int{}
	owners := make([]string, n)
	for i := range n {
		uid := fmt.Sprintf("3f1c2a9e-%04d-4d1e-9c7a-%012d", i%7, i)
		owners[i] = membership.Owner(three, uid)
		counts[owners[i]]++
	}
	for _, id := range three {
		if c := counts[id]; c < n/3-n/15 || c > n/3+n/15 {
			t.Errorf("%s owns %d of %d, want about a third", id, c, n)
		}
	}
	// health-c dies: only its proxies move, spread over the others.
	two := three[:2]
	moved := 0
	for i := range n {
		uid := fmt.Sprintf("3f1c2a9e-%04d-4d1e-9c7a-%012d", i%7, i)
		now := membership.Owner(two, uid)
		if owners[i] != "health-c" && now != owners[i] {
			t.Fatalf("proxy %s moved from a live replica %s to %s", uid, owners[i], now)
		}
		if owners[i] == "health-c" {
			moved++
		}
	}
	if moved != counts["health-c"] {
		t.Errorf("moved %d, want %d", moved, counts["health-c"])
	}
	if got := membership.Owner(nil, "x"); got != "" {
		t.Errorf("Owner with no members = %q, want none", got)
	}
}

func TestBucket(t *testing.T) {
	t.Parallel()
	if got := membership.Bucket(bus.Names{}); got != "EGRESS_HEALTH_MEMBERS" {
		t.Errorf("Bucket = %s", got)
	}
	if got := membership.Bucket(bus.Names{Prefix: "test-1.a"}); got != "TEST_1_A_HEALTH_MEMBERS" {
		t.Errorf("Bucket = %s", got)
	}
}

// TestMembership_joinLeaveDie runs real members against JetStream: a
// joining replica is seen by the other, one that stops is gone at once,
// one whose connection dies is gone after the TTL.
func TestMembership_joinLeaveDie(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	names := bus.Names{Prefix: "m"}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := func(id string, nc *nats.Conn) (*membership.Membership, context.CancelFunc, chan error) {
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		m := &membership.Membership{ID: id, TTL: 3 * time.Second, Log: slog.New(slog.DiscardHandler)}
		mctx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- m.Run(mctx, js, names) }()
		return m, stop, done
	}
	a, stopA, doneA := start("a", ns.Connect(t))
	b, stopB, doneB := start("b", ns.Connect(t))
	both := []string{"a", "b"}
	waittest.For(t, 20*time.Second, "both to see both", func() bool { return slices.Equal(a.Members(), both) && slices.Equal(b.Members(), both) })

	ownedBy := func(m *membership.Membership) int {
		n := 0
		for i := range 1000 {
			if m.Owns(fmt.Sprint(i)) {
				n++
			}
		}
		return n
	}
	if oa, ob := ownedBy(a), ownedBy(b); oa+ob != 1000 || oa == 0 || ob == 0 {
		t.Errorf("a owns %d, b owns %d; want every proxy owned by exactly one of them", oa, ob)
	}

	// b stops cleanly: a sees it leave without waiting for the TTL.
	left := time.Now()
	stopB()
	if err := <-doneB; err != nil {
		t.Fatal(err)
	}
	waittest.For(t, 20*time.Second, "a to see b leave", func() bool { return slices.Equal(a.Members(), []string{"a"}) })
	if took := time.Since(left); took > 1500*time.Millisecond {
		t.Errorf("a clean leave took %s to be seen, want well under the TTL", took)
	}
	if ownedBy(a) != 1000 {
		t.Errorf("a owns %d of 1000 alone", ownedBy(a))
	}

	// c dies: its connection goes without a goodbye; its key expires.
	cConn, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	c, stopC, doneC := start("c", cConn)
	defer stopC()
	waittest.For(t, 20*time.Second, "a and c to see each other", func() bool {
		return slices.Equal(a.Members(), []string{"a", "c"}) && slices.Equal(c.Members(), []string{"a", "c"})
	})
	cConn.Close()
	waittest.For(t, 20*time.Second, "a to see c expire", func() bool { return slices.Equal(a.Members(), []string{"a"}) })
	stopC()
	<-doneC

	stopA()
	if err := <-doneA; err != nil {
		t.Fatal(err)
	}
}

// A bucket made by an earlier version (no expiry markers) is updated in
// place: replicas join it, and a dead one is still seen to expire.
func TestMembership_bucketFromBeforeMarkers(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	names := bus.Names{Prefix: "old"}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	js := ns.JetStream(t)
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: membership.Bucket(names), TTL: 2 * time.Second, History: 1, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	start := func(id string, nc *nats.Conn) (*membership.Membership, context.CancelFunc, chan error) {
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		m := &membership.Membership{ID: id, TTL: 2 * time.Second, Log: slog.New(slog.DiscardHandler)}
		mctx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- m.Run(mctx, js, names) }()
		return m, stop, done
	}
	a, stopA, doneA := start("a", ns.Connect(t))
	defer func() { stopA(); <-doneA }()
	bConn, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	_, stopB, doneB := start("b", bConn)
	waittest.For(t, 20*time.Second, "a to see b", func() bool { return slices.Equal(a.Members(), []string{"a", "b"}) })
	bConn.Close()
	waittest.For(t, 20*time.Second, "a to see b expire", func() bool { return slices.Equal(a.Members(), []string{"a"}) })
	stopB()
	<-doneB
	kv, err := js.KeyValue(ctx, membership.Bucket(names))
	if err != nil {
		t.Fatal(err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.(*jetstream.KeyValueBucketStatus).LimitMarkerTTL() == 0 {
		t.Error("the bucket keeps no expiry markers after the update")
	}
}
