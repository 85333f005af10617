package dispatch_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

// BenchmarkConverge creates N proxies through the gRPC API (32 concurrent
// clients) against a provisioner that answers every command at once, and
// measures the time until every proxy is Running. Run it once per size:
//
//	go test -run '^$' -bench BenchmarkConverge -benchtime 1x ./services/orchestrator/internal/dispatch/
//
// It reports proxies/s (converged) and the create phase's own rate.
func BenchmarkConverge(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			for range b.N {
				converge(b, n)
			}
		})
	}
}

func converge(b *testing.B, n int) {
	h := orchtest.New(b)
	if os.Getenv("BENCH_ASYNC_COMMIT") != "" {
		_, _ = h.Store.Pool().Exec(context.Background(), "ALTER DATABASE "+strings.TrimPrefix(must(url.Parse(h.DSN)).Path, "/")+" SET synchronous_commit = off")
	}
	h.StartCloud("fake")
	h.StartReplica()

	srv := grpc.NewServer()
	proxyv1.RegisterProxyServiceServer(srv, h.API)
	client := proxyv1.NewProxyServiceClient(grpctest.Dial(b, grpctest.Serve(b, srv)))
	ctx := context.Background()

	b.ResetTimer()
	start := time.Now()
	names := make(chan string)
	var wg sync.WaitGroup
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range names {
				if _, err := client.CreateProxy(ctx, orchtest.Managed(name)); err != nil {
					b.Error(err)
				}
			}
		}()
	}
	for i := range n {
		names <- fmt.Sprintf("bench-%06d", i)
	}
	close(names)
	wg.Wait()
	created := time.Since(start)

	// Counting scans every proxy: the wait's poll backs off to 100ms so
	// the measurement does not load what it measures.
	waittest.ForErr(b, 10*time.Minute-time.Since(start), fmt.Sprintf("%d proxies Running", n), func() error {
		var running int
		if err := h.Store.Pool().QueryRow(ctx, "SELECT count(*) FROM orchestrator.proxies WHERE phase = $1",
			int16(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING)).Scan(&running); err != nil {
			return err
		}
		if running != n {
			return fmt.Errorf("%d Running", running)
		}
		return nil
	})
	total := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(n)/total.Seconds(), "proxies/s")
	b.ReportMetric(float64(n)/created.Seconds(), "creates/s")
	b.ReportMetric(total.Seconds(), "s-to-converge")
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
