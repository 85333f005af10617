#!/usr/bin/env bash
# Builds one container image per service (and egressctl) without a
# registry: static binaries on an empty base (deploy/images/Containerfile),
# tagged egress-proxies/<name>:<version>, each saved as an OCI archive
# bin/images/<name>-<version>.oci.tar.
#
#   scripts/images.sh VERSION NAME...
set -euo pipefail
cd "$(dirname "$0")/.."

version=$1
shift
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/deploy/images/containers.conf}
command -v podman >/dev/null || { echo "images: podman is missing (apt-get install podman runc)" >&2; exit 1; }

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/bin" "$ctx/rootfs/etc/ssl/certs" "$ctx/rootfs/tmp" bin/images
cp deploy/images/rootfs/etc/passwd deploy/images/rootfs/etc/group "$ctx/rootfs/etc/"
cp /etc/ssl/certs/ca-certificates.crt "$ctx/rootfs/etc/ssl/certs/"
chmod 1777 "$ctx/rootfs/tmp"

for name in "$@"; do
	src=./services/$name
	[[ $name == egressctl ]] && src=./cmd/egressctl
	CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$ctx/bin/$name" "$src"
	sed "s/@BINARY@/$name/g" deploy/images/Containerfile >"$ctx/Containerfile.$name"
	podman build --quiet --pull=never --build-arg VERSION="$version" \
		-f "$ctx/Containerfile.$name" -t "egress-proxies/$name:$version" "$ctx" >/dev/null
	out=bin/images/$name-$version.oci.tar
	rm -f "$out"
	podman save --quiet --format oci-archive -o "$out" "egress-proxies/$name:$version"
	echo "egress-proxies/$name:$version -> $out ($(du -h "$out" | cut -f1))"
done
