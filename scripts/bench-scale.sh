#!/usr/bin/env bash
# make bench-scale: the figures of docs/benchmarks/scale.md, in one run, each
# beside its baseline measured in the same run (the machine is shared and
# noisy). Benchmarks only: nothing here runs in `make test`.
#
#   scripts/bench-scale.sh                       # everything
#   PARTS="lease health" scripts/bench-scale.sh  # some parts
#   CONVERGE_SIZES="10000 100000" SIM_CONVERGE_SIZES=10000 LEASE_DURATION=15s STEADY_SECONDS=20 RESYNC_SIZES=100000
#   HEALTH_MEMORY_SIZES="10000 100000" HEALTH_MEMORY_SECONDS=60
set -euo pipefail

PARTS=${PARTS:-orchestrator lease health resync}
CONVERGE_SIZES=${CONVERGE_SIZES:-10000 100000}
SIM_CONVERGE_SIZES=${SIM_CONVERGE_SIZES:-10000}
STEADY_SECONDS=${STEADY_SECONDS:-20}
LEASE_DURATION=${LEASE_DURATION:-15s}
LEASE_SIZES=${LEASE_SIZES:-1000 100000}
LEASE_STORE=${LEASE_STORE:-yes}
LEASE_LOOPS=${LEASE_LOOPS:-20000}
HEALTH_SECONDS=${HEALTH_SECONDS:-10}
HEALTH_MEMORY_SIZES=${HEALTH_MEMORY_SIZES:-10000 100000}
HEALTH_MEMORY_SECONDS=${HEALTH_MEMORY_SECONDS:-60}
RESYNC_SIZES=${RESYNC_SIZES:-100000}
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

load() { cut -d' ' -f1-3 /proc/loadavg; }
echo "== bench-scale $(date -u +%FT%TZ) at $(git rev-parse --short HEAD)"
echo "== machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/ {print $2}') GiB, $(go version | cut -d' ' -f3), load average $(load)"

for part in $PARTS; do
	case $part in
	orchestrator)
		echo "== orchestrator: converge 0 -> N Running (BenchmarkConverge, N = $CONVERGE_SIZES) followed by a watcher, then ${STEADY_SECONDS}s steady, the listing, and N Running -> Ready on published health verdicts; load average $(load)"
		(cd services/orchestrator && BENCH_CONVERGE_SIZES="$CONVERGE_SIZES" BENCH_STEADY_SECONDS="$STEADY_SECONDS" \
			go test -run '^$' -bench BenchmarkConverge -benchtime 1x -timeout 60m ./internal/dispatch/ | grep -E '^Benchmark|^ok|FAIL')
		if [ -n "${SIM_CONVERGE_SIZES// /}" ]; then
			echo "== orchestrator: converge 0 -> N Running on the fleet simulator (provisioner-sim and its farm as processes, N = $SIM_CONVERGE_SIZES); load average $(load)"
			(cd services/orchestrator && BENCH_CONVERGE_BACKEND=sim BENCH_CONVERGE_SIZES="$SIM_CONVERGE_SIZES" \
				go test -run '^$' -bench BenchmarkConverge -benchtime 1x -timeout 60m ./internal/dispatch/ | grep -E '^Benchmark|^ok|FAIL')
		fi
		;;
	lease)
		if [ "$LEASE_STORE" = yes ]; then
			echo "== lease: selection at 1,000 vs 100,000 proxies (BenchmarkLoop, 200 callers on the store, ${LEASE_LOOPS} loops each); load average $(load)"
			(cd services/lease && go test -run '^$' -bench 'BenchmarkLoop/callers=200/rounds=1$|BenchmarkLoop/callers=200/rounds=1/proxies=' \
				-benchtime "${LEASE_LOOPS}x" -timeout 30m ./internal/store/ | grep -E '^Benchmark|^ok|FAIL')
		fi
		for n in $LEASE_SIZES; do
			echo "== lease: closed loop through the service at $n proxies, then pgbench on the same server; load average $(load)"
			# REST only at a small pool: its ListProxies, which the load
			# waits on, answers the whole pool in one message, beyond the
			# gateway's 4 MiB from some 20,000 proxies on.
			transports="grpc rest"
			[ "$n" -le 10000 ] || transports=grpc
			PROXIES=$n RATES=" " TRANSPORTS="$transports" DURATION="$LEASE_DURATION" READY_TIMEOUT=20m services/lease/bench/run.sh 2>&1 |
				grep -v '^== machine' || echo "== lease at $n proxies failed"
		done
		;;
	health)
		echo "== health: CPU per probe at 1 Hz, 1,000 proxies, one core (BenchmarkProbeAt1Hz, ${HEALTH_SECONDS} s); load average $(load)"
		(cd services/health && go test -run '^$' -bench 'BenchmarkProbeAt1Hz/proxies=1000' -benchtime "${HEALTH_SECONDS}x" -cpu 1 -timeout 20m ./internal/bench/ | grep -E '^Benchmark|^ok|FAIL')
		if [ -n "${HEALTH_MEMORY_SIZES// /}" ]; then
			echo "== health: the service as a process, its memory after resyncing N proxies and after ${HEALTH_MEMORY_SECONDS}s probing them (BenchmarkProcessMemory, N = $HEALTH_MEMORY_SIZES); load average $(load)"
			(cd services/health && BENCH_RESYNC_SIZES="$HEALTH_MEMORY_SIZES" BENCH_STEADY_SECONDS="$HEALTH_MEMORY_SECONDS" \
				go test -run '^$' -bench BenchmarkProcessMemory -benchtime 1x -timeout 30m . | grep -E '^Benchmark|^ok|FAIL')
		fi
		;;
	resync)
		echo "== resync: lease and health each resync N proxies from an orchestrator answering from memory (BenchmarkResync), and the lease follows N creation events (BenchmarkFollow), N = $RESYNC_SIZES; load average $(load)"
		(cd services/lease && BENCH_RESYNC_SIZES="$RESYNC_SIZES" go test -run '^$' -bench 'BenchmarkResync|BenchmarkFollow' -benchtime 1x -timeout 30m ./internal/mirror/ | grep -E '^Benchmark|^ok|FAIL')
		(cd services/health && BENCH_RESYNC_SIZES="$RESYNC_SIZES" go test -run '^$' -bench BenchmarkResync -benchtime 1x -timeout 30m ./internal/fleet/ | grep -E '^Benchmark|^ok|FAIL')
		;;
	*)
		echo "unknown part $part (orchestrator, lease, health, resync)" >&2
		exit 2
		;;
	esac
done
echo "== done $(date -u +%FT%TZ), load average $(load)"
