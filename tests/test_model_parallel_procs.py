"""Model-parallel groups across processes: 4 gloo trainers = 2 data-parallel x 2 tensor-parallel ranks.

A real in-process batchd job (gRPC coordinator and 2 rank services on loopback) serves 4 trainer processes
(`tests/_mp_trainer.py`: torchtitan's ("dp", "tp") device mesh, DDP over the data-parallel group, each
step's batch checked identical across the tensor-parallel group by an all_gather).

* Decisive run: every process exits 0; both members of each tensor-parallel group took identical steps;
  every id exactly once across the data-parallel ranks; equal steps on every rank.
* Kill: one member (dp 0, tp 1) is killed with SIGKILL after its second step; the three others exit 1
  within a deadline, each printing the job's reason, which names that member.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _jobs import job_pool
from _procs import free_block, wait_until

from batchd.core import JobSpec, PolicySpec

HERE = Path(__file__).resolve().parent
DP, TP = 2, 2
pytestmark = pytest.mark.slow


def _start(job, out: Path, step_time: float) -> dict[tuple[int, int], subprocess.Popen]:
    port = free_block(1)
    procs = {}
    for rank in range(DP * TP):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(DP * TP),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [
            sys.executable,
            str(HERE / "_mp_trainer.py"),
            str(DP),
            str(TP),
            str(out),
            str(step_time),
            *[job.rank_address(r) for r in range(DP)],
        ]
        procs[divmod(rank, TP)] = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    return procs


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []


@pytest.fixture
def make_job():
    with job_pool() as start:
        yield start


def _spec() -> JobSpec:
    return JobSpec(
        world_size=DP,
        token_budget=256,
        seed=2,
        policy=PolicySpec(name="balanced", window=16, depth=3, collate="packed"),
    )


def test_two_by_two_groups_share_their_ranks_batches(make_job, tmp_path):
    n = 48
    job = make_job(_spec(), [8 + (i * 53) % 110 for i in range(n)])
    out = tmp_path / "steps.jsonl"
    procs = _start(job, out, 0.0)
    outputs = {k: p.communicate(timeout=300)[0] for k, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), outputs
    lines = _lines(out)
    by = {
        (d, t): [(x["step"], x["ids"]) for x in lines if (x["dp"], x["tp"]) == (d, t)]
        for d in range(DP)
        for t in range(TP)
    }
    for d in range(DP):
        assert by[d, 0] == by[d, 1], f"dp rank {d}: its tensor-parallel members took different steps"
    assert len({len(v) for v in by.values()}) == 1, "unequal steps"
    ids = sorted(i for d in range(DP) for _, step_ids in by[d, 0] for i in step_ids)
    assert ids == list(range(n)), "ids lost or repeated across the data-parallel ranks"


def test_a_killed_member_fails_the_job_naming_it(make_job, tmp_path):
    job = make_job(_spec(), [8 + (i * 53) % 110 for i in range(200)], grace=2.0)
    out = tmp_path / "steps.jsonl"
    procs = _start(job, out, 0.3)
    victim = procs[0, 1]
    try:
        wait_until(
            "the victim took 2 steps",
            lambda: sum((x["dp"], x["tp"]) == (0, 1) for x in _lines(out)) >= 2,
            120,
            lambda: "\n".join(p.stdout.read() if p.poll() is not None else "" for p in procs.values()),
        )
        os.kill(victim.pid, signal.SIGKILL)
        outputs = {k: p.communicate(timeout=120)[0] for k, p in procs.items() if k != (0, 1)}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for k, text in outputs.items():
        assert procs[k].returncode == 1, (k, text)
        assert (
            "trainer of rank 0 (group member 1 of 2) disconnected and did not reconnect within 2s" in text
        ), (k, text)
