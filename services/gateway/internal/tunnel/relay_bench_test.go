package tunnel

import (
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/metrics"
)

// BenchmarkRelay is one short tunnel's relay, as a TLS request makes
// them: 300 bytes up, 1 KiB down, then the client closes. The loopback
// connections are made in the timed loop too (the same for any relay).
// cpu-µs/op is the process's CPU time per tunnel: both ends and the relay.
func BenchmarkRelay(b *testing.B) {
	c := &Core{Metrics: metrics.New(prometheus.NewRegistry()), IdleTimeout: time.Minute, Log: slog.New(slog.DiscardHandler)}
	up, down := make([]byte, 300), make([]byte, 1024)
	b.ReportAllocs()
	cpu0 := proctest.CPUTime(b, os.Getpid())
	for b.Loop() {
		crawler, target, done := relayed(b, c)
		if _, err := crawler.Write(up); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(target, up); err != nil {
			b.Fatal(err)
		}
		if _, err := target.Write(down); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(crawler, down); err != nil {
			b.Fatal(err)
		}
		_ = crawler.Close()
		if _, err := io.Copy(io.Discard, target); err != nil {
			b.Fatal(err)
		}
		_ = target.Close()
		<-done
	}
	b.ReportMetric(float64((proctest.CPUTime(b, os.Getpid())-cpu0).Microseconds())/float64(b.N), "cpu-µs/op")
}
