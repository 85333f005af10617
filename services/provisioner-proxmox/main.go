// Command provisioner-proxmox runs proxies as VMs on a Proxmox VE cluster behind the shared Provisioner contract.
package main

import (
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/service"
)

func main() {
	os.Exit(service.Main(service.Binary{
		Options: service.Options{Name: "provisioner-proxmox", GRPCListen: ":8130", HTTPListen: ":8131"},
	}, os.Args[1:]))
}
