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
export EGRESS_DATABASE_URL=${EGRESS_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/egress?sslmode=disable}
export EGRESS_NATS_URL=${EGRESS_NATS_URL:-nats://127.0.0.1:4222}
export EGRESS_PROVIDERS_CONFIG=${EGRESS_PROVIDERS_CONFIG:-deploy/local/providers.yaml}
export EGRESS_ORCHESTRATOR_ADDR=${EGRESS_ORCHESTRATOR_ADDR:-localhost:8100}
# Health probes fetch this through every proxy: the orchestrator's own
# /healthz, a target this machine runs.
export EGRESS_PROBE_TARGET=${EGRESS_PROBE_TARGET:-http://127.0.0.1:8101/healthz}
# Read instances every 30 s, so a local proxy stopped with the last run is
# started again soon after this one starts.
export EGRESS_RESYNC_INTERVAL=${EGRESS_RESYNC_INTERVAL:-30s}
# The orchestrator encrypts cloud-init at rest with this (public, local-only)
# keyring; see docs/orchestrator.md, "Cloud-init at rest".
export EGRESS_CLOUD_INIT_KEY_FILE=${EGRESS_CLOUD_INIT_KEY_FILE:-deploy/local/cloud-init-keys.yaml}
# provisioner-local serves the `local` provider; health checks it.
export EGRESS_PROVIDER=${EGRESS_PROVIDER:-local}
export EGRESS_PROVISIONER=${EGRESS_PROVISIONER:-local=localhost:8160}
# Local runs accept unauthenticated calls (each service logs a WARNING),
# unless EGRESS_LOCAL_AUTH=1 asks for the sample tokens in deploy/local.
if [ "${EGRESS_LOCAL_AUTH:-}" = 1 ]; then
	export EGRESS_AUTH_TOKEN_FILE=${EGRESS_AUTH_TOKEN_FILE:-deploy/local/tokens}
	export EGRESS_ORCHESTRATOR_TOKEN_FILE=${EGRESS_ORCHESTRATOR_TOKEN_FILE:-deploy/local/admin-token}
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

for svc in "$@"; do
	bin/"$svc" --log-format=text >"$logdir/$svc.log" 2>&1 &
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
echo "logs in $logdir/; Ctrl-C stops everything"
wait
