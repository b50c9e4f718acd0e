"""Optimizer updates of a fixed token count through the real daemon (gRPC coordinator, rank services,
`BatchClient`s on loopback): every rank gets the same boundaries, and a coordinator restarted from its
journal and a trainer resumed from its `state_dict` mid-update change none of them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from _jobs import InProcessJob

from batchd.core import JobSpec, PolicySpec, Updates

LENGTHS = [8 + (i * 37) % 200 for i in range(240)]
SPEC = JobSpec(
    world_size=2,
    token_budget=512,
    seed=5,
    epochs=2,
    deterministic=True,
    policy=PolicySpec(name="balanced", window=16, depth=2),
    updates=Updates(tokens_per_update=1500),
)
FIELDS = ("update", "update_step", "update_end", "update_scale", "update_loss_tokens", "loss_scale")


def _project(batch, info) -> tuple:
    ids = np.asarray(batch["sample_ids"]).tolist() if batch is not None and "sample_ids" in batch else []
    return (info.step, ids, info.global_loss_tokens, *(getattr(info, f) for f in FIELDS))


def _run(tmp_path=None, disturb: bool = False) -> list[list[list[tuple]]]:
    """Per rank, per epoch, the projected steps. `disturb`: the coordinator is killed and restarted from
    its journal twice, and rank 1's trainer stops inside an update, saves its state and a new client
    resumes from it."""
    with InProcessJob(
        SPEC, LENGTHS, lease_s=20, coordinator_state_dir=str(tmp_path) if disturb else None
    ) as job:
        seen = threading.Semaphore(0)
        got: list = [None, None]
        errors: list = []
        resumed = threading.Event()

        def consume(r: int) -> None:
            try:
                out, state = [], None
                c = job.client(r, reconnect_timeout_s=30)
                for e in range(SPEC.epochs):
                    c.set_epoch(e)
                    ep: list = []
                    for b, info in c:
                        ep.append(_project(b, info))
                        seen.release()
                        if disturb and r == 1 and state is None and e == 0 and info.update_step > 0:
                            state = c.state_dict()  # a checkpoint inside an update
                            break
                    else:
                        out.append(ep)
                        continue
                    c.close()
                    resumed.set()
                    c = job.client(r, reconnect_timeout_s=30)
                    c.load_state_dict(state)
                    ep += [_project(b, info) for b, info in c]
                    out.append(ep)
                c.close()
                got[r] = out
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append((r, exc))

        threads = [threading.Thread(target=consume, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        restarts = 0
        if disturb:
            for _ in range(2):
                for _ in range(10):  # some steps between kills
                    if not seen.acquire(timeout=60):
                        break
                if job.state.rounds_done:
                    break
                job.restart_coordinator()
                restarts += 1
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert not disturb or restarts == 2, "the job ended before the coordinator was restarted twice"
        assert resumed.is_set() == disturb
        job.wait_state("done")
        return got


@pytest.mark.slow
def test_update_boundaries_agree_on_every_rank_and_survive_restarts_and_a_mid_update_resume(tmp_path):
    plain = _run()
    disturbed = _run(tmp_path, disturb=True)
    assert disturbed == plain  # the same steps, boundaries and scales after restarts and a resume
    for e in range(SPEC.epochs):
        a, b = plain[0][e], plain[1][e]
        assert len(a) == len(b) > 0
        # every rank agrees on each step's update fields (the loss scale is each rank's own)
        assert [x[3:-1] for x in a] == [x[3:-1] for x in b]
        ends = [x for x in a if x[5]]
        assert ends and a[-1][5], "the epoch's last step ends its update"
        assert sum(x[7] for x in ends) == sum(x[2] for x in a)  # every loss token in one update
        assert max(x[4] for x in a) >= 1, "an update spans several steps"
        assert [x[3] for x in ends] == list(range(len(ends)))
        for ra, rb in zip(a, b, strict=True):
            # the loss scales of a step sum to N x T / G: the step's share of the update
            assert ra[-1] + rb[-1] == pytest.approx(2 * ra[2] / SPEC.updates.tokens_per_update)
        assert sorted(i for r in range(2) for x in plain[r][e] for i in x[1]) == list(range(len(LENGTHS)))
