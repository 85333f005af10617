// Command provisioner-proxmox runs proxies as VMs on a Proxmox VE cluster behind the shared Provisioner contract.
package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/provisioner-proxmox/internal/proxmox"
)

func main() {
	os.Exit(provisioner.Main(provisioner.Spec{
		Options: service.Options{Name: "provisioner-proxmox", GRPCListen: ":8130", HTTPListen: ":8131"},
		Type:    "proxmox",
		NewBackend: func(_ context.Context, p providers.Provider, log *slog.Logger) (provisioner.Backend, error) {
			return proxmox.FromProvider(p, log, proxmox.Options{})
		},
	}, os.Args[1:]))
}
