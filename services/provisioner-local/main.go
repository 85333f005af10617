// Command provisioner-local runs proxies as forward-proxy processes on this
// machine (squid, or a built-in Go proxy) behind the shared Provisioner
// contract, for local runs and end-to-end tests. `provisioner-local
// forward-proxy --listen ADDR` is the built-in proxy itself.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/provisioner-local/internal/forward"
	"github.com/egress-proxies/egress-proxies/services/provisioner-local/internal/local"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "forward-proxy" {
		os.Exit(forwardProxy(os.Args[2:]))
	}
	os.Exit(provisioner.Main(provisioner.Spec{
		Options: service.Options{Name: "provisioner-local", GRPCListen: ":8160", HTTPListen: ":8161"},
		Type:    "local",
		NewBackend: func(_ context.Context, p providers.Provider, log *slog.Logger) (provisioner.Backend, error) {
			return local.FromProvider(p, log)
		},
	}, os.Args[1:]))
}

func forwardProxy(args []string) int {
	fs := flag.NewFlagSet("forward-proxy", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:3128", "address to listen on")
	fs.String("instance-dir", "", "the instance's directory (marks the process as the instance's)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil)).With("service", "forward-proxy")
	if err := forward.Serve(ctx, *listen, log); err != nil {
		fmt.Fprintln(os.Stderr, "forward-proxy:", err)
		return 1
	}
	return 0
}
