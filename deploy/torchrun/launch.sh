#!/usr/bin/env bash
# Starts this node's trainers with torchrun against a running batchd job. Run it once per GPU node.
# NNODES x NPROC_PER_NODE must equal the job's [job].world_size. Three ways to reach the data:
#
#   node agent (the recommended layout): one `batchd node` per GPU host, beside its trainers
#   (deploy/ray/start-node-agent.sh, docker/compose.yaml, the node-agent sidecar of
#   deploy/kubernetes/*.yaml). Every local trainer connects to it over loopback with its global RANK:
#     NNODES=2 NODE_RANK=1 NPROC_PER_NODE=4 RDZV_ENDPOINT=gpu-node-0:29500 NODE_AGENT=127.0.0.1:7100 \
#         deploy/torchrun/launch.sh --checkpoint /ckpt          # extra args go to the trainer
#   The agent of node G serves global ranks G*K .. G*K+K-1, so torchrun must give this node the same
#   group rank: in this mode the rendezvous is static (RDZV_BACKEND=static, --node-rank $NODE_RANK,
#   RDZV_ENDPOINT = node 0's host:port), not c10d's join order.
#
#   per-rank services: RANK_SERVICES = their addresses by global rank, a comma list or one address
#   with {rank} (e.g. batchd-rank-{rank}:7100), or RANK_HOST + BASE_PORT (rank r at RANK_HOST:BASE_PORT + r,
#   the layout of deploy/ray/start-batchd.sh; the default: 127.0.0.1:7100 + r).
#
# Environment (default):
#   LAUNCH_MODE: node-agent | rank-services | rank-host (default: node-agent when NODE_AGENT or
#     BATCHD_NODE_AGENT is set, rank-services when RANK_SERVICES is set, else rank-host),
#   NODE_AGENT (node-agent mode: $BATCHD_NODE_AGENT, else 127.0.0.1:7100), NODE_RANK (0; node-agent mode),
#   NNODES (1), NPROC_PER_NODE (the number of GPUs, or 1 without any), RDZV_ENDPOINT (127.0.0.1:29500),
#   RDZV_ID (batchd), RDZV_BACKEND (static in node-agent mode, else c10d), MAX_RESTARTS (0: a failed
#   rank fails the job fast), TORCHRUN (torchrun), TRAINER_MODULE (batchd.train: any module with the
#   same flags).
# The trainer (python -m batchd.train --help) uses NCCL on cuda:LOCAL_RANK when CUDA is available,
# else gloo; its global RANK picks its rank (from the node agent, or its own rank service).
#
# Example values (tests/test_deploy_files.py expands the torchrun command below with them):
# example: TORCHRUN=torchrun
# example: NNODES=1
# example: NPROC_PER_NODE=2
# example: RDZV_BACKEND=c10d
# example: RDZV_ENDPOINT=127.0.0.1:29500
# example: RDZV_ID=batchd
# example: MAX_RESTARTS=0
# example: TRAINER_MODULE=batchd.train
# example: node=
# example: target=--rank-host 127.0.0.1 --base-port 7100
set -euo pipefail

NNODES="${NNODES:-1}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE="$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)"
    ((NPROC_PER_NODE > 0)) || NPROC_PER_NODE=1
fi
if [[ -z "${LAUNCH_MODE:-}" ]]; then
    if [[ -n "${NODE_AGENT:-}${BATCHD_NODE_AGENT:-}" ]]; then
        LAUNCH_MODE=node-agent
    elif [[ -n "${RANK_SERVICES:-}" ]]; then
        LAUNCH_MODE=rank-services
    else
        LAUNCH_MODE=rank-host
    fi
fi
node=()
case "$LAUNCH_MODE" in
    node-agent)
        NODE_AGENT="${NODE_AGENT:-${BATCHD_NODE_AGENT:-127.0.0.1:7100}}"
        target=(--node-agent "$NODE_AGENT")
        RDZV_BACKEND="${RDZV_BACKEND:-static}"
        node=(--node-rank "${NODE_RANK:-0}")   # = the agent's --node-rank (static rendezvous)
        ;;
    rank-services)
        [[ -n "${RANK_SERVICES:-}" ]] || { echo "launch: LAUNCH_MODE=rank-services needs RANK_SERVICES" >&2; exit 2; }
        target=(--rank-services "$RANK_SERVICES")
        ;;
    rank-host)
        target=(--rank-host "${RANK_HOST:-127.0.0.1}" --base-port "${BASE_PORT:-7100}")
        ;;
    *)
        echo "launch: LAUNCH_MODE must be node-agent, rank-services or rank-host, got '$LAUNCH_MODE'" >&2
        exit 2
        ;;
esac
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-127.0.0.1:29500}"
RDZV_ID="${RDZV_ID:-batchd}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
TORCHRUN="${TORCHRUN:-torchrun}"
TRAINER_MODULE="${TRAINER_MODULE:-batchd.train}"

echo "launch: $NNODES node(s) x $NPROC_PER_NODE trainer(s), rendezvous $RDZV_BACKEND://$RDZV_ENDPOINT/$RDZV_ID" \
     "${node[*]}, data: ${target[*]}" >&2
# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments ("python -m torch.distributed.run")
exec $TORCHRUN --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" "${node[@]}" \
    --rdzv-backend "$RDZV_BACKEND" --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" \
    --max-restarts "$MAX_RESTARTS" \
    -m "$TRAINER_MODULE" "${target[@]}" "$@"
