// Command farm runs the load for the health benchmark in its own process:
// N Go CONNECT proxies on loopback ports and one TLS probe target. It logs
// one JSON line, "farm ready", with the target URL, its CA and the proxy
// addresses, then serves until killed. Keeping the load out of the
// benchmark process lets the benchmark measure the prober's own CPU.
package main

import (
	"encoding/pem"
	"flag"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/egress-proxies/egress-proxies/services/health/internal/proxytest"
)

func main() {
	n := flag.Int("proxies", 500, "how many proxies to run")
	flag.Parse()
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))

	target := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "ok")
	}))
	target.Config.ErrorLog = log.New(io.Discard, "", 0)
	target.StartTLS()
	defer target.Close()

	addrs := make([]string, 0, *n)
	for range *n {
		p, err := proxytest.NewProxy(proxytest.Behaviour{})
		if err != nil {
			logger.Error("starting a proxy", "error", err)
			os.Exit(1)
		}
		defer p.Close()
		addrs = append(addrs, p.Addr())
	}
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: target.Certificate().Raw})
	logger.Info("farm ready", "target", target.URL+"/healthz", "ca", string(ca), "proxies", addrs)

	// The farm's own CPU, so the benchmark can tell how much of the
	// machine the load took.
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
	for {
		select {
		case <-sig:
			return
		case <-tick.C:
			var ru syscall.Rusage
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
			logger.Info("farm cpu", "cpu_seconds", float64(ru.Utime.Nano()+ru.Stime.Nano())/1e9)
		}
	}
}
