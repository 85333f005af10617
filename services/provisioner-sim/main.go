// Command provisioner-sim is the fleet simulator's provisioner: it serves
// the shared Provisioner contract on a farm of simulated instances that
// exist the moment they are made, each a real forward proxy at a loopback
// address of its own (internal/farm), so that 100,000 proxies can be
// created, leased, probed and deleted on one machine, for benchmarks and
// tests. `provisioner-sim farm --listen ADDR [--shared-port P]` runs the farm
// itself; instances of 100,000 proxies must share a port (see farm).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/provisioner-sim/internal/farm"
	"github.com/egress-proxies/egress-proxies/services/provisioner-sim/internal/sim"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "farm" {
		os.Exit(runFarm(os.Args[2:]))
	}
	os.Exit(provisioner.Main(provisioner.Spec{
		Options: service.Options{Name: "provisioner-sim", GRPCListen: ":8170", HTTPListen: ":8171"},
		Type:    "sim",
		NewBackend: func(_ context.Context, p providers.Provider, log *slog.Logger) (provisioner.Backend, error) {
			return sim.FromProvider(p, log)
		},
	}, os.Args[1:]))
}

// runFarm serves a farm's API on --listen until SIGTERM, logging
// "farm ready" with the API's URL once it listens.
func runFarm(args []string) int {
	fs := flag.NewFlagSet("farm", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:8179", "address of the farm's API (loopback)")
	shared := fs.Uint("shared-port", 0, "the port instances share one listener on: the wildcard address of the loopback device, which no other program may then use on that port (0: none; every instance listens on its own)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil)).With("service", "sim-farm")
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	l, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "farm: --listen:", err)
		return 1
	}
	if *shared > 65535 {
		fmt.Fprintln(os.Stderr, "farm: --shared-port: not a TCP port")
		return 2
	}
	f := farm.New(log, uint32(*shared))
	defer f.Close()
	srv := &http.Server{Handler: f.Handler(), ReadHeaderTimeout: 10 * time.Second}
	log.Info("farm ready", "api", "http://"+l.Addr().String())
	go func() {
		<-ctx.Done()
		shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shut)
	}()
	if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintln(os.Stderr, "farm:", err)
		return 1
	}
	return 0
}
