// Command provisioner-gcp runs proxies as Google Compute Engine instances behind the shared Provisioner contract.
package main

import (
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/service"
)

func main() {
	os.Exit(service.Main(service.Binary{
		Options: service.Options{Name: "provisioner-gcp", GRPCListen: ":8150", HTTPListen: ":8151"},
	}, os.Args[1:]))
}
