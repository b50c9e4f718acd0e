"""Model-parallel groups: several trainer processes consume one data-parallel rank's batches.

In Megatron- or torchtitan-style jobs a tensor-, context- or pipeline-parallel group of processes works
on one data-parallel rank's batch. Each member opens its own `BatchClient` with the rank's data-parallel
`rank`, the data-parallel `world_size`, the `group_size` and its own `group_rank`.

In-process (real gRPC coordinator and rank services on loopback, members as threads):
* every member of a group receives identical batches (tensors, ids, StepInfo) over two epochs, every id
  once per epoch across the data-parallel ranks, equal steps everywhere;
* a step stays held for a slow member; a member that leaves mid-epoch and stays away fails the job
  with a message that names the rank and the member, and the other members get `JobFailed` saying so;
* a member declaring another group size, a second process for a member, and a client state of another
  group are refused, naming why.
The multi-process case (2 data-parallel x 2 tensor-parallel gloo processes, one killed with SIGKILL) is
`test_model_parallel_procs.py`.
"""

from __future__ import annotations

import threading
import time

import pytest
from _jobs import job_pool

from batchd.client import BatchClient
from batchd.core import JobFailed, JobSpec, RankServiceError

GROUP = 2


@pytest.fixture
def make_job():
    with job_pool() as start:
        yield start


def _spec(**kw) -> JobSpec:
    return JobSpec.from_keys(
        **{
            "world_size": 2,
            "token_budget": 256,
            "policy": "balanced",
            "window": 16,
            "depth": 3,
            "seed": 5,
            "collate": "packed",
            **kw,
        }
    )


def _lengths(n: int = 40) -> list[int]:
    return [8 + (i * 37) % 120 for i in range(n)]


def _member(job, r: int, g: int, **kw) -> BatchClient:
    return job.client(r, group_rank=g, group_size=GROUP, **kw)


def _drain_group(job, epochs: int, slow: tuple[int, int] | None = None) -> dict:
    """Every (rank, member) as a thread over all epochs; {(r, g): [[(ids, info, tensors), ...] per epoch]}."""
    out, errors = {}, []

    def run(r: int, g: int) -> None:
        try:
            with _member(job, r, g) as c:
                got = []
                for e in range(epochs):
                    c.set_epoch(e)
                    steps = []
                    for batch, info in c:
                        if (r, g) == slow:
                            time.sleep(0.05)
                        steps.append(
                            (
                                batch["sample_ids"].tolist(),
                                info,
                                {k: v.tolist() for k, v in batch.items() if hasattr(v, "tolist")},
                            )
                        )
                    got.append(steps)
                out[r, g] = got
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(((r, g), exc))

    threads = [
        threading.Thread(target=run, args=(r, g), daemon=True)
        for r in range(job.spec.world_size)
        for g in range(GROUP)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(out) == job.spec.world_size * GROUP, "a member did not finish"
    return out


def test_group_members_get_identical_batches_and_every_id_once(make_job):
    lengths = _lengths()
    job = make_job(_spec(epochs=2), lengths)
    got = _drain_group(job, epochs=2, slow=(1, 1))
    for e in range(2):
        for r in range(2):
            assert got[r, 0][e] == got[r, 1][e], (
                f"rank {r} epoch {e}: the group's members saw different batches"
            )
        steps = {len(got[r, 0][e]) for r in range(2)}
        assert len(steps) == 1, f"epoch {e}: unequal steps {steps}"
        ids = sorted(i for r in range(2) for step in got[r, 0][e] for i in step[0])
        assert ids == list(range(len(lengths))), f"epoch {e}: ids lost or repeated"


def test_a_member_that_leaves_fails_the_job_naming_it(make_job):
    job = make_job(_spec(), _lengths(), grace=1.0)
    seen = threading.Event()
    failures: dict = {}

    def stay(r: int, g: int) -> None:
        try:
            with _member(job, r, g) as c:
                for _ in c:
                    seen.set()
                    time.sleep(0.2)
        except JobFailed as exc:
            failures[r, g] = str(exc)

    threads = [threading.Thread(target=stay, args=(r, g), daemon=True) for r, g in ((0, 0), (1, 0), (1, 1))]
    for t in threads:
        t.start()
    leaver = _member(job, 0, 1)
    it = iter(leaver)
    next(it)  # takes one step, then its process is gone
    leaver.close()
    for t in threads:
        t.join(60)
    assert set(failures) == {(0, 0), (1, 0), (1, 1)}, failures
    for msg in failures.values():
        assert (
            "trainer of rank 0 (group member 1 of 2) disconnected and did not reconnect within 1s" in msg
        ), msg


def test_a_group_refuses_a_mismatch_naming_it(make_job):
    job = make_job(_spec(), _lengths())
    first = _member(job, 0, 0)
    it = iter(first)
    next(it)
    with pytest.raises(
        RankServiceError, match="form a group of 2 process.es., but this trainer says its group has 3"
    ):
        next(iter(job.client(0, group_rank=2, group_size=3)))
    with pytest.raises(RankServiceError, match="group member 0's batches already stream to trainer"):
        next(iter(_member(job, 0, 0)))
    with pytest.raises(RankServiceError, match="form a group of 2"):
        next(iter(job.client(0)))  # a plain trainer on a rank whose trainers form a group
    state = first.state_dict()
    assert (state["group_rank"], state["group_size"]) == (0, 2)
    with pytest.raises(ValueError, match="group_rank: saved 0, current 1"):
        _member(job, 0, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="group_rank must be in"):
        BatchClient("127.0.0.1:1", 0, 2, group_rank=2, group_size=2)
    first.close()
