#!/usr/bin/env bash
# Runs the lease load benchmark on this machine. Every measured run gets a
# NATS server, a database and a lease service process of its own, so that
# no run pays for the one before it (a run at full speed leaves hundreds of
# thousands of ended leases, whose autovacuum then competes with the next
# run). First lease-load through gRPC at fixed rates (the latency at a given
# load), REPEAT times each, then through gRPC and REST as fast as they go
# (closed loop), then pgbench with a one-row-update transaction on the same
# PostgreSQL server, as fast as it goes and paced at each rate. Figures go to stdout; docs/lease.md records them.
#
#   services/lease/bench/run.sh            # 30s per run
#   DURATION=10s RATES="2000 3000" REPEAT=1 services/lease/bench/run.sh
set -euo pipefail

DURATION=${DURATION:-30s}
CONNS=${CONNS:-32}          # lease service DB pool = pgbench clients
PROXIES=${PROXIES:-1000}
CLIENTS=${CLIENTS:-200}
GRPC_CONNS=${GRPC_CONNS:-4}  # the fleet's gRPC connections to the service
RATES=${RATES:-1000 2000 2500 3000}
REPEAT=${REPEAT:-3}          # runs per rate
TRANSPORTS=${TRANSPORTS:-grpc rest} # the closed-loop runs
LEASE_ARGS=${LEASE_ARGS:-}   # more flags for the lease service, e.g. "--commit-rounds 2"
# The service runs with the garbage collector setting the Helm chart
# recommends for it (components.lease.env).
export GOGC=${GOGC:-400}
PGURL=${PGURL:-postgres://postgres@127.0.0.1:5432}
DB=lease_bench_$$
PGBDB=lease_pgbench_$$
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
svc=() # the NATS server and lease service of the current run
stop_service() {
	for p in "${svc[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${svc[@]}"; do wait "$p" 2>/dev/null || true; done
	svc=()
	psql "$PGURL/postgres" -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
	rm -rf "$work/nats"
}
cleanup() {
	stop_service
	psql "$PGURL/postgres" -qc "DROP DATABASE IF EXISTS $PGBDB WITH (FORCE)" >/dev/null 2>&1 || true
	rm -rf "$work"
}
trap cleanup EXIT

# start_service starts a NATS server, a fresh database and the lease
# service, and waits until the service is ready.
start_service() {
	stop_service
	nats-server -js -a 127.0.0.1 -p 14222 -sd "$work/nats" >"$work/nats.log" 2>&1 &
	svc+=($!)
	psql "$PGURL/postgres" -qc "CREATE DATABASE $DB"
	"$work/lease" --database-url "$PGURL/$DB?sslmode=disable" --database-max-conns "$CONNS" \
		--nats-url nats://127.0.0.1:14222 --auth-token-file "$work/tokens" --rate-limit-lease 0 \
		--grpc-listen 127.0.0.1:18110 --http-listen 127.0.0.1:18111 --log-level warn $LEASE_ARGS 2>"$work/lease.log" &
	svc+=($!)
	for _ in $(seq 100); do
		curl -sf http://127.0.0.1:18111/readyz >/dev/null && return 0
		sleep 0.2 # polling for readiness
	done
	echo "the lease service did not become ready:" >&2
	cat "$work/lease.log" >&2
	return 1
}

# load runs lease-load against a service of its own.
load() {
	start_service
	"$work/lease-load" --grpc-addr 127.0.0.1:18110 --http-addr 127.0.0.1:18111 --conns "$GRPC_CONNS" \
		--token-file "$work/tokens" --nats-url nats://127.0.0.1:14222 --database-url "$PGURL/$DB?sslmode=disable" \
		--proxies "$PROXIES" --clients "$CLIENTS" --duration "$DURATION" --ready-timeout "${READY_TIMEOUT:-60s}" "$@"
}

echo "== machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(psql "$PGURL/postgres" -Atc 'select version()' | cut -d, -f1)"
(cd "$here" && go build -o "$work/lease" . && go build -o "$work/lease-load" ./cmd/lease-load)
echo "load-client load-token-0123456789 crawler" >"$work/tokens"

for rate in $RATES; do
	for run in $(seq "$REPEAT"); do
		echo "== lease-load --transport grpc --rate $rate --proxies $PROXIES --clients $CLIENTS --duration $DURATION (run $run of $REPEAT)"
		load --transport grpc --rate "$rate"
	done
done
for transport in $TRANSPORTS; do
	echo "== lease-load --transport $transport --proxies $PROXIES --clients $CLIENTS --duration $DURATION (closed loop, GOGC=$GOGC)"
	load --transport "$transport"
done
stop_service
secs=${DURATION%s}

echo "== pgbench: one-row UPDATE per transaction, $CONNS clients, $DURATION"
psql "$PGURL/postgres" -qc "CREATE DATABASE $PGBDB"
pgbench -q -i -s 10 "$PGURL/$PGBDB" >/dev/null 2>&1
cat >"$work/update.sql" <<'SQL'
\set aid random(1, 1000000)
UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;
SQL
(cd "$work" && pgbench -n -M prepared -c "$CONNS" -j 2 -T "$secs" -l --log-prefix=pgb -f update.sql "$PGURL/$PGBDB" 2>&1 | grep -E "tps|latency average|transactions actually")
pgbench_latency() {
	cat "$work"/pgb.* | awk '{print $3}' | sort -n | awk '{a[NR]=$1} END {printf "pgbench latency p50 %.2f ms, p99 %.2f ms\n", a[int(NR*0.5)]/1000, a[int(NR*0.99)]/1000}'
	rm -f "$work"/pgb.*
}
pgbench_latency
# The same transaction paced at each rate: the database's own commit
# latency at the rate an acquire's p99 is measured at.
for rate in $RATES; do
	echo "== pgbench: one-row UPDATE per transaction paced at $rate/s, $CONNS clients, $DURATION"
	(cd "$work" && pgbench -n -M prepared -c "$CONNS" -j 2 -T "$secs" -R "$rate" -l --log-prefix=pgb -f update.sql "$PGURL/$PGBDB" 2>&1 | grep -E "tps|latency average")
	pgbench_latency
done
