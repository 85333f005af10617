// Command provisioner-gcp runs proxies as Google Compute Engine instances behind the shared Provisioner contract.
package main

import (
	"context"
	"flag"
	"log/slog"
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/provisioner-gcp/internal/gcp"
)

func main() {
	var opts gcp.Options
	os.Exit(provisioner.Main(provisioner.Spec{
		Options: service.Options{Name: "provisioner-gcp", GRPCListen: ":8150", HTTPListen: ":8151"},
		Type:    "gcp",
		Flags: func(fs *flag.FlagSet) {
			fs.BoolVar(&opts.WirePayloads, "gcp-wire-payloads", false,
				"log every Compute API request and response body at DEBUG (user-data redacted); for debugging only")
		},
		NewBackend: func(_ context.Context, p providers.Provider, log *slog.Logger) (provisioner.Backend, error) {
			return gcp.FromProvider(p, log, opts)
		},
	}, os.Args[1:]))
}
