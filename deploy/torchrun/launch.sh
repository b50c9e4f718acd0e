#!/usr/bin/env bash
# Starts this node's trainers with torchrun against the rank services of a running batchd job
# (started by deploy/ray/start-batchd.sh, docker/compose.yaml or deploy/kubernetes/rayjob.yaml).
# Run it once per node; every node uses the same RDZV_ENDPOINT (a host:port on node 0, or any host
# all nodes reach) and RDZV_ID. NNODES x NPROC_PER_NODE must equal the job's [job].world_size.
#
#   NNODES=2 NPROC_PER_NODE=4 RDZV_ENDPOINT=gpu-node-0:29500 RANK_HOST=batchd-head \
#       deploy/torchrun/launch.sh --checkpoint /ckpt          # extra args go to the trainer
#
# Environment (default):
#   NNODES (1), NPROC_PER_NODE (the number of GPUs, or 1 without any), RDZV_ENDPOINT (127.0.0.1:29500),
#   RDZV_ID (batchd), RDZV_BACKEND (c10d), MAX_RESTARTS (0: a failed rank fails the job fast),
#   RANK_SERVICES: rank service addresses by global rank, a comma list or one address with {rank}
#     (e.g. batchd-rank-{rank}:7100); without it, rank r's service is RANK_HOST:BASE_PORT + r
#     (RANK_HOST default 127.0.0.1, BASE_PORT default 7100),
#   TORCHRUN (torchrun), TRAINER_MODULE (batchd.train: any module with the same flags).
# The trainer (python -m batchd.train --help) uses NCCL on cuda:LOCAL_RANK when CUDA is
# available, else gloo; the global RANK torchrun assigns picks its rank service, so the dynamic
# rendezvous may place ranks on any node.
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
# example: target=--rank-host 127.0.0.1 --base-port 7100
set -euo pipefail

NNODES="${NNODES:-1}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE="$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)"
    ((NPROC_PER_NODE > 0)) || NPROC_PER_NODE=1
fi
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-127.0.0.1:29500}"
RDZV_ID="${RDZV_ID:-batchd}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
TORCHRUN="${TORCHRUN:-torchrun}"
TRAINER_MODULE="${TRAINER_MODULE:-batchd.train}"

if [[ -n "${RANK_SERVICES:-}" ]]; then
    target=(--rank-services "$RANK_SERVICES")
else
    target=(--rank-host "${RANK_HOST:-127.0.0.1}" --base-port "${BASE_PORT:-7100}")
fi

echo "launch: $NNODES node(s) x $NPROC_PER_NODE trainer(s), rendezvous $RDZV_BACKEND://$RDZV_ENDPOINT/$RDZV_ID," \
     "rank services: ${target[*]}" >&2
# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments ("python -m torch.distributed.run")
exec $TORCHRUN --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend "$RDZV_BACKEND" --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" \
    --max-restarts "$MAX_RESTARTS" \
    -m "$TRAINER_MODULE" "${target[@]}" "$@"
