#!/usr/bin/env bash
# A cluster in a box: batchd across hosts that have their own addresses, networks and host names, on one
# Linux machine. Each host is a network namespace behind a router namespace (10.77.I.2 for host I, only
# inside the namespaces this script makes): the head runs the coordinator, two trainer hosts each run a
# node agent with 2 ranks and its 2 gloo trainers; the balanced plan moves samples between the hosts.
# It checks that every party exited 0 and that every sample id was trained exactly once, prints the
# steps and where the logs are, and deletes its namespaces (also after a failure; `clean` deletes those
# a killed run left).
#
#   sudo deploy/smoke/cluster.sh                 # exits 0 on success; needs root, iproute2, util-linux
#   sudo deploy/smoke/cluster.sh --keep DIR      # work (and keep the logs) in DIR
#   sudo deploy/smoke/cluster.sh clean
#
# The faults (a host's link cut, two hosts partitioned, the coordinator's host cut, past and within the
# lease) and the Ray job across hosts are the tests in tests/test_netcluster.py (pytest -m slow), which
# use the same harness (tests/_netcluster.py, tests/_netjobs.py); docs/deployment.md#network-faults
# lists what each fault does.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-$(command -v python3)}"
if [ -x "$root/.venv/bin/python" ] && [ -z "${PYTHON:-}" ]; then python="$root/.venv/bin/python"; fi
if [ "${1:-}" = "clean" ]; then exec "$python" "$root/tests/_netcluster.py" clean; fi
exec "$python" "$root/tests/_netcluster.py" job "$@"
