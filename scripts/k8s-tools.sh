#!/usr/bin/env bash
# Builds the Kubernetes control plane (kube-apiserver, controller-manager,
# scheduler, kubectl), kwok, etcd and helm that `make test-cluster` starts,
# from the versions pinned in tools/k8s and tools/helm, into a cache folder
# keyed by those pins, and prints that folder. A warm cache costs nothing; a
# cold build takes roughly ten minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."

key=$(cat tools/k8s/go.mod tools/k8s/go.sum tools/helm/go.mod tools/helm/go.sum | sha256sum | cut -c1-12)
dir=${K8S_TOOLS_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/egress-proxies/k8s-$key}
if [[ -f $dir/.stamp ]]; then
	echo "$dir"
	exit 0
fi

mkdir -p "$dir"
version=$(GOWORK=off go -C tools/k8s list -m -f '{{.Version}}' k8s.io/kubernetes)
minor=$(echo "$version" | cut -d. -f2)
# Without these kubectl and helm cannot parse the server's version.
ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	ldflags+=" -X $p.gitVersion=$version -X $p.gitMajor=1 -X $p.gitMinor=$minor"
done
(
	cd tools/k8s
	GOWORK=off go build -trimpath -ldflags "$ldflags" -o "$dir/" \
		k8s.io/kubernetes/cmd/kube-apiserver \
		k8s.io/kubernetes/cmd/kube-controller-manager \
		k8s.io/kubernetes/cmd/kube-scheduler \
		k8s.io/kubernetes/cmd/kubectl \
		sigs.k8s.io/kwok/cmd/kwok
	GOWORK=off go build -trimpath -ldflags "-s -w" -o "$dir/etcd" ./etcd
	# kwok's stage definitions, shipped in its module, drive the fake node
	# and pod lifecycles.
	kwok=$(GOWORK=off go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
	mkdir -p "$dir/stages"
	for s in node/fast node/heartbeat-with-lease pod/fast; do
		for f in "$kwok/kustomize/stage/$s/"*.yaml; do
			[[ $(basename "$f") == kustomization.yaml ]] || cp "$f" "$dir/stages/"
		done
	done
)
(cd tools/helm && GOWORK=off go build -trimpath -o "$dir/" helm.sh/helm/v3/cmd/helm)
touch "$dir/.stamp"
echo "$dir"
