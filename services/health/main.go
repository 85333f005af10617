// Command health probes every running proxy and checks every provider's backend.
package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/health/internal/app"
)

func main() {
	var cfg app.Config
	os.Exit(service.Main(service.Binary{
		Options: service.Options{Name: "health", GRPCListen: ":8120", HTTPListen: ":8121", Auth: &auth.Config{}},
		Flags:   cfg.RegisterFlags,
		Setup:   cfg.Setup,
		Migrate: func(ctx context.Context, log *slog.Logger) error { return cfg.Migrate(ctx, log) },
	}, os.Args[1:]))
}
