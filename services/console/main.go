// Command console serves the operators' web console: the fleet, live, and
// the actions an admin may take, over the services' APIs with the
// signed-in user's token.
package main

import (
	"context"
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/console/internal/app"
)

func main() {
	var cfg app.Config
	os.Exit(service.Main(service.Binary{
		// The gRPC port serves gRPC health only: the console's API is its
		// pages, on the HTTP port.
		Options: service.Options{Name: "console", GRPCListen: ":8091", HTTPListen: ":8090"},
		Flags:   cfg.RegisterFlags,
		Setup: func(ctx context.Context, s *service.Service) error {
			return cfg.Setup(ctx, s, s.ServesTLS())
		},
	}, os.Args[1:]))
}
