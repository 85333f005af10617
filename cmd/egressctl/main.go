// Command egressctl is the command line of egress-proxies: proxies on the
// orchestrator, leases on the lease service, health on the health service,
// all over gRPC.
package main

import (
	"os"

	"github.com/egress-proxies/egress-proxies/cmd/egressctl/internal/cli"
)

func main() {
	os.Exit(cli.Main(os.Args[1:], os.Stdout, os.Stderr))
}
