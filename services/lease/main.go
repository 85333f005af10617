// Command lease hands proxies to crawler fleets through leases with capacity, TTLs and per-target cooldowns.
package main

import (
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/service"
)

func main() {
	os.Exit(service.Main(service.Binary{
		Options: service.Options{Name: "lease", GRPCListen: ":8110", HTTPListen: ":8111"},
	}, os.Args[1:]))
}
