// Command lease hands proxies to crawler fleets through leases with capacity, TTLs and per-target cooldowns.
package main

import (
	"context"
	"flag"
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/app"
)

func main() {
	os.Exit(service.Main(binary(), os.Args[1:]))
}

func binary() service.Binary {
	cfg := app.DefaultConfig()
	return service.Binary{
		Options:        service.Options{Name: "lease", GRPCListen: ":8110", HTTPListen: ":8111", Auth: &auth.Config{}},
		Flags:          func(fs *flag.FlagSet) { cfg.RegisterFlags(fs) },
		ServiceOptions: app.Options(),
		Setup: func(ctx context.Context, s *service.Service) error {
			_, err := cfg.Setup(ctx, s)
			return err
		},
		Migrate: cfg.Migrate,
	}
}
