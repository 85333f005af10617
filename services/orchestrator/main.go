// Command orchestrator stores Proxy desired state in PostgreSQL, runs the
// reconcile state machine and dispatches provisioner commands over NATS
// JetStream.
package main

import (
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/app"
)

func main() {
	cfg := app.DefaultConfig()
	os.Exit(service.Main(service.Binary{
		Options: service.Options{Name: "orchestrator", GRPCListen: ":8100", HTTPListen: ":8101", Auth: &auth.Config{}},
		Flags:   cfg.RegisterFlags,
		Setup:   cfg.Setup,
		Migrate: cfg.Migrate,
	}, os.Args[1:]))
}
