"""Restarts as real training jobs live them: plain `torchrun --max-restarts` over a node agent, trainers that
checkpoint every 5 steps and die (`os._exit(1)`, as an OOM kill) at steps between checkpoints, in both
epochs, with optimizer updates of several steps; meanwhile the node agent and the coordinator are killed
with SIGKILL and restarted with the same command (the job config journals, as `batchd config --example`
writes it). torchrun restarts the worker group from its last checkpoint each time, the rank services send
the steps after it again, and the job completes: by the trainers' ids logs, every sample id is trained
exactly once per epoch in the lineage that survives, and every step sent again is the same batch.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from _procs import wait_until
from _readme_job import end_job, job_env, restart_job, surviving_steps

from batchd.demo import demo_lengths

pytestmark = pytest.mark.slow

SAMPLES = 600


def _job_dir(work: Path, deterministic: bool = True) -> int:
    """Writes the job (lengths, job.toml journaling as `batchd config --example` does) into `work`;
    returns the node agent's port."""
    lengths = demo_lengths(SAMPLES, seed=3)
    lengths[17] = 5199  # over the budget (a step of its own) and over the tiny model's default 4096 positions
    return restart_job(work, lengths, deterministic)


def _every_id_once(work: Path) -> None:
    """Every id once per epoch in the surviving lineage; a step sent again is the same batch."""
    for epoch in range(2):
        seen: collections.Counter = collections.Counter()
        for rank in range(2):
            kept, deliveries = surviving_steps(work, rank)
            seen.update(i for e in kept if e["epoch"] == epoch for i in e["ids"])
            again = {k: v for k, v in deliveries.items() if len(v) > 1}
            assert all(v == [v[0]] * len(v) for v in again.values()), "a step sent again is the same batch"
        assert sorted(seen) == list(range(SAMPLES)) and max(seen.values()) == 1, (epoch, len(seen))


def test_torchrun_max_restarts_resume_every_crash_and_every_party_recovers(tmp_path):
    aport = _job_dir(tmp_path)
    marker = f"BATCHD_TEST_RESTART={uuid.uuid4().hex}"
    env = job_env(tempfile.mkdtemp(prefix="bdr-", dir="/tmp"), marker)
    coordinator = ["batchd", "coordinator", "--config", "job.toml"]
    node = ["batchd", "node", "--config", "job.toml", "--local-ranks", "2", "--node-rank", "0"]
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "3",
        "--standalone", "-m", "batchd.train", "--node-agent", f"127.0.0.1:{aport}", "--checkpoint", "ckpt",
        "--checkpoint-every", "5", "--crash-at", "0:8:1,1:9:0,2:31:1", "--ids-log", "ids-{rank}.jsonl",
        "--step-time", "0.05", "--vocab-size", "512", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
        "--log-every", "0",
    ]  # fmt: skip
    logs = {name: open(tmp_path / f"{name}.log", "a") for name in ("coordinator", "node", "torchrun")}

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=logs[name], stderr=subprocess.STDOUT)

    def logged() -> int:
        return sum(len(f.read_text().splitlines()) for f in tmp_path.glob("ids-*.jsonl"))

    def tail() -> str:
        return "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text()[-3000:]}" for n in logs)

    def running() -> bool:
        gone = {n: p.poll() for n, p in [*procs.items(), ("torchrun", trainers)] if p.poll() is not None}
        assert not gone, f"exited early: {gone}\n{tail()}"
        return True

    procs = {"coordinator": start("coordinator", coordinator), "node": start("node", node)}
    trainers = start("torchrun", torchrun)
    try:
        for victim, after in (("node", 30), ("coordinator", 60)):  # SIGKILL, then the same command again
            wait_until(f"{after} steps logged", lambda a=after: running() and logged() >= a, 240, tail)
            procs[victim].send_signal(signal.SIGKILL)
            procs[victim].wait(10)
            time.sleep(0.5)
            procs[victim] = start(victim, coordinator if victim == "coordinator" else node)
        assert trainers.wait(300) == 0, tail()
        for name, p in procs.items():
            assert p.wait(60) == 0, f"{name}: {tail()}"
    finally:
        for p in [trainers, *procs.values()]:
            if p.poll() is None:
                p.kill()
        end_job(marker)
        for f in logs.values():
            f.close()
    out = tail()
    assert "Traceback" not in (tmp_path / "node.log").read_text(), out
    _every_id_once(tmp_path)
    for rank in range(2):
        kept, deliveries = surviving_steps(tmp_path, rank)
        assert {e["restart"] for e in kept} == {0, 1, 2, 3}, "a part of every torchrun restart survives"
        assert any(len(v) > 1 for v in deliveries.values()), "steps were sent again after each crash"
    assert out.count("resumed from ckpt/rank-0.pt") == 3, out


def test_ctrl_c_of_batchd_torchrun_ends_in_one_line_and_the_same_command_resumes(tmp_path):
    """SIGINT to `batchd torchrun`'s process group (a terminal's Ctrl-C) mid-job: exit 130, no traceback,
    the last line says how to go on; the same command again completes the job, every id once."""
    aport = _job_dir(tmp_path, deterministic=False)
    marker = f"BATCHD_TEST_RESTART={uuid.uuid4().hex}"
    env = job_env(tempfile.mkdtemp(prefix="bdr-", dir="/tmp"), marker)
    train = [
        "batchd", "torchrun", "--nproc-per-node", "2", "--standalone", "-m", "batchd.train", "--node-agent",
        f"127.0.0.1:{aport}", "--checkpoint", "ckpt", "--checkpoint-every", "5", "--ids-log",
        "ids-{rank}.jsonl", "--step-time", "0.1", "--vocab-size", "512", "--d-model", "32", "--n-layers",
        "1", "--n-heads", "2", "--log-every", "0",
    ]  # fmt: skip
    services = [
        subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for argv in (
            ["batchd", "coordinator", "--config", "job.toml"],
            ["batchd", "node", "--config", "job.toml", "--local-ranks", "2", "--node-rank", "0"],
        )
    ]
    first = tmp_path / "first.log"
    ids0 = tmp_path / "ids-0.jsonl"
    try:
        with open(first, "w") as out:
            group = subprocess.Popen(
                train, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            wait_until(
                "steps past the second checkpoint",
                lambda: group.poll() is None and ids0.exists() and len(ids0.read_text().splitlines()) >= 12,
                120,
                first.read_text,
            )
            os.killpg(group.pid, signal.SIGINT)
            assert group.wait(60) == 130, first.read_text()
        text = first.read_text()
        assert "Traceback" not in text, text
        last = text.strip().splitlines()[-1]
        assert last.startswith("batchd torchrun: stopped by SIGINT; run the same command again"), text
        saved = json.loads((tmp_path / "ckpt" / "rank-0.pos.json").read_text())
        at = f"epoch {saved['epoch']} step {saved['next_step']}"
        assert saved["next_step"] >= 5 and f"last checkpoint in ckpt ({at})" in last, text
        for r in range(2):  # the same command again: a new torchrun, whose restarts count from 0
            (tmp_path / f"ids-{r}.jsonl").rename(tmp_path / f"ids-{r}.run0.jsonl")
        again = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-4000:]
        assert f"resumed from ckpt/rank-0.pt at {at}" in again.stderr, again.stderr[-4000:]
        for p in services:
            assert p.wait(60) == 0
    finally:
        for p in services:
            if p.poll() is None:
                p.kill()
        end_job(marker)
    _every_id_once(tmp_path)
