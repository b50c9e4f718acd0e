#!/usr/bin/env bash
# docker/compose.yaml run for real on one CPU host (no GPU, no image registry): the coordinator, the
# node agent (embedded Ray, 2 local ranks) and a torchrun trainer with 2 gloo ranks train one epoch of
# a generated demo dataset; then the script checks that every container exited 0, that every sample id
# of the epoch was trained exactly once, and that both ranks ran the same number of steps.
#
#   sudo deploy/smoke/compose.sh            # from anywhere; exits 0 on PASS, 1 on FAIL
#
# What it does (as root):
#   1. starts dockerd if none answers: `dockerd --bridge=none --iptables=false` (host networking only:
#      no bridge, no iptables rules, so the host's network is left alone), and stops it at the end;
#   2. uses `docker compose` (v2 plugin) or a v2 `docker-compose`; on Debian bookworm, whose package is
#      Compose v1, it fetches Debian trixie's docker-compose package (v2) with a private apt state dir
#      (the host's apt sources are not changed) into /usr/local/lib/docker/cli-plugins;
#   3. imports a base image $BASE_IMAGE when missing: `debootstrap --variant=minbase bookworm` with
#      python3 + python3-venv, the host's CA bundle (so pip works behind a TLS-intercepting proxy; the
#      image sets PIP_CERT), `docker import`;
#   4. builds docker/Dockerfile.cpu with --build-arg BASE=$BASE_IMAGE (--network host); a local CPU
#      torch wheel (TORCH_WHEEL_DIR, else /opt/wheels or pip's find-links) is served to the build on
#      loopback (PIP_FIND_LINKS), else pip uses TORCH_INDEX_URL;
#   5. generates the data in the image: $SAMPLES demo records (no bad ones) and the demo tokenizer;
#   6. `docker compose -f compose.yaml -f compose.cpu.yaml up` (project batchd-smoke);
#   7. checks exit codes (docker inspect), the trainers' --ids-log and --summary files;
#   8. prints wall time, image sizes and PASS/FAIL, then `docker compose down -v`.
#
# Environment (all optional):
# example: SAMPLES=256
# example: BASE_IMAGE=batchd-base:bookworm
# example: BATCHD_CPU_IMAGE=batchd:0.1.0-cpu
# example: TORCH_WHEEL_DIR=/opt/wheels
# example: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# example: WORK=/tmp/batchd-smoke
# example: TIMEOUT_S=1200
# example: WHEEL_PORT=18765
# example: KEEP_DOCKERD=1
# example: KEEP_WORK=1
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SAMPLES=${SAMPLES:-256}
BASE_IMAGE=${BASE_IMAGE:-batchd-base:bookworm}
CPU_IMAGE=${BATCHD_CPU_IMAGE:-batchd:0.1.0-cpu}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
TIMEOUT_S=${TIMEOUT_S:-1200}
WHEEL_PORT=${WHEEL_PORT:-18765}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PROJECT=batchd-smoke
START=$(date +%s)
WORK=${WORK:-$(mktemp -d /tmp/batchd-smoke.XXXXXX)}
mkdir -p "$WORK"
STARTED_DOCKERD=""
HTTP_PID=""
COMPOSE=()
RESULT=FAIL

log() { printf '[smoke %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() { log "ERROR: $*"; exit 1; }

cleanup() {
    local rc=$?
    set +e
    if [[ ${#COMPOSE[@]} -gt 0 ]]; then
        if [[ $RESULT != PASS ]]; then
            log "container logs (last 40 lines each):"
            "${COMPOSE[@]}" logs --no-color --tail 40 2>&1 | sed 's/^/    /'
        fi
        log "teardown: docker compose down -v"
        "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1
    fi
    [[ -n $HTTP_PID ]] && kill "$HTTP_PID" 2>/dev/null
    if [[ -n $STARTED_DOCKERD && -z ${KEEP_DOCKERD:-} ]]; then
        log "stopping the dockerd this script started (pid $STARTED_DOCKERD)"
        kill "$STARTED_DOCKERD" 2>/dev/null
        for _ in $(seq 30); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 1; done
    fi
    if [[ -z ${KEEP_WORK:-} && $RESULT == PASS ]]; then rm -rf "$WORK"; else log "work dir kept: $WORK"; fi
    exit "$rc"
}
trap cleanup EXIT

[[ $(id -u) == 0 ]] || die "run as root (dockerd, debootstrap, docker import)"
command -v docker >/dev/null || die "no docker CLI (apt-get install docker.io)"

# -- 1. dockerd -------------------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || die "no dockerd (apt-get install docker.io)"
    log "starting dockerd --bridge=none --iptables=false (log: $WORK/dockerd.log)"
    dockerd --bridge=none --iptables=false >"$WORK/dockerd.log" 2>&1 &
    STARTED_DOCKERD=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || die "dockerd did not come up: $(tail -5 "$WORK/dockerd.log")"
fi

# -- 2. compose v2 ------------------------------------------------------------------------------------
compose_v2() {
    if docker compose version >/dev/null 2>&1; then echo "docker compose"
    elif command -v docker-compose >/dev/null && docker-compose version 2>/dev/null | grep -q 'version v\?2'; then
        echo docker-compose
    else return 1
    fi
}
if ! compose_cmd=$(compose_v2); then
    log "no Compose v2 (Debian bookworm's docker-compose is v1): fetching Debian trixie's docker-compose"
    apt_dir="$WORK/apt-trixie"
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial"
    echo "deb $DEBIAN_MIRROR trixie main" >"$apt_dir/sources.list"
    apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null -o APT::Sandbox::User=root
              -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache::Archives=$apt_dir/archives")
    apt-get "${apt_opts[@]}" update -qq
    (cd "$apt_dir" && apt-get "${apt_opts[@]}" download docker-compose >/dev/null 2>&1)
    dpkg-deb -x "$apt_dir"/docker-compose_*.deb "$apt_dir/x"
    install -D -m 0755 "$apt_dir/x/usr/libexec/docker/cli-plugins/docker-compose" \
        /usr/local/lib/docker/cli-plugins/docker-compose
    compose_cmd=$(compose_v2) || die "could not install Compose v2"
fi
read -ra COMPOSE_BIN <<<"$compose_cmd"
log "compose: $("${COMPOSE_BIN[@]}" version | head -1); docker server $(docker version -f '{{.Server.Version}}')"

# -- 3. base image ------------------------------------------------------------------------------------
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
    rootfs="$WORK/rootfs"
    log "debootstrap --variant=minbase bookworm -> $BASE_IMAGE (a few minutes)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
        "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 || die "debootstrap failed: $(tail -3 "$WORK/debootstrap.log")"
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"  # this host's CAs
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' \
        -c 'ENV LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt' - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
fi

# -- 4. images ----------------------------------------------------------------------------------------
build_args=(--build-arg "BASE=$BASE_IMAGE")
wheel_dir=${TORCH_WHEEL_DIR:-}
if [[ -z $wheel_dir ]]; then
    for d in /opt/wheels "$REPO/.whl" $(pip config get global.find-links 2>/dev/null || true); do
        if compgen -G "$d/torch-$TORCH_VERSION+cpu-cp311-*.whl" >/dev/null; then wheel_dir=$d; break; fi
    done
fi
if [[ -n $wheel_dir ]]; then
    port=$WHEEL_PORT  # fixed, so that the build args (and the layer cache) stay the same run to run
    python3 -m http.server --bind 127.0.0.1 "$port" --directory "$wheel_dir" >"$WORK/wheels-http.log" 2>&1 &
    HTTP_PID=$!
    sleep 1
    log "serving the local CPU torch wheel from $wheel_dir to the build (http://127.0.0.1:$port/)"
    build_args+=(--build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/" --build-arg "TORCH_INDEX_URL=https://pypi.org/simple")
else
    build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
fi
log "docker build -f docker/Dockerfile.cpu -t $CPU_IMAGE (BASE=$BASE_IMAGE; log: $WORK/build.log)"
build_start=$(date +%s)
# The classic builder: BuildKit would fetch the `# syntax=` frontend image from a registry.
DOCKER_BUILDKIT=0 docker build --network host "${build_args[@]}" -f "$REPO/docker/Dockerfile.cpu" \
    -t "$CPU_IMAGE" "$REPO" >"$WORK/build.log" 2>&1 || die "build failed: $(tail -20 "$WORK/build.log")"
BUILD_S=$(( $(date +%s) - build_start ))
[[ -n $HTTP_PID ]] && { kill "$HTTP_PID" 2>/dev/null; HTTP_PID=""; }
log "built in ${BUILD_S}s: $(docker run --rm --network none --entrypoint python "$CPU_IMAGE" -c \
    'import batchd, ray, torch; print("torch", torch.__version__, "ray", ray.__version__)')"

# -- 5. data --------------------------------------------------------------------------------------------
mkdir -p "$WORK/data" "$WORK/models" "$WORK/checkpoints"
chown 1000:1000 "$WORK/data" "$WORK/models" "$WORK/checkpoints"   # the images' user batchd
docker run --rm --network none -v "$WORK/data:/data" -v "$WORK/models:/models" --entrypoint python "$CPU_IMAGE" -c "
from pathlib import Path
from batchd.preprocess import make_demo_dataset
ds = make_demo_dataset('/data/gen', $SAMPLES, bad_fraction=0.0)
ds.path.rename('/data/train.parquet')
import pyarrow.parquet as pq
print(pq.read_metadata('/data/train.parquet').num_rows)
" >"$WORK/records" || die "data generation failed"
docker run --rm --network none -v "$WORK/models:/models" "$CPU_IMAGE" tokenizer /models/tokenizer.json >/dev/null \
    || die "tokenizer generation failed"
RECORDS=$(tail -1 "$WORK/records")
log "data: $RECORDS records in $WORK/data/train.parquet, tokenizer in $WORK/models/tokenizer.json"

# -- 6. compose up ----------------------------------------------------------------------------------------
for port in 7000 7100 9100 9200 29500; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then die "port $port is in use on this host (host networking)"; fi
done
export BATCHD_TOKEN BATCHD_DATA="$WORK/data" BATCHD_MODELS="$WORK/models" BATCHD_CHECKPOINTS="$WORK/checkpoints"
export BATCHD_CPU_IMAGE="$CPU_IMAGE"
BATCHD_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
COMPOSE=("${COMPOSE_BIN[@]}" -p "$PROJECT" --project-directory "$REPO/docker"
         -f "$REPO/docker/compose.yaml" -f "$REPO/docker/compose.cpu.yaml")
"${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
log "docker compose up (coordinator, node-agent, trainer x 2 gloo ranks; log: $WORK/compose.log)"
up_start=$(date +%s)
set +e
timeout "$TIMEOUT_S" "${COMPOSE[@]}" up --no-build --no-color >"$WORK/compose.log" 2>&1
UP_RC=$?
set -e
UP_S=$(( $(date +%s) - up_start ))
log "compose up returned $UP_RC after ${UP_S}s"

# -- 7. checks ----------------------------------------------------------------------------------------------
fails=()
[[ $UP_RC == 0 ]] || fails+=("docker compose up exited $UP_RC")
for svc in coordinator node-agent trainer; do
    cid=$("${COMPOSE[@]}" ps -aq "$svc" 2>/dev/null | head -1)
    if [[ -z $cid ]]; then fails+=("$svc: no container"); continue; fi
    state=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$cid")
    log "  $svc: $state"
    [[ $state == "exited 0" ]] || fails+=("$svc: $state")
done
check=$(docker run --rm --network none -v "$WORK/checkpoints:/c:ro" --entrypoint python "$CPU_IMAGE" -c "
import collections, json, pathlib
n = $RECORDS
counts, steps, problems = collections.Counter(), {}, []
for r in (0, 1):
    f = pathlib.Path(f'/c/ids-{r}.jsonl')
    if not f.exists():
        problems.append(f'rank {r}: no ids log'); continue
    lines = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    steps[r] = len({(l['epoch'], l['step']) for l in lines})
    if steps[r] != len(lines):
        problems.append(f'rank {r}: a step logged twice')
    counts.update(i for l in lines for i in l['ids'])
    s = pathlib.Path(f'/c/summary-{r}.json')
    summ = json.loads(s.read_text()) if s.exists() else {}
    if summ.get('steps') != steps[r]:
        problems.append(f'rank {r}: summary steps {summ.get(\"steps\")} != {steps[r]} logged')
    print(f'rank {r}: {steps[r]} steps, {sum(len(l[\"ids\"]) for l in lines)} samples, loss {summ.get(\"loss\", summ.get(\"last_loss\"))}')
if len(set(steps.values())) != 1:
    problems.append(f'ranks ran different step counts: {steps}')
missing = sorted(set(range(n)) - set(counts))
dup = sorted(i for i, c in counts.items() if c > 1)
extra = sorted(set(counts) - set(range(n)))
print(f'ids: {len(counts)} distinct of {n}, missing {len(missing)}, duplicated {len(dup)}, unknown {len(extra)}')
if missing or dup or extra:
    problems.append(f'ids: missing {missing[:10]} duplicated {dup[:10]} unknown {extra[:10]}')
for p in problems:
    print('PROBLEM', p)
") || fails+=("the ids check did not run")
while IFS= read -r line; do
    log "  $line"
    [[ $line == PROBLEM* ]] && fails+=("${line#PROBLEM }")
done <<<"$check"

# -- 8. summary -------------------------------------------------------------------------------------------------
[[ ${#fails[@]} == 0 ]] && RESULT=PASS
log "images:"
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "^(${BASE_IMAGE%%:*}|${CPU_IMAGE%%:*}):" | sed 's/^/    /'
log "wall time: $(( $(date +%s) - START ))s total (build ${BUILD_S}s, compose up ${UP_S}s)"
for f in "${fails[@]}"; do log "FAIL: $f"; done
log "$RESULT"
[[ $RESULT == PASS ]]
