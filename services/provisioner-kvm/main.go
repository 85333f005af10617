// Command provisioner-kvm runs proxies as VMs on KVM/libvirt hosts reached over SSH behind the shared Provisioner contract.
package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/provisioner-kvm/internal/kvm"
)

func main() {
	os.Exit(provisioner.Main(provisioner.Spec{
		Options: service.Options{Name: "provisioner-kvm", GRPCListen: ":8140", HTTPListen: ":8141"},
		Type:    "kvm",
		NewBackend: func(_ context.Context, p providers.Provider, log *slog.Logger) (provisioner.Backend, error) {
			return kvm.FromProvider(p, log, kvm.Options{})
		},
	}, os.Args[1:]))
}
