#!/usr/bin/env bash
# Starts the head's part of a batchd job on this node of a Ray cluster, from the job config:
#
#   --coordinator-only: `batchd coordinator` alone. The layout with node agents: the head runs the
#     coordinator (metadata only), and every GPU node runs one `batchd node` beside its trainers
#     (deploy/ray/start-node-agent.sh), so batches never cross the network from the head.
#   default (one machine, or the per-rank layout): `batchd coordinator` and WORLD_SIZE x `batchd rank`
#     (rank r on port base_port + r), all on this node; trainers elsewhere reach rank r at
#     HEAD:base_port + r (deploy/torchrun/launch.sh with RANK_HOST). Each rank service
# preprocesses its view of [data].dataset with Ray actors that join the cluster ([data].ray_address,
# "auto" on a `ray up` node or in a KubeRay pod), so the actors run on any node with free CPUs.
# Without [data].ray_address the rank services still share one Ray: each joins the Ray already running
# on this node, and the first one started (they serialize on a lock file) starts it and keeps it up
# until the others have exited.
#
#   deploy/ray/start-batchd.sh [--coordinator-only] [CONFIG]   # CONFIG: $BATCHD_CONFIG or /etc/batchd/job.toml
#   ray exec deploy/ray/cluster.yaml --tmux \
#       'bash ~/batchd/deploy/ray/start-batchd.sh --coordinator-only ~/batchd/deploy/ray/job.toml'
#
# The layout (world size, ports, coordinator address) is read from the config, one source of truth;
# COORD_ADDRESS in the environment overrides [coordinator].address. The script stays in the
# foreground until every service has exited (the epoch ended, or the job failed: then every party
# fails fast naming the failed rank, and the script exits non-zero); SIGTERM/SIGINT stop them all.
# Logs: $BATCHD_LOG_DIR/{coordinator,rank-R}.log (default /tmp/batchd-logs).
#
# Example values (tests/test_deploy_files.py expands the batchd commands below with them):
# example: CONFIG=deploy/ray/job.toml
# example: BATCHD=batchd
# example: LOG_DIR=/tmp/batchd-logs
# example: WORLD_SIZE=2
# example: COORD_ADDRESS=127.0.0.1:7000
# example: COORD_PORT=7000
# example: COORD_METRICS_PORT=9100
# example: RANK_BASE_PORT=7100
# example: RANK_METRICS_BASE_PORT=9200
# example: r=0
set -euo pipefail

ROLE=all
if [[ "${1:-}" == --coordinator-only ]]; then
    ROLE=coordinator
    shift
fi
CONFIG="${1:-${BATCHD_CONFIG:-/etc/batchd/job.toml}}"
BATCHD="${BATCHD:-batchd}"
PYTHON="${PYTHON:-python3}"
LOG_DIR="${BATCHD_LOG_DIR:-/tmp/batchd-logs}"
[[ -r "$CONFIG" ]] || { echo "start-batchd: cannot read the job config CONFIG=$CONFIG" >&2; exit 2; }
mkdir -p "$LOG_DIR"

# WORLD_SIZE, COORD_PORT, COORD_METRICS_PORT, COORD_ADDRESS, RANK_BASE_PORT, RANK_METRICS_BASE_PORT
layout="$("$PYTHON" - "$CONFIG" <<'PY'
import shlex, sys, tomllib

with open(sys.argv[1], "rb") as f:
    cfg = tomllib.load(f)
job, coord, rank = cfg["job"], cfg.get("coordinator", {}), cfg.get("rank", {})
port = int(coord.get("port", 7000))
values = {
    "WORLD_SIZE": int(job["world_size"]),
    "COORD_PORT": port,
    "COORD_METRICS_PORT": int(coord.get("metrics_port", 9100)),
    "CONFIG_COORD_ADDRESS": coord.get("address", f"127.0.0.1:{port}"),
    "RANK_BASE_PORT": int(rank.get("base_port", 7100)),
    "RANK_METRICS_BASE_PORT": int(rank.get("metrics_base_port", 9200)),
}
for key, value in values.items():
    print(f"{key}={shlex.quote(str(value))}")
PY
)"
eval "$layout"
COORD_ADDRESS="${COORD_ADDRESS:-$CONFIG_COORD_ADDRESS}"

pids=()
stop() {
    trap - TERM INT
    echo "start-batchd: stopping ${#pids[@]} services" >&2
    kill -TERM "${pids[@]}" 2>/dev/null || true
}
trap stop TERM INT

"$BATCHD" coordinator --config "$CONFIG" --port "$COORD_PORT" --metrics-port "$COORD_METRICS_PORT" \
    >"$LOG_DIR/coordinator.log" 2>&1 &
pids+=("$!")
echo "start-batchd: coordinator pid $! on port $COORD_PORT (metrics $COORD_METRICS_PORT)" >&2

if [[ "$ROLE" == coordinator ]]; then
    WORLD_SIZE=0   # the node agents (deploy/ray/start-node-agent.sh, one per GPU node) serve the ranks
    echo "start-batchd: coordinator only; start a node agent on every GPU node" >&2
fi
for ((r = 0; r < WORLD_SIZE; r++)); do
    "$BATCHD" rank --config "$CONFIG" --rank "$r" --coordinator "$COORD_ADDRESS" \
        --port "$((RANK_BASE_PORT + r))" --metrics-port "$((RANK_METRICS_BASE_PORT + r))" \
        >"$LOG_DIR/rank-$r.log" 2>&1 &
    pids+=("$!")
    echo "start-batchd: rank $r pid $! on port $((RANK_BASE_PORT + r)) (metrics $((RANK_METRICS_BASE_PORT + r)))" >&2
done

status=0
for i in "${!pids[@]}"; do
    code=0
    wait "${pids[$i]}" || code=$?
    if ((code != 0)); then
        name=$([ "$i" -eq 0 ] && echo coordinator || echo "rank $((i - 1))")
        echo "start-batchd: $name (pid ${pids[$i]}) exited with status $code" >&2
        status=$code
    fi
done
if ((status != 0)); then
    echo "start-batchd: a service failed (exit $status); see $LOG_DIR/*.log" >&2
    tail -n 5 "$LOG_DIR"/*.log >&2 || true
fi
exit "$status"
