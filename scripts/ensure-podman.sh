#!/usr/bin/env bash
# Installs podman and runc (Debian packages) when missing, for `make images`
# and `make test-images`. Installing needs root.
set -euo pipefail
if command -v podman >/dev/null && command -v runc >/dev/null; then
	exit 0
fi
if [[ $(id -u) != 0 ]]; then
	echo "ensure-podman: podman and runc are missing; install them: apt-get install podman runc" >&2
	exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc >/dev/null
