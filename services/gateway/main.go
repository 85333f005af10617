// Command gateway is one proxy endpoint for every crawler: an HTTP forward
// proxy with CONNECT and a SOCKS5 proxy that send each request or tunnel
// through a proxy of the fleet leased from the lease service, with sticky
// sessions, ban rules and per-client accounting.
package main

import (
	"context"
	"flag"
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/app"
)

func main() {
	os.Exit(service.Main(binary(), os.Args[1:]))
}

func binary() service.Binary {
	cfg := app.DefaultConfig()
	authCfg := &auth.Config{}
	return service.Binary{
		Options: service.Options{Name: "gateway", GRPCListen: ":8180", HTTPListen: ":8181", Auth: authCfg},
		Flags:   func(fs *flag.FlagSet) { cfg.RegisterFlags(fs) },
		Setup: func(ctx context.Context, s *service.Service) error {
			// Crawlers' tokens are checked against the same token file
			// as the admin API's callers.
			authn, err := auth.New(*authCfg, s.Log)
			if err != nil {
				return err
			}
			_, err = cfg.Setup(ctx, s, authn)
			return err
		},
	}
}
