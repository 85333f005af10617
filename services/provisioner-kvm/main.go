// Command provisioner-kvm runs proxies as VMs on KVM/libvirt hosts reached over SSH behind the shared Provisioner contract.
package main

import (
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/service"
)

func main() {
	os.Exit(service.Main(service.Binary{
		Options: service.Options{Name: "provisioner-kvm", GRPCListen: ":8140", HTTPListen: ":8141"},
	}, os.Args[1:]))
}
