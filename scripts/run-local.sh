#!/usr/bin/env bash
# Starts the suite's binaries from bin/ on this machine with their default
# ports, against the local PostgreSQL (database "egress") and NATS, prints
# where each listens, and supervises them: the first service to exit ends
# the run with the end of its log (exit status 1). Whatever ends the run
# (Ctrl-C too), every service and the local proxies are stopped. Each
# run's logs stay in .run/logs/<time>-<pid>/ (.run/latest is the newest).
# Usage: scripts/run-local.sh SERVICE...
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
# EGRESS_RUN_PORT_OFFSET moves every service's ports (8100 → 8100+offset,
# …), so a second suite (the README test) runs beside a developer's.
offset=${EGRESS_RUN_PORT_OFFSET:-0}
declare -A grpc_port=([orchestrator]=8100 [lease]=8110 [health]=8120 [provisioner-proxmox]=8130
	[provisioner-kvm]=8140 [provisioner-gcp]=8150 [provisioner-local]=8160 [provisioner-kubernetes]=8170
	[gateway]=8180)
export EGRESS_DATABASE_URL=${EGRESS_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/egress?sslmode=disable}
export EGRESS_NATS_URL=${EGRESS_NATS_URL:-nats://127.0.0.1:4222}
export EGRESS_PROVIDERS_CONFIG=${EGRESS_PROVIDERS_CONFIG:-deploy/local/providers.yaml}
export EGRESS_ORCHESTRATOR_ADDR=${EGRESS_ORCHESTRATOR_ADDR:-$self:$((8100 + offset))}
# Health probes fetch this through every proxy: the orchestrator's own
# /healthz, a target this machine runs.
export EGRESS_PROBE_TARGET=${EGRESS_PROBE_TARGET:-http://$self:$((8101 + offset))/healthz}
# Read instances every 30 s, so a local proxy stopped with the last run is
# started again soon after this one starts.
export EGRESS_RESYNC_INTERVAL=${EGRESS_RESYNC_INTERVAL:-30s}
# The orchestrator encrypts cloud-init at rest with this (public, local-only)
# keyring; see docs/orchestrator.md, "Cloud-init at rest".
export EGRESS_CLOUD_INIT_KEY_FILE=${EGRESS_CLOUD_INIT_KEY_FILE:-deploy/local/cloud-init-keys.yaml}
# provisioner-local serves the `local` provider; health checks it.
export EGRESS_PROVIDER=${EGRESS_PROVIDER:-local}
export EGRESS_PROVISIONER=${EGRESS_PROVISIONER:-local=$self:$((8160 + offset))}
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

bindir=${EGRESS_RUN_BIN_DIR:-bin}
rundir=${EGRESS_RUN_LOG_DIR:-.run}
# The proxies' state directory (deploy/local/providers.yaml): their
# processes run in sessions of their own and are stopped by it.
statedir=${EGRESS_RUN_STATE_DIR:-$PWD/.run/local}
# Each run's logs in a directory of its own, .run/latest pointing at the
# newest; the last 20 runs are kept.
logdir="$rundir/logs/$(date -u +%Y%m%dT%H%M%SZ)-$$"
mkdir -p "$logdir"
ln -sfn "logs/$(basename "$logdir")" "$rundir/latest"
ls -1d "$rundir"/logs/*/ 2>/dev/null | sort | head -n -20 | xargs -r rm -rf
# squid drops to its own user, which must reach the local instances.
chmod 755 "$rundir" "$rundir/logs" "$logdir"

pids=()
names=()
stopped=
# stop ends every service and the local proxies, whatever ended the run
# (Ctrl-C, a service that exited, an error in this script).
stop() {
	[ -n "$stopped" ] && return
	stopped=1
	trap - INT TERM
	echo
	echo "stopping…"
	for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
	for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
	# The local proxies outlive a provisioner restart by design; the next
	# run starts them again when it reads their instances.
	pkill -TERM -f "$statedir/" 2>/dev/null
	echo "stopped; logs in $logdir/"
}
trap 'stop; exit 0' INT TERM
trap stop EXIT

for svc in "$@"; do
	listen=()
	if [ -n "${grpc_port[$svc]:-}" ]; then
		port=$((grpc_port[$svc] + offset))
		listen=(--grpc-listen="$host:$port" --http-listen="$host:$((port + 1))")
	fi
	# The web console: its pages on 8090, gRPC health on 8091; it reaches
	# the services with the signed-in user's token.
	if [ "$svc" = console ]; then
		listen=(--http-listen="$host:$((8090 + offset))" --grpc-listen="$host:$((8091 + offset))"
			--lease-addr="$self:$((8110 + offset))" --health-addr="$self:$((8120 + offset))")
		# With the gateway in the run, the overview shows its rates.
		case " $* " in *" gateway "*) listen+=(--gateway-metrics-url="http://$self:$((8181 + offset))/metrics") ;; esac
	fi
	# The gateway: crawlers' HTTP proxy on 8080, SOCKS5 on 1080, leasing
	# from this run's lease service (with the sample service token when
	# authentication is on).
	if [ "$svc" = gateway ]; then
		listen+=(--proxy-listen="$host:$((8080 + offset))" --socks-listen="$host:$((1080 + offset))"
			--lease-addr="$self:$((8110 + offset))")
		[ "${EGRESS_LOCAL_AUTH:-}" = 1 ] && listen+=(--lease-token-file=deploy/local/service-token)
	fi
	"$bindir/$svc" --log-format=text "${listen[@]}" >"$logdir/$svc.log" 2>&1 &
	pids+=($!)
	names+=("$svc")
done

# exited reports a service that has ended, with the tail of its log, and
# ends the run.
exited() {
	local svc=$1 status=$2
	echo "$svc exited with status $status; the end of its log ($logdir/$svc.log):" >&2
	tail -n 30 "$logdir/$svc.log" >&2
	exit 1
}

# Wait for every service's "serving" line and print its endpoints.
printf '%-20s %-16s %-22s %s\n' SERVICE GRPC REST METRICS
for i in "${!names[@]}"; do
	svc=${names[$i]}
	line=""
	for _ in $(seq 1 100); do
		line=$(grep -m1 'msg=serving' "$logdir/$svc.log" 2>/dev/null) && break
		if ! kill -0 "${pids[$i]}" 2>/dev/null; then
			wait "${pids[$i]}"
			exited "$svc" $?
		fi
		sleep 0.1
	done
	if [ -z "$line" ]; then
		echo "$svc did not start within 10s; its log ($logdir/$svc.log):" >&2
		cat "$logdir/$svc.log" >&2
		exit 1
	fi
	# A wildcard listener is reached on localhost.
	grpc=$(sed -n 's/.*grpc=\([^ ]*\).*/\1/p' <<<"$line" | sed 's/^\(\[::\]\|0\.0\.0\.0\):/localhost:/')
	http=$(sed -n 's/.*http=\([^ ]*\).*/\1/p' <<<"$line" | sed 's/^\(\[::\]\|0\.0\.0\.0\):/localhost:/')
	printf '%-20s %-16s %-22s %s\n' "$svc" "$grpc" "http://$http" "http://$http/metrics"
done
case " $* " in *" gateway "*)
	echo "crawlers' proxy: http://$self:$((8080 + offset)) (HTTP and CONNECT), socks5h://$self:$((1080 + offset)) (SOCKS5); docs/gateway.md" ;;
esac
if [ "${EGRESS_AUTH_DISABLED:-}" = true ]; then
	echo "WARNING: authentication is OFF: anyone who reaches $host may call every API with every role." \
		"EGRESS_LOCAL_AUTH=1 make run uses the sample tokens in deploy/local/tokens."
fi
if [ "$host" != 127.0.0.1 ] && [ "$host" != localhost ] && [ "$host" != ::1 ]; then
	echo "WARNING: listening on $host, not on loopback only (EGRESS_RUN_HOST)."
fi
echo "logs in $logdir/ (also $rundir/latest/); Ctrl-C stops everything"

# Supervise: the first service to exit ends the run.
while :; do
	wait -n -p done_pid "${pids[@]}"
	status=$?
	for i in "${!pids[@]}"; do
		if [ "${pids[$i]}" = "${done_pid:-}" ]; then
			exited "${names[$i]}" "$status"
		fi
	done
done
