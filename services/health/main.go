// Command health probes every running proxy and checks every provider's backend.
package main

import (
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/service"
)

func main() {
	os.Exit(service.Main(service.Binary{
		Options: service.Options{Name: "health", GRPCListen: ":8120", HTTPListen: ":8121"},
	}, os.Args[1:]))
}
