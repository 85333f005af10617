// Command provisioner-kubernetes runs proxies as Squid pods in a Kubernetes cluster behind the shared Provisioner contract.
package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/services/provisioner-kubernetes/internal/kubernetes"
)

func main() {
	os.Exit(provisioner.Main(provisioner.Spec{
		Options: service.Options{Name: "provisioner-kubernetes", GRPCListen: ":8170", HTTPListen: ":8171"},
		Type:    "kubernetes",
		NewBackend: func(_ context.Context, p providers.Provider, log *slog.Logger) (provisioner.Backend, error) {
			return kubernetes.FromProvider(p, log, kubernetes.Options{})
		},
	}, os.Args[1:]))
}
