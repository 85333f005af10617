#!/usr/bin/env bash
# Makes sure what the tests need is running on this machine: PostgreSQL on
# 127.0.0.1:5432 (trust auth for user postgres) and NATS with JetStream on
# 127.0.0.1:4222. Starts them when installed but stopped, installs them from
# Debian's packages when missing (needs root). Installs squid for the health
# service's probe tests, which start their own squid with a generated config;
# the system squid daemon is never started here. Installs Debian's Python 3
# with python3-scrapy and python3-pytest for the crawler clients' tests
# (clients/python, run by make test-e2e), and Chromium, Node.js and npm for
# the web console's browser test (tests/e2e/console, run by make test-e2e;
# make run needs neither), and python3-jinja2 with python3-yaml for the
# test that renders the documented cloud-init templates. Idempotent.
set -euo pipefail

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {
	for _ in $(seq 1 100); do
		port_open "$1" && return 0
		sleep 0.2
	done
	echo "ensure-deps: nothing listens on 127.0.0.1:$1 after starting $2" >&2
	return 1
}

apt_updated=""
apt_install() {
	if [ -z "$apt_updated" ]; then
		apt-get update -qq
		apt_updated=1
	fi
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! port_open 5432; then
	if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
		echo "ensure-deps: installing PostgreSQL"
		apt_install postgresql
		ver=$(ls /etc/postgresql | sort -V | tail -1)
		sed -i 's/^\(host\|local\)\(.*\)\(scram-sha-256\|md5\|peer\)$/\1\2trust/' "/etc/postgresql/$ver/main/pg_hba.conf"
	fi
	ver=$(ls /etc/postgresql | sort -V | tail -1)
	echo "ensure-deps: starting PostgreSQL $ver"
	pg_ctlcluster --skip-systemctl-redirect "$ver" main start
	wait_port 5432 PostgreSQL
fi

if ! port_open 4222; then
	if ! command -v nats-server >/dev/null; then
		echo "ensure-deps: installing nats-server"
		apt_install nats-server
	fi
	echo "ensure-deps: starting nats-server with JetStream"
	mkdir -p /var/lib/nats-server
	start-stop-daemon --start --oknodo --background --exec "$(command -v nats-server)" -- \
		-a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
	wait_port 4222 nats-server
fi
if ! command -v squid >/dev/null && [ ! -x /usr/sbin/squid ]; then
	echo "ensure-deps: installing squid (the health probe tests run their own instance)"
	apt_install squid
	# Debian's package may start the system daemon where an init system
	# runs; the tests never use it.
	if command -v service >/dev/null; then service squid stop >/dev/null 2>&1 || true; fi
fi
# pkg/nocloud renders the docs' cloud-init templates as cloud-init does,
# with Debian's jinja2 and PyYAML.
if ! /usr/bin/python3 -c 'import jinja2, yaml' >/dev/null 2>&1; then
	echo "ensure-deps: installing python3-jinja2 and python3-yaml (the documented cloud-init templates' test)"
	apt_install python3 python3-jinja2 python3-yaml
fi
if ! /usr/bin/python3 -c 'import scrapy, pytest' >/dev/null 2>&1; then
	echo "ensure-deps: installing python3-scrapy and python3-pytest (the Python client's tests)"
	apt_install python3 python3-scrapy python3-pytest
fi
# The console's browser test: Debian's headless Chromium, driven by
# playwright-core from npm (npm ci from the test's lockfile).
# Each is installed only when missing: a Node.js from another source
# (NodeSource's bundles npm) conflicts with Debian's npm package.
if [ ! -x /usr/bin/chromium ]; then
	echo "ensure-deps: installing chromium (the web console's browser test)"
	apt_install chromium
fi
if ! command -v node >/dev/null; then
	echo "ensure-deps: installing nodejs (the web console's browser test)"
	apt_install nodejs
fi
if ! command -v npm >/dev/null; then
	echo "ensure-deps: installing npm (the web console's browser test)"
	apt_install npm
fi
# The KVM backend's tests need a real libvirtd (and sshd, QEMU, qemu-img).
"$(dirname "$0")/ensure-libvirt.sh"
echo "ensure-deps: PostgreSQL, NATS, squid, Scrapy, pytest, Chromium, Node.js and libvirtd are ready"
