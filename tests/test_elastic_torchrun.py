"""The torchrun elastic recipe (docs/restarts-and-elastic.md#elastic-jobs-resuming-at-another-world-size):
two torchrun agents on loopback stand for two hosts (`--nnodes 1:2 --max-restarts 3`, c10d rendezvous),
each running 2 workers of `python -m batchd.train
--elastic DIR --config job.toml`: rank 0 starts the coordinator, each host's local rank 0 its node agent.
Host 1 is lost mid-epoch (its agent, workers and services SIGKILLed); torchrun restarts host 0's workers at
world size 2, they restart the services (the coordinator resizing the job) and resume from the furthest
checkpoint. Every sample id of the epoch is trained exactly once (the first world size's steps before the
resume step, then every step of the second), and host 0's torchrun exits 0.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _procs import free_block

from batchd.demo import demo_lengths

pytestmark = pytest.mark.slow

SAMPLES = 1200


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        children = Path(f"/proc/{p}/task/{p}/children")
        if children.exists():
            todo += [int(c) for c in children.read_text().split()]
    return out


def test_torchrun_elastic_resizes_the_job_by_itself_when_a_host_is_lost(tmp_path):
    (tmp_path / "lengths.txt").write_text(
        "\n".join(map(str, demo_lengths(SAMPLES, seed=3, longest=512))) + "\n"
    )
    cport, aport, rdzv = free_block(1), free_block(2), free_block(1)
    (tmp_path / "job.toml").write_text(
        '[job]\nworld_size = 4\ntoken_budget = 1024\npolicy = "balanced"\nwindow = 32\ndepth = 4\nseed = 3\n'
        '[data]\nlengths = "lengths.txt"\n'
        f"[coordinator]\nport = {cport}\nlease_s = 5.0\n[rank]\nbase_port = {aport}\n"
    )
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
        "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv}",
        "--rdzv-id", "elastic", "--rdzv-conf", "last_call_timeout=3,join_timeout=120",
        "-m", "batchd.train", "--elastic", "state", "--config", "job.toml", "--checkpoint", "ckpt",
        "--checkpoint-every", "1", "--ids-log", "ids-{rank}.jsonl", "--step-time", "0.1",
        "--vocab-size", "512", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--log-every", "0",
        "--timeout", "60", "--reconnect-timeout", "5",
    ]  # fmt: skip
    env = {
        **os.environ,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "BATCHD_ADVERTISE": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    logs = [open(tmp_path / f"host{h}.log", "w") for h in (0, 1)]
    hosts = []
    try:
        for h in (0, 1):
            hosts.append(
                subprocess.Popen(torchrun, cwd=tmp_path, env=env, stdout=logs[h], stderr=subprocess.STDOUT)
            )
            time.sleep(1.0)  # host 0 first: its torchrun hosts the rendezvous store
        deadline = time.monotonic() + 180
        while sum(len(f.read_text().splitlines()) for f in tmp_path.glob("ids-*.jsonl")) < 24:
            assert time.monotonic() < deadline and hosts[0].poll() is None, (
                tmp_path / "host0.log"
            ).read_text()[-3000:]
            time.sleep(0.2)
        for pid in _descendants(hosts[1].pid):  # host 1 is lost: its agent, workers and their services
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert hosts[0].wait(240) == 0, (tmp_path / "host0.log").read_text()[-4000:]
    finally:
        for p in hosts:
            for pid in _descendants(p.pid) if p.poll() is None else []:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for f in logs:
            f.close()
    lines = [
        json.loads(ln)
        for f in tmp_path.glob("ids-*.jsonl")
        for ln in f.read_text().splitlines()
        if ln.endswith("}")
    ]
    worlds = {(ln["restart"], ln["world"]) for ln in lines}
    assert (0, 4) in worlds and any(r > 0 and w == 2 for r, w in worlds), worlds
    resume = min(ln["step"] for ln in lines if ln["world"] == 2)
    assert resume > 0  # resumed mid-epoch
    seen = collections.Counter(
        i for ln in lines if ln["world"] == 2 or ln["step"] < resume for i in ln["ids"]
    )
    assert set(seen) == set(range(SAMPLES)) and max(seen.values()) == 1, (
        len(seen),
        sum(c - 1 for c in seen.values() if c > 1),
    )
    per_rank = collections.Counter(
        (ln["world"], ln["restart"], ln["step"]) for ln in lines if ln["world"] == 2
    )
    assert set(per_rank.values()) == {2}  # both ranks of the resized job made every step
    host0 = (tmp_path / "host0.log").read_text()
    assert "saved at world size 4: the job was resized" in host0, host0[-3000:]
