"""An out-of-memory step is not the end of the job: the budget rule (`batchd.core.lowered_budget`), the
coordinator's journaled lowering and the restart that goes on at it (`service/coordinator/_oom.py`), and
the torchrun elastic recipe end to end with a trainer that runs out of memory on every step above a cost.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import free_block
from hypothesis import given
from hypothesis import strategies as st

from batchd.core import BUDGET_QUANTUM, JobSpec, lowered_budget
from batchd.service import CoordinatorState

TINY = ["--vocab-size", "512", "--d-model", "32", "--n-layers", "1", "--n-heads", "2"]


@given(st.integers(1, 1 << 20), st.floats(0.5, float(1 << 21)))
def test_the_lowered_budget_is_a_quantum_multiple_below_the_budget_and_the_failed_cost(budget, cost):
    top = min(budget, cost)
    try:
        new = lowered_budget(budget, cost)
    except ValueError as exc:
        assert top * 7 / 8 < 2 * BUDGET_QUANTUM, (budget, cost)  # only near the floor
        assert "no budget of at least" in str(exc)
        return
    assert new % BUDGET_QUANTUM == 0 and BUDGET_QUANTUM <= new < top, (budget, cost, new)
    assert new >= top * 7 / 8 - 2 * BUDGET_QUANTUM  # an eighth off, not more than a quantum besides


def test_lowered_budget_by_hand_and_its_refusals():
    assert lowered_budget(8192, 8000.0) == 7000 // 64 * 64  # 7/8 of the failed cost
    assert lowered_budget(4096, 9000.0) == 3584  # a step planned over today's budget: 7/8 of the budget
    assert lowered_budget(1024, 512.0) == 448  # 7/8 of 512 is a multiple already: strictly below it
    for bad, match in (((0, 10.0), "budget=0"), ((100, 0.0), "cost=0.0"), ((100, float("nan")), "cost=nan")):
        with pytest.raises(ValueError, match=match):
            lowered_budget(*bad)
    with pytest.raises(ValueError, match="does not fit this device at any budget"):
        lowered_budget(8192, 70.0)


def _spec(**kw) -> JobSpec:
    return JobSpec.from_keys(world_size=2, token_budget=1024, seed=0, **kw)


def test_the_coordinator_journals_the_budget_and_the_restart_goes_on_at_it(tmp_path):
    spec = _spec()
    state = CoordinatorState(spec, state_dir=tmp_path)
    try:
        for r in range(2):
            state.register(r, spec, f"127.0.0.1:{7100 + r}")
        budget, message = state.oom(0, 0, 0, 1000.0)
        assert budget == 832 and state.failure == message, message
        assert "rank 0's trainer ran out of memory on epoch 0 step 0" in message
        assert "the token budget goes from 1024 to 832" in message
        again, told = state.oom(1, 0, 0, 990.0)  # the other rank's report of the same failed step
        assert (again, told) == (832, message)  # the same lowering, the job's one failure
    finally:
        state.close()
    journal = tmp_path / "coordinator.journal"
    header = journal.read_text().splitlines()[0]
    for _ in range(2):  # a restart goes on at the budget; a second restart keeps it
        state = CoordinatorState(spec, state_dir=tmp_path)  # the same command: the configured budget
        try:
            assert state.failure is None and state.spec.token_budget == 832
            reg = state.register(0, spec, "127.0.0.1:7100")  # the rank's configured spec is the job's
            assert (reg.token_budget, reg.generation, reg.resume_needed) == (832, 1, True)
            with pytest.raises(Exception, match="different job spec"):
                state.register(1, dataclasses.replace(spec, token_budget=832), "127.0.0.1:7101")
            state.register(1, spec, "127.0.0.1:7101")
            resumed = state.resume(0, 0, 0, 0)
            assert (resumed.step, resumed.generation) == (0, 1)
        finally:
            state.close()
    assert journal.read_text().splitlines()[0] == header  # the configured job: the same commands match it


def _lines(work: Path) -> list[dict]:
    return [
        json.loads(ln)
        for f in sorted(work.glob("ids-*.jsonl"))
        for ln in f.read_text().splitlines()
        if ln.endswith("}")
    ]


@pytest.mark.slow
def test_an_injected_oom_lowers_the_budget_and_the_elastic_job_goes_on(tmp_path):
    """torchrun elastic (`--max-restarts 3`) with 2 workers, `python -m batchd.train --elastic`: every
    trainer raises torch.OutOfMemoryError before training a step of planned cost above 1000 (of a 1024 token
    budget). The first such step lowers the budget through the coordinator (journaled), the job fails and
    torchrun restarts it; it goes on from the checkpoint at the lowered budget, which both ranks plan and
    report alike, and ends with torchrun exiting 0: every sample trained exactly once over the restarts (the
    steps before each resume point, then the last run's), equal steps on both ranks."""
    from batchd.demo import demo_lengths

    samples, threshold = 600, 1000.0
    lengths = demo_lengths(samples, seed=5, longest=512)
    (tmp_path / "lengths.txt").write_text("\n".join(map(str, lengths)) + "\n")
    port = free_block(4)
    (tmp_path / "job.toml").write_text(
        "[job]\nworld_size = 2\ntoken_budget = 1024\nseed = 5\n[job.policy]\nwindow = 32\ndepth = 4\n"
        '[data]\nlengths = "lengths.txt"\n'
        f"[coordinator]\nport = {port}\nlease_s = 5.0\n[rank]\nbase_port = {port + 2}\n"
    )
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", "2", "--max-restarts", "3",
        "-m", "batchd.train", "--elastic", "state", "--config", "job.toml",
        "--checkpoint", "ckpt", "--checkpoint-every", "2", "--ids-log", "ids-{rank}.jsonl", *TINY,
        "--inject-oom-above", str(threshold), "--log-every", "0", "--timeout", "60",
        "--reconnect-timeout", "5",
    ]  # fmt: skip
    env = os.environ | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    lines = _lines(tmp_path)
    runs = sorted({ln["restart"] for ln in lines})
    assert len(runs) >= 2, (runs, log[-4000:])  # it ran out of memory, and went on after a restart
    first = {r: min(ln["step"] for ln in lines if ln["restart"] == r) for r in runs}
    kept = [  # each run's steps before the next run's resume point, and the last run's
        ln
        for ln in lines
        if ln["restart"] == runs[-1] or ln["step"] < first[runs[runs.index(ln["restart"]) + 1]]
    ]
    seen = collections.Counter(i for ln in kept for i in ln["ids"])
    assert set(seen) == set(range(samples)) and max(seen.values()) == 1, (len(seen), log[-3000:])
    last = [ln for ln in lines if ln["restart"] == runs[-1]]
    budgets = {ln["token_budget"] for ln in last}
    assert len(budgets) == 1 and budgets.pop() < 1024, budgets  # one lowered budget, on every rank alike
    assert all(ln["cost"] <= threshold for ln in last)  # no step of the last run ran out of memory
    assert {ln["token_budget"] for ln in lines if ln["restart"] == runs[0]} == {1024}
    steps = collections.Counter(ln["step"] for ln in last)
    assert set(steps.values()) == {2}, steps  # equal steps: both ranks took every step of the last run
    assert "ran out of memory on epoch 0 step" in log, log[-3000:]
    assert "the token budget goes from 1024 to" in log, log[-3000:]


@pytest.mark.slow
def test_an_injected_oom_under_the_readme_recipe_with_services_restarted_on_failure(tmp_path):
    """The README recipe (coordinator and node agent journaling, `torchrun --max-restarts 3 --node-agent`)
    with the services restarted when they exit with an error, as docker/compose.yaml's `restart:
    on-failure:3` does: the OOM fails the job, every party restarts, and the job goes on at the lowered
    budget to torchrun's exit 0; every id once in the surviving lineage; every party's last run exits 0."""
    import threading
    import uuid

    from _readme_job import end_job, job_env, restart_job, surviving_steps

    from batchd.demo import demo_lengths

    aport = restart_job(tmp_path, demo_lengths(600, seed=3), epochs=1)
    marker = f"BATCHD_TEST_OOM={uuid.uuid4().hex}"
    env = job_env(str(tmp_path), marker)
    commands = {
        "coordinator": ["batchd", "coordinator", "--config", "job.toml"],
        "node": ["batchd", "node", "--config", "job.toml", "--local-ranks", "2", "--node-rank", "0"],
    }
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "3",
        "--standalone", "-m", "batchd.train", "--node-agent", f"127.0.0.1:{aport}", "--checkpoint", "ckpt",
        "--checkpoint-every", "2", "--ids-log", "ids-{rank}.jsonl", *TINY, "--log-every", "0",
        "--inject-oom-above", "1000",
    ]  # fmt: skip
    logs = {n: open(tmp_path / f"{n}.log", "a") for n in (*commands, "torchrun")}
    codes: dict[str, list[int]] = {n: [] for n in commands}
    stop = threading.Event()

    def supervise(name: str) -> None:  # compose's `restart: on-failure:3`
        while not stop.is_set():
            p = subprocess.Popen(
                commands[name], cwd=tmp_path, env=env, stdout=logs[name], stderr=subprocess.STDOUT
            )
            while p.poll() is None and not stop.wait(0.2):
                pass
            if p.poll() is None:
                p.kill()
            codes[name].append(p.wait())
            if codes[name][-1] == 0 or len(codes[name]) > 3:
                return

    threads = [threading.Thread(target=supervise, args=(n,), daemon=True) for n in commands]
    for t in threads:
        t.start()
    trainers = subprocess.Popen(
        torchrun, cwd=tmp_path, env=env, stdout=logs["torchrun"], stderr=subprocess.STDOUT
    )
    try:
        code = trainers.wait(400)
        for t in threads:
            t.join(120)
    finally:
        stop.set()
        if trainers.poll() is None:
            trainers.kill()
        end_job(marker)
        for f in logs.values():
            f.close()
    tail = "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text()[-3000:]}" for n in logs)
    assert code == 0, tail
    assert all(c and c[-1] == 0 and len(c) >= 2 for c in codes.values()), (codes, tail)
    seen: collections.Counter = collections.Counter()
    budgets = set()
    for rank in range(2):
        kept, _ = surviving_steps(tmp_path, rank)
        seen.update(i for e in kept for i in e["ids"])
        budgets |= {e["token_budget"] for e in kept if e["restart"] == max(x["restart"] for x in kept)}
    assert sorted(seen) == list(range(600)) and max(seen.values()) == 1, len(seen)
    assert len(budgets) == 1 and budgets.pop() < 1024, budgets
    assert "the token budget goes from 1024 to" in tail, tail
