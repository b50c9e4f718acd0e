#!/usr/bin/env bash
# The GPU run, prepared in advance: on a machine with one CUDA device and only PyTorch (CUDA),
# transformers, grpcio, protobuf, pyarrow and numpy (no Ray, no internet, batchd not installed), in at
# most 8 minutes:
#   1. batchd calibrate on the bench's ~110M model (llama-100m) in bf16: the cost model and the largest
#      token budget this device fits (calibration.toml / .json / .svg);
#   2. batchd bench --device cuda, world size 1: fixed batching, ODB 0.1.2 and batchd padded
#      (batchd-balanced) and packed (batchd-packed) on the same samples (bench.json, the table).
# Everything goes to OUT (default ./gpu-check). batchd runs from this checkout (a site directory of
# links, no pip install); the small wheels a device machine lacks (prometheus-client, and
# online-dynamic-batching for ODB 0.1.2) are installed from benchmarks/gpu/wheels/ when it holds them
# (`benchmarks/gpu/check.sh --fetch-wheels` fills it where an index is reachable), into that site
# directory only.
#
#   benchmarks/gpu/check.sh [--cpu] [--out DIR] [--fetch-wheels]
#
# --cpu runs the same steps on the CPU with the tiny model and small sizes, in about a minute: CI runs
# it (tests/test_gpu_check.py), so the script is known to work before a device runs it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=gpu-check
mode=cuda
while [ $# -gt 0 ]; do
    case $1 in
        --cpu) mode=cpu ;;
        --out) out=$2; shift ;;
        --fetch-wheels)
            python -m pip download --quiet --no-deps --dest "$here/wheels" \
                prometheus-client online-dynamic-batching==0.1.2
            exit 0 ;;
        *) echo "check.sh: unknown argument $1 (--cpu, --out DIR, --fetch-wheels)" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
PY=${PYTHON:-python}

# batchd from this checkout: its package directory plus the layers it installs as subpackages
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
mkdir "$site/batchd"
for entry in "$repo"/batchd/*; do ln -s "$entry" "$site/batchd/"; done
for layer in core proto service client; do ln -s "$repo/$layer" "$site/batchd/$layer"; done
for wheel in "$here"/wheels/*.whl; do
    [ -e "$wheel" ] || continue
    "$PY" -m pip install --quiet --no-index --no-deps --target "$site" "$wheel"
done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

if [ "$mode" = cuda ]; then
    device=cuda; model=llama-100m; dtype=bfloat16; max_tokens=8192; samples=512; budget=16384
else
    device=cpu; model=tiny; dtype=float32; max_tokens=256; samples=24; budget=2048
fi
{
    echo "mode $mode, device $device, model $model ($dtype)"
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
    "$PY" - <<'PYEOF'
import batchd
try:
    import ray  # noqa: F401
    print("ray present")
except ImportError:
    print("ray absent")
print("batchd from", batchd.__file__)
PYEOF
} | tee "$out/environment.txt"

start=$SECONDS
timeout 240 "$PY" -m batchd calibrate --model "$model" --dtype "$dtype" --device "$device" \
    --max-tokens "$max_tokens" --repeats 3 --out "$out/calibration" | tee "$out/calibration.txt"
echo "calibrate: $((SECONDS - start)) s"

start=$SECONDS
systems=fixed,batchd-balanced,batchd-packed
if "$PY" -c 'import odb' 2>/dev/null; then systems=fixed,odb-0.1.2,batchd-balanced,batchd-packed; fi
timeout 300 "$PY" -m batchd bench --device "$device" --world-size 1 --model "$model" \
    --num-samples "$samples" --heldout 8 --token-budget "$budget" --systems "$systems" \
    --out "$out/bench" | tee "$out/bench.txt"
echo "bench: $((SECONDS - start)) s"
echo "check.sh: done; results in $out"
