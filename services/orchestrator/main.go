// Command orchestrator stores Proxy desired state in PostgreSQL, runs the reconcile state machine and dispatches provisioner commands over NATS JetStream.
package main

import (
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/service"
)

func main() {
	os.Exit(service.Main(service.Binary{
		Options: service.Options{Name: "orchestrator", GRPCListen: ":8100", HTTPListen: ":8101"},
	}, os.Args[1:]))
}
