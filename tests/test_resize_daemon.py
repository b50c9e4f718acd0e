"""Resizing a job through the real daemon, in one process: a gRPC coordinator journaling to a state dir,
rank services on loopback, `BatchClient` trainers. A job at 4 ranks whose trainers checkpoint (their
`state_dict`) at step S stops; the coordinator restarts on its state dir at 2 ranks with `resize`, the
trainers resume from rank 0's state (`load_state_dict(..., resize=True)`), and later the job grows to 3
the same way. Every id of the epoch is trained exactly once across the runs (the steps before each
resume step of one run, and all of the last run's), every run's ranks make equal steps, each run's
first step is its resume step, and the step totals are the new ranks' (the loss scale's input). Also
the refusals: a different world size without `resize`, a resume step inside an optimizer update,
trainers resuming at different steps, and another job's checkpoint.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
from _jobs import InProcessJob, per_rank

from batchd.core import JobSpec, PolicySpec, Updates
from batchd.service import JournalError

LENGTHS = [16 + (37 * i) % 500 for i in range(240)]


def _spec(world: int, **kw) -> JobSpec:
    return JobSpec.from_keys(
        world_size=world, token_budget=1024, policy="balanced", window=16, depth=4, seed=2, **kw
    )


def _run(
    job: InProcessJob,
    states: list | None,
    stop_after: int | None,
    resize: bool = False,
    restart_at: int | None = None,
):
    """Every rank's trainer from `states` (one for all, or None: from the start) until its first update end
    at or after `stop_after` steps of this run (None: the epoch's end); the coordinator is killed and
    restarted from its journal once rank 0 took `restart_at` steps. Returns per rank the steps
    [(step, ids, global samples, loss_scale)] and its state_dict at the stop."""
    restarted = threading.Event()

    def consume(r: int) -> tuple[list, dict]:
        with job.client(r) as c:
            if states is not None:
                c.load_state_dict(states[0] if len(states) == 1 else states[r], resize=resize)
            steps = []
            for batch, info in c:
                steps.append((info.step, batch["sample_ids"].tolist(), info.global_samples, info.loss_scale))
                if r == 0 and len(steps) == restart_at and not restarted.is_set():
                    job.restart_coordinator()
                    restarted.set()
                if stop_after is not None and len(steps) >= stop_after and info.update_end:
                    break
            return steps, c.state_dict()

    return per_rank(consume, job.spec.world_size)


@pytest.mark.parametrize("per_update", [None, 1500])
def test_a_job_resized_4_to_2_to_3_trains_every_id_once(tmp_path, per_update):
    """The coordinator is also restarted from its journal: before any rank resumed the first resize,
    and mid-run after the second."""
    coord_dir = str(tmp_path / "coordinator")
    kept: list[int] = []
    states = None
    for world, stop_after, resize, restart in ((4, 5, False, None), (2, 4, True, 0), (3, None, True, 2)):
        job = InProcessJob(
            _spec(world, tokens_per_update=per_update),
            LENGTHS,
            coordinator_state_dir=coord_dir,
            resize=resize,
        )
        with job:
            if restart == 0:  # the resize is pending: no rank resumed it yet
                assert job.state.resize_state is not None and job.state.resize_state.pending
                job.restart_coordinator()
                assert job.state.resize_state is not None and job.state.resize_state.pending
            got = _run(job, states, stop_after, resize, restart or None)
        first = {steps[0][0] for steps, _ in got}
        assert len(first) == 1, first  # every rank resumed at the same step
        if states is not None:
            assert first == {states[0]["next_step"]}
        lengths = {len(steps) for steps, _ in got}
        assert len(lengths) == 1, lengths  # equal steps
        for k in range(lengths.pop()):  # the step totals are this run's ranks'
            assert got[0][0][k][2] == sum(len(steps[k][1]) for steps, _ in got)
        for steps, _ in got:
            kept += [i for _, ids, _, _ in steps for i in ids]
        states = [got[0][1]]
    assert sorted(kept) == list(range(len(LENGTHS)))


def test_a_resize_is_refused_without_the_flag_mid_update_and_on_other_checkpoints(tmp_path):
    coord_dir = str(tmp_path / "coordinator")
    with InProcessJob(_spec(2, tokens_per_update=4000), LENGTHS, coordinator_state_dir=coord_dir) as job:
        got = _run(job, None, 3)
    state = dict(got[0][1])
    with pytest.raises(JournalError, match="ran at world_size 2, this command says 3; .* --resize"):
        InProcessJob(_spec(3, tokens_per_update=4000), LENGTHS, coordinator_state_dir=coord_dir)
    with pytest.raises(JournalError, match="cannot resize: a resize changes world_size only, .*token_budget"):
        InProcessJob(
            JobSpec(
                world_size=3,
                token_budget=2048,
                seed=2,
                policy=PolicySpec(name="balanced", window=16, depth=4),
                updates=Updates(tokens_per_update=4000),
            ),
            LENGTHS,
            coordinator_state_dir=coord_dir,
            resize=True,
        )
    with InProcessJob(
        _spec(3, tokens_per_update=4000), LENGTHS, coordinator_state_dir=coord_dir, resize=True
    ) as job:
        with job.client(0) as c, contextlib.closing(c):
            inside = {**state, "next_step": state["next_step"] - 1}  # one step before an update's end
            c.load_state_dict(inside, resize=True)
            with pytest.raises(Exception, match="inside optimizer update"):
                next(iter(c))


def test_a_non_join_job_resized_keeps_its_quota_exact(tmp_path):
    """Non-join mode: the epoch closes on a sample quota; resized at step S, the new ranks count on from
    the samples emitted before S, so the epoch's steps before S plus the resized run's hold exactly the
    quota; the new views (which wrap in non-join mode) read only what the steps before S did not hold."""
    coord_dir = str(tmp_path / "coordinator")
    quota = len(LENGTHS) - 17
    spec = dict(mode="non-join", quota=quota)
    with InProcessJob(_spec(3, **spec), LENGTHS, coordinator_state_dir=coord_dir) as job:
        first = _run(job, None, 4)
    states = [first[0][1]]
    with InProcessJob(_spec(2, **spec), LENGTHS, coordinator_state_dir=coord_dir, resize=True) as job:
        second = _run(job, states, None, True)
    before = [i for steps, _ in first for _, ids, _, _ in steps for i in ids]
    after = [i for steps, _ in second for _, ids, _, _ in steps for i in ids]
    assert len(before) + len(after) == quota and len(before) == len(set(before))
    assert not set(before) & set(after)


def test_a_job_resized_after_its_last_step_only_hands_out_its_end(tmp_path):
    """Trainers that took every step of the job's last epoch but not its end (the job was lost in between)
    resume at another size: the resized ranks hand them the end, make no step and finish, and the
    coordinator is done. (A job whose trainers took the end too is done: there is nothing to resize.)"""
    spec = dict(deterministic=True)  # the same steps in both runs: the probe gives the epoch's length
    with InProcessJob(_spec(2, **spec), LENGTHS, coordinator_state_dir=str(tmp_path / "probe")) as job:
        total = len(_run(job, None, None)[0][0])
    coord_dir = str(tmp_path / "coordinator")
    with InProcessJob(_spec(2, **spec), LENGTHS, coordinator_state_dir=coord_dir) as job:
        got = _run(job, None, total)  # stops after the last step, before the end
    state = got[0][1]
    assert (state["next_step"], state["finished"]) == (total, False)
    with InProcessJob(_spec(3, **spec), LENGTHS, coordinator_state_dir=coord_dir, resize=True) as job:
        again = _run(job, [state], None, True)
        assert [steps for steps, _ in again] == [[], [], []]
        assert all(s["finished"] for _, s in again)
        job.wait_state("done")
