#!/usr/bin/env bash
# Starts the suite's binaries from bin/ on this machine with their default
# ports, against the local PostgreSQL (database "egress") and NATS, prints
# where each listens, and stops them all on Ctrl-C (SIGTERM to each, then
# waits). Usage: scripts/run-local.sh SERVICE...
set -uo pipefail
cd "$(dirname "$0")/.."

if [ $# -eq 0 ]; then
	echo "usage: $0 SERVICE..." >&2
	exit 2
fi

# Local defaults for every service; any EGRESS_* already set wins.
if [ -z "${EGRESS_DATABASE_URL:-}" ] || [ -z "${EGRESS_NATS_URL:-}" ]; then
	scripts/ensure-deps.sh >/dev/null || {
		cat >&2 <<-'EOF'
		make run needs PostgreSQL on 127.0.0.1:5432 (user postgres, trust auth) and NATS with
		JetStream on 127.0.0.1:4222, and scripts/ensure-deps.sh could not start them. Either run
		it as root (it installs Debian's postgresql and nats-server), or point the suite at
		yours: EGRESS_DATABASE_URL=postgres://… EGRESS_NATS_URL=nats://… make run
		EOF
		exit 1
	}
fi
if [ -z "${EGRESS_DATABASE_URL:-}" ]; then
	psql -h 127.0.0.1 -U postgres -Atqc "SELECT 1 FROM pg_database WHERE datname = 'egress'" | grep -q 1 ||
		psql -h 127.0.0.1 -U postgres -qc "CREATE DATABASE egress" >/dev/null
fi
# Every service listens on this host only: loopback unless told otherwise
# (EGRESS_RUN_HOST=0.0.0.0 make run reaches them from other machines).
host=${EGRESS_RUN_HOST:-127.0.0.1}
self=$host
[ "$host" = 0.0.0.0 ] && self=127.0.0.1
export EGRESS_DATABASE_URL=${EGRESS_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/egress?sslmode=disable}
export EGRESS_NATS_URL=${EGRESS_NATS_URL:-nats://127.0.0.1:4222}
export EGRESS_PROVIDERS_CONFIG=${EGRESS_PROVIDERS_CONFIG:-deploy/local/providers.yaml}
export EGRESS_ORCHESTRATOR_ADDR=${EGRESS_ORCHESTRATOR_ADDR:-$self:8100}
# Health probes fetch this through every proxy: the orchestrator's own
# /healthz, a target this machine runs.
export EGRESS_PROBE_TARGET=${EGRESS_PROBE_TARGET:-http://$self:8101/healthz}
# Read instances every 30 s, so a local proxy stopped with the last run is
# started again soon after this one starts.
export EGRESS_RESYNC_INTERVAL=${EGRESS_RESYNC_INTERVAL:-30s}
# provisioner-local serves the `local` provider; health checks it.
export EGRESS_PROVIDER=${EGRESS_PROVIDER:-local}
export EGRESS_PROVISIONER=${EGRESS_PROVISIONER:-local=$self:8160}
# Local runs accept unauthenticated calls (each service logs a WARNING),
# unless EGRESS_LOCAL_AUTH=1 asks for the sample tokens in deploy/local.
if [ "${EGRESS_LOCAL_AUTH:-}" = 1 ]; then
	export EGRESS_AUTH_TOKEN_FILE=${EGRESS_AUTH_TOKEN_FILE:-deploy/local/tokens}
	# What the services call each other with: the service role.
	export EGRESS_ORCHESTRATOR_TOKEN_FILE=${EGRESS_ORCHESTRATOR_TOKEN_FILE:-deploy/local/service-token}
	export EGRESS_PROVISIONER_TOKEN_FILE=${EGRESS_PROVISIONER_TOKEN_FILE:-deploy/local/service-token}
else
	export EGRESS_AUTH_DISABLED=${EGRESS_AUTH_DISABLED:-true}
fi

logdir=${EGRESS_RUN_LOG_DIR:-.run}
mkdir -p "$logdir"
# squid drops to its own user, which must reach the local instances.
chmod 755 "$logdir"
pids=()
stop() {
	trap - INT TERM
	echo
	echo "stopping…"
	for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
	for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
	# The local proxies run in sessions of their own (they outlive a
	# provisioner restart); stop them too. The next run starts them again
	# when it reads their instances.
	pkill -TERM -f "$PWD/.run/local/" 2>/dev/null
	echo "stopped"
	exit 0
}
trap stop INT TERM

# The default gRPC port of each service; HTTP is the next one.
port_of() {
	case $1 in
	orchestrator) echo 8100 ;; lease) echo 8110 ;; health) echo 8120 ;;
	provisioner-proxmox) echo 8130 ;; provisioner-kvm) echo 8140 ;;
	provisioner-gcp) echo 8150 ;; provisioner-local) echo 8160 ;;
	esac
}
for svc in "$@"; do
	listen=()
	if port=$(port_of "$svc") && [ -n "$port" ]; then
		listen=(--grpc-listen="$host:$port" --http-listen="$host:$((port + 1))")
	fi
	bin/"$svc" "${listen[@]}" --log-format=text >"$logdir/$svc.log" 2>&1 &
	pids+=($!)
done

# Wait for every service's "serving" line and print its endpoints.
printf '%-20s %-16s %-22s %s\n' SERVICE GRPC REST METRICS
for svc in "$@"; do
	line=""
	for _ in $(seq 1 100); do
		line=$(grep -m1 'msg=serving' "$logdir/$svc.log" 2>/dev/null) && break
		sleep 0.1
	done
	if [ -z "$line" ]; then
		echo "$svc did not start; its log ($logdir/$svc.log):" >&2
		cat "$logdir/$svc.log" >&2
		stop
	fi
	# A wildcard listener is reached on localhost.
	grpc=$(sed -n 's/.*grpc=\([^ ]*\).*/\1/p' <<<"$line" | sed 's/^\(\[::\]\|0\.0\.0\.0\):/localhost:/')
	http=$(sed -n 's/.*http=\([^ ]*\).*/\1/p' <<<"$line" | sed 's/^\(\[::\]\|0\.0\.0\.0\):/localhost:/')
	printf '%-20s %-16s %-22s %s\n' "$svc" "$grpc" "http://$http" "http://$http/metrics"
done
if [ "${EGRESS_AUTH_DISABLED:-}" = true ]; then
	echo "WARNING: authentication is OFF: anyone who reaches $host may call every API with every role." \
		"EGRESS_LOCAL_AUTH=1 make run uses the sample tokens in deploy/local/tokens."
fi
if [ "$host" != 127.0.0.1 ] && [ "$host" != localhost ] && [ "$host" != ::1 ]; then
	echo "WARNING: listening on $host, not on loopback only (EGRESS_RUN_HOST)."
fi
echo "logs in $logdir/; Ctrl-C stops everything"
wait
