"""`--strategy fsdp2` and `--strategy deepspeed` checkpoints resume a crashed group to the very model an
uninterrupted run trains.

Per strategy, two jobs of the same config (synthetic lengths, 2 ranks, `deterministic = true`, updates of
several steps) run side by side, each under `batchd torchrun --max-restarts 2` over its own coordinator
and node agent: one whose rank 1 dies (`os._exit(1)`, as an OOM kill) at step 8, between the checkpoints
of `--checkpoint-every 5`, and one that is not interrupted. torchrun restarts the crashed group, which
resumes from the sharded checkpoint (`DIR/<strategy>-<n>/`, named by `DIR/latest.json`); the rank service
sends the steps after it again. Then: every sample id trained exactly once per epoch in the lineage that
survives, a step sent again is the same batch, one checkpoint directory left, and the final checkpoints of
both jobs (model and optimizer, every shard) are equal, as are the ranks' last losses.
"""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch
from _procs import wait_until
from _readme_job import end_job, job_env, restart_job, surviving_steps

from batchd.demo import demo_lengths

pytestmark = pytest.mark.slow

SAMPLES, EPOCHS = 200, 2


def _job_dir(work: Path) -> int:
    """Writes the job (lengths, job.toml journaling both services) into `work`; returns the node agent's
    port."""
    work.mkdir()
    return restart_job(work, demo_lengths(SAMPLES, seed=3), epochs=EPOCHS)


def _start(work: Path, strategy: str, crash: list[str], env: dict) -> list[subprocess.Popen]:
    """The job's coordinator, node agent and `batchd torchrun` (last), logging to work/<name>.log."""
    aport = _job_dir(work)
    train = [
        "batchd", "torchrun", "--nproc-per-node", "2", "--max-restarts", "2", "--standalone", "-m",
        "batchd.train", "--node-agent", f"127.0.0.1:{aport}", "--strategy", strategy, "--checkpoint", "ckpt",
        "--checkpoint-every", "5", *crash, "--ids-log", "ids-{rank}.jsonl", "--vocab-size", "512",
        "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--log-every", "0",
        "--summary", "summary-{rank}.json",
    ]  # fmt: skip
    argvs = {
        "coordinator": ["batchd", "coordinator", "--config", "job.toml"],
        "node": ["batchd", "node", "--config", "job.toml", "--local-ranks", "2", "--node-rank", "0"],
        "torchrun": train,
    }
    procs = []
    for name, argv in argvs.items():
        with open(work / f"{name}.log", "w") as log:
            procs.append(subprocess.Popen(argv, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _ended(procs: list[subprocess.Popen]) -> bool:
    return all(p.poll() is not None for p in procs)


def _tail(work: Path) -> str:
    return "\n".join(f"--- {work.name}/{p.name}\n{p.read_text()[-3000:]}" for p in sorted(work.glob("*.log")))


def _final_state(work: Path, strategy: str) -> dict[str, torch.Tensor]:
    """Every tensor and number of the last checkpoint (model and optimizer, all shards), by path."""
    pointer = json.loads((work / "ckpt" / "latest.json").read_text())
    where = work / "ckpt" / pointer["dir"]
    assert sorted(p.name for p in (work / "ckpt").glob(f"{strategy}-*")) == [pointer["dir"]], (
        "older ones removed"
    )
    if strategy == "fsdp2":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(where, work / "final.pt")  # the full (unsharded) state, in this one process
        states = {"dcp": torch.load(work / "final.pt", weights_only=False)}
    else:
        states = {p.name: torch.load(p, weights_only=False) for p in sorted(where.glob("*.pt"))}
    flat: dict[str, torch.Tensor] = {}

    def walk(path: str, value) -> None:
        if isinstance(value, torch.Tensor):
            flat[path] = value
        elif isinstance(value, bool | int | float):
            flat[path] = torch.tensor(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{path}/{k}", v)
        elif isinstance(value, list | tuple):
            for k, v in enumerate(value):
                walk(f"{path}/{k}", v)

    walk("", states)
    return flat


@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed"])
def test_a_crashed_group_resumes_from_its_sharded_checkpoint_to_the_uninterrupted_model(tmp_path, strategy):
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    marker = f"BATCHD_TEST_STRATEGY_CKPT={uuid.uuid4().hex}"
    tmp = tempfile.mkdtemp(prefix="bds-", dir="/tmp")  # the job's TMPDIR
    env = job_env(tmp, marker)
    crashed, clean = tmp_path / "crashed", tmp_path / "clean"
    t0 = time.monotonic()
    jobs = {
        crashed: _start(crashed, strategy, ["--crash-at", "0:8:1"], env),
        clean: _start(clean, strategy, [], env),
    }
    try:
        for work, procs in jobs.items():
            wait_until(
                f"{work.name}: the job ends", lambda ps=procs: _ended(ps), 240, lambda w=work: _tail(w)
            )
            assert [p.returncode for p in procs] == [0, 0, 0], _tail(work)
    finally:
        for procs in jobs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
        end_job(marker)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{strategy}: both jobs in {time.monotonic() - t0:.1f}s")
    out = (crashed / "torchrun.log").read_text()
    assert "Traceback" not in out and f"resumed from ckpt/{strategy}-" in out, out[-5000:]
    lineages = [surviving_steps(crashed, rank) for rank in range(2)]
    for kept, deliveries in lineages:
        assert {e["restart"] for e in kept} == {0, 1}, "both runs of the group survive in part"
        assert any(len(v) > 1 for v in deliveries.values()), "the steps after the checkpoint came again"
        assert all(v == [v[0]] * len(v) for v in deliveries.values()), "a step sent again is the same batch"
    for epoch in range(EPOCHS):  # every id once per epoch in the surviving lineage
        seen = collections.Counter(
            i for kept, _ in lineages for e in kept if e["epoch"] == epoch for i in e["ids"]
        )
        assert sorted(seen) == list(range(SAMPLES)) and max(seen.values()) == 1, (epoch, len(seen))
    got, want = _final_state(crashed, strategy), _final_state(clean, strategy)
    assert set(got) == set(want) and len(want) > 10, sorted(set(got) ^ set(want))
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=lambda m, k=key: f"{strategy} {k}: {m}")
    for rank in range(2):
        losses = [json.loads((w / f"summary-{rank}.json").read_text())["last_loss"] for w in (crashed, clean)]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5), (rank, losses)
