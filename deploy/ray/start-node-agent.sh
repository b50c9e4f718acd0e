#!/usr/bin/env bash
# Starts this GPU node's batchd node agent: one `batchd node` serving the global ranks of the K trainers
# on this host (NODE_RANK*K .. NODE_RANK*K+K-1) on ONE port, beside them. Run it on every GPU node of a
# job, before or together with deploy/torchrun/launch.sh (NODE_AGENT=127.0.0.1:<port>, same NODE_RANK);
# the head runs the coordinator (deploy/ray/start-batchd.sh --coordinator-only).
#
#   NODE_RANK=1 deploy/ray/start-node-agent.sh [CONFIG] [extra batchd node flags]
#   # CONFIG default: $BATCHD_CONFIG or /etc/batchd/job.toml
#
# What crosses the network: the agent's one metadata stream to the coordinator, and the payloads of
# samples the balanced plan moves to or from another node (peers dial ADVERTISE:port). Batches reach
# the local trainers over loopback; the preprocessing actors join the cluster's Ray ([data].ray_address,
# "auto" on a `ray up` node; RAY_ADDRESS overrides) and prefer this node (soft affinity).
#
# Environment (default):
#   NODE_RANK (required: this node's index 0..NNODES-1, = torchrun's --node-rank on this node),
#   LOCAL_RANKS (trainers on this node: $LOCAL_WORLD_SIZE, else the number of GPUs, else 1),
#   COORD_ADDRESS (the config's [coordinator].address; when that is a loopback address and this node
#     is in a Ray cluster: the Ray head's IP with [coordinator].port, the head runs the coordinator),
#   ADVERTISE (this node's first IP address: the address peers on other nodes use to reach the agent),
#   NODE_NAME (the hostname), RAY_ADDRESS (the config's [data].ray_address), BATCHD (batchd),
#   PYTHON (python3).
# The agent listens on [rank].base_port (its /metrics on [rank].metrics_base_port) of [rank].host, and
# journals to [rank].state_dir: killed and restarted with the same command (same state dir) within the
# coordinator's lease, it resumes its ranks and its trainers reconnect. It exits when the job ends.
#
# Example values (tests/test_deploy_files.py expands the batchd command below with them):
# example: CONFIG=deploy/ray/job.toml
# example: BATCHD=batchd
# example: COORD_ADDRESS=10.0.0.1:7000
# example: LOCAL_RANKS=4
# example: NODE_RANK=1
# example: NODE_NAME=gpu-node-1
# example: ADVERTISE=10.0.0.3
# example: RANK_BASE_PORT=7100
# example: RANK_METRICS_BASE_PORT=9200
# example: ray=--ray-address auto
set -euo pipefail

CONFIG="${1:-${BATCHD_CONFIG:-/etc/batchd/job.toml}}"
shift || true
BATCHD="${BATCHD:-batchd}"
PYTHON="${PYTHON:-python3}"
[[ -r "$CONFIG" ]] || { echo "start-node-agent: cannot read the job config CONFIG=$CONFIG" >&2; exit 2; }
[[ -n "${NODE_RANK:-}" ]] || { echo "start-node-agent: set NODE_RANK (this node's index, as torchrun's)" >&2; exit 2; }

# COORD_PORT, CONFIG_COORD_ADDRESS, RANK_BASE_PORT, RANK_METRICS_BASE_PORT
layout="$("$PYTHON" - "$CONFIG" <<'PY'
import shlex, sys, tomllib

with open(sys.argv[1], "rb") as f:
    cfg = tomllib.load(f)
coord, rank = cfg.get("coordinator", {}), cfg.get("rank", {})
port = int(coord.get("port", 7000))
values = {
    "COORD_PORT": port,
    "CONFIG_COORD_ADDRESS": coord.get("address", f"127.0.0.1:{port}"),
    "RANK_BASE_PORT": int(rank.get("base_port", 7100)),
    "RANK_METRICS_BASE_PORT": int(rank.get("metrics_base_port", 9200)),
}
for key, value in values.items():
    print(f"{key}={shlex.quote(str(value))}")
PY
)"
eval "$layout"

if [[ -z "${COORD_ADDRESS:-}" ]]; then
    COORD_ADDRESS="$CONFIG_COORD_ADDRESS"
    # A loopback address in the config means "the head's own node": from a worker that is the Ray head.
    if [[ "$COORD_ADDRESS" =~ ^(127\.|localhost:) && -r /tmp/ray/ray_current_cluster ]]; then
        gcs="$(head -n 1 /tmp/ray/ray_current_cluster)"
        COORD_ADDRESS="${gcs%:*}:$COORD_PORT"
    fi
fi
if [[ -z "${LOCAL_RANKS:-}" ]]; then
    LOCAL_RANKS="${LOCAL_WORLD_SIZE:-$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)}"
    ((LOCAL_RANKS > 0)) || LOCAL_RANKS=1
fi
ADVERTISE="${ADVERTISE:-$(hostname -I 2>/dev/null | awk '{print $1}' || true)}"
ADVERTISE="${ADVERTISE:-$(hostname)}"
NODE_NAME="${NODE_NAME:-$(hostname)}"
ray=()
if [[ -n "${RAY_ADDRESS:-}" ]]; then
    ray=(--ray-address "$RAY_ADDRESS")
fi

echo "start-node-agent: node $NODE_RANK ($NODE_NAME, $ADVERTISE:$RANK_BASE_PORT) serves ranks" \
     "$((NODE_RANK * LOCAL_RANKS))..$((NODE_RANK * LOCAL_RANKS + LOCAL_RANKS - 1)), coordinator $COORD_ADDRESS" >&2
exec "$BATCHD" node --config "$CONFIG" --coordinator "$COORD_ADDRESS" --local-ranks "$LOCAL_RANKS" \
    --node-rank "$NODE_RANK" --name "$NODE_NAME" --advertise "$ADVERTISE" \
    --port "$RANK_BASE_PORT" --metrics-port "$RANK_METRICS_BASE_PORT" "${ray[@]}" "$@"
