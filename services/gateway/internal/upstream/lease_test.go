package upstream

import (
	"context"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/options"
)

// Every call to the lease service is timed by call, failed ones too: here
// a lease service that cannot be reached (a closed port).
func TestLeaserTimesEveryCall(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	calls := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "calls"}, []string{"call"})
	l := &Leaser{Client: leasev1.NewLeaseServiceClient(conn), TTL: time.Minute, SessionLifetime: time.Minute,
		CallTimeout: 200 * time.Millisecond, Log: slog.New(slog.DiscardHandler), Calls: calls}
	ctx := context.Background()
	if _, err := l.Acquire(ctx, Want{ClientID: "c", Target: "example.test"}); err == nil {
		t.Fatal("acquire from a closed port succeeded")
	}
	if _, err := l.Acquire(ctx, Want{ClientID: "c", Options: options.Options{Session: "s"}, Target: "example.test"}); err == nil {
		t.Fatal("a session's acquire from a closed port succeeded")
	}
	l.Release(&Lease{ID: "l"})
	_ = l.Renew(ctx, &Lease{ID: "l", TTL: time.Minute})
	_ = l.Report(ctx, "l", leasev1.Outcome_OUTCOME_ERROR, "example.test", TargetScope)
	for call, want := range map[string]int{"acquire": 2, "release": 1, "renew": 1, "report": 1} {
		if got := histogramCount(t, calls, call); got != uint64(want) {
			t.Errorf("%s observed %d times, want %d", call, got, want)
		}
	}
}

func histogramCount(t *testing.T, vec *prometheus.HistogramVec, call string) uint64 {
	t.Helper()
	ch := make(chan prometheus.Metric, 8)
	vec.Collect(ch)
	close(ch)
	for m := range ch {
		var pb dto.Metric
		if err := m.Write(&pb); err != nil {
			t.Fatal(err)
		}
		for _, lp := range pb.GetLabel() {
			if lp.GetName() == "call" && lp.GetValue() == call {
				return pb.GetHistogram().GetSampleCount()
			}
		}
	}
	return 0
}
