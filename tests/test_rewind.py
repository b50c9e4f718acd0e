"""Rewinding to a checkpoint (`batchd.core.Delivery`): trainers that checkpoint every few steps, crash at
any point (mid-save too) and restart together from their last complete checkpoint get the steps after it
again, the same ones, in this epoch or in epochs before it; the surviving lineage trains every step of
every epoch exactly once, in order. Pure code: hypothesis drives the round loop, the trainers, their
saves and crashes, and restarts of the rank service (its state saved and loaded), in any interleaving.
"""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest
import torch
from _jobs import job_pool, per_rank
from hypothesis import example, given, settings
from hypothesis import strategies as st

from batchd.client import BatchdError
from batchd.core import ATTACHED, END, SEND_END, WAIT, Delivery, JobSpec, Phases, PolicySpec
from batchd.testing import REFUSED

GRACE, TRAINER = 30.0, 1800.0


@pytest.fixture
def job_factory():
    with job_pool() as make:
        yield make


class _Trainer:
    """One trainer process of a group member: its `BatchClient` position and its saved checkpoints."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.epoch, self.next_step, self.finished = 0, 0, False
        self.attached = False

    def position(self) -> tuple[int, int, bool]:
        return self.epoch, self.next_step, self.finished


def _attach(d: Delivery, t: _Trainer, member: int, group: int, credits: int, now: float) -> str:
    outcome = d.connect(t.name, t.epoch, t.next_step, credits, now, member, group)
    assert outcome.outcome != REFUSED, outcome.reason
    if outcome.outcome == END:
        t.finished = True
    t.attached = outcome.outcome == ATTACHED
    return outcome.outcome


@settings(max_examples=300, deadline=None)
@example(  # empty epochs, no checkpoint, a crash: the restart at (0, 0) replays nothing and ends them
    steps_per_epoch=[0, 0, 0],
    depth=1,
    credits=1,
    group=1,
    every=1,
    actions=["make", "take", "make", "make", "take", "crash"],
)
@given(
    steps_per_epoch=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    depth=st.integers(1, 4),
    credits=st.integers(1, 3),
    group=st.integers(1, 2),
    every=st.integers(1, 6),
    actions=st.lists(
        st.sampled_from(["make", "take", "take", "take", "crash", "crash_mid_save", "restart_service"]),
        max_size=150,
    ),
)
def test_trainers_restarting_from_any_checkpoint_train_every_step_once(
    steps_per_epoch, depth, credits, group, every, actions
):
    epochs = len(steps_per_epoch)
    d = Delivery(0, epochs, depth, GRACE, TRAINER, 0.0)
    now, generation = 0.0, 0
    trainers = [_Trainer(f"g0m{k}") for k in range(group)]
    saved = [(0, 0, False)]  # the complete checkpoints of the group, oldest first
    lineage: list[tuple[int, int]] = []  # (epoch, step) trained, in the lineage that survives
    since_save = 0
    for k, t in enumerate(trainers):
        _attach(d, t, k, group, credits, now)

    def advance_loop() -> None:
        """The round loop: make what fits, close the epoch, hand off to the next once every member took
        its end."""
        made_target = steps_per_epoch[d.epoch]
        if not d.done:
            n = min(d.capacity, made_target - d.made)
            if n > 0:
                d.add(list(range(d.made, d.made + n)))
            if d.made == made_target:
                d.close()
        if d.can_advance:
            d.advance(now)

    def take(k: int, t: _Trainer) -> tuple[int, int] | None:
        """Member k's trainer takes what comes next: (epoch, step) it trained, or None."""
        if t.finished and t.epoch + 1 < epochs:  # the next epoch's loop: set_epoch, a new stream
            if t.attached:
                d.disconnect(t.name, now)
            t.epoch, t.next_step, t.finished = t.epoch + 1, 0, False
            t.attached = False
        if t.finished:
            return None
        if not t.attached and _attach(d, t, k, group, credits, now) != ATTACHED:
            return None
        nxt = d.next_for(t.name)
        if nxt is None:
            return None
        assert d.epoch_of(t.name) == t.epoch
        if nxt == SEND_END:
            d.mark_end_sent(t.name)
            t.finished = True
            return None
        assert nxt == t.next_step, (nxt, t.position())
        d.sent(t.name, nxt)
        t.next_step = nxt + 1
        d.ack(t.name, t.next_step)
        return t.epoch, nxt

    def checkpoint(durable: bool) -> None:
        for t in trainers:  # every member's state_dict(), then the save, which may complete
            d.checkpoint(t.name, t.epoch, t.next_step, durable=durable)

    for action in actions + ["make", "take"] * 400:
        now += 1.0
        if action == "make":
            advance_loop()
        elif action == "take":
            for k, t in enumerate(trainers):
                took = take(k, t)
                if k == 0 and took is not None:
                    lineage.append(took)
                    since_save += 1
            if since_save >= every and len({t.position() for t in trainers}) == 1:
                checkpoint(durable=False)
                saved.append(trainers[0].position())
                since_save = 0
                if len(saved) % 2:  # some saves say they completed (`BatchClient.checkpointed`)
                    checkpoint(durable=True)
        elif action in ("crash", "crash_mid_save"):
            if action == "crash_mid_save" and len({t.position() for t in trainers}) == 1:
                checkpoint(durable=False)  # state_dict taken, the save never completed
            for t in trainers:
                if t.attached:
                    d.disconnect(t.name, now)
            generation += 1
            e, s, fin = saved[-1]
            trainers = [_Trainer(f"g{generation}m{k}") for k in range(group)]
            for t in trainers:
                t.epoch, t.next_step, t.finished = e, s, fin
            lineage = [p for p in lineage if p < (e, s)]
            since_save = 0
        elif action == "restart_service":
            state = d.state_dict()
            d = Delivery(0, epochs, depth, GRACE, TRAINER, now)
            d.load_state_dict(state, now)
            for t in trainers:
                t.attached = False
        if d.finished and all(t.finished and t.epoch == epochs - 1 for t in trainers):
            break
    assert d.finished, (d.state_dict(), [t.position() for t in trainers])
    expected = [(e, s) for e, n in enumerate(steps_per_epoch) for s in range(n)]
    assert lineage == expected


def test_a_rewind_sends_the_same_steps_again_and_a_start_before_the_floor_is_refused():
    d = Delivery(0, 1, 4, GRACE, TRAINER, 0.0)
    assert d.connect("a", 0, 0, 4, 0.0).outcome == ATTACHED
    d.add([0, 1, 2, 3])
    for s in range(4):
        assert d.next_for("a") == s
        d.sent("a", s)
        d.ack("a", s + 1)
        if s + 1 == 2:
            d.checkpoint("a", 0, 2)  # state_dict at step 2; the save may not have completed
    assert d.held_from(0) == 0, "keeps everything since the start: the save at 2 may be torn"
    d.checkpoint("a", 0, 3)  # a second checkpoint: the one at 2 is the older of the last two
    assert d.floor == (0, 2) and d.held_from(0) == 2
    d.disconnect("a", 1.0)
    assert d.connect("b", 0, 2, 4, 1.0).outcome == ATTACHED
    assert [d.next_for("b"), d.sent("b", 2), d.next_for("b")] == [2, None, 3]
    d.disconnect("b", 2.0)
    refused = d.connect("c", 0, 1, 4, 2.0)
    assert refused.outcome == REFUSED and "holds steps only from epoch 0 step 2 on" in refused.reason


def test_a_rewind_into_the_epoch_before_replays_its_tail_then_the_current_epoch_from_its_start():
    d = Delivery(0, 2, 2, GRACE, TRAINER, 0.0)
    d.connect("a", 0, 0, 2, 0.0)
    d.add([0, 1])
    d.close()
    for s in range(2):
        d.sent("a", d.next_for("a"))
        d.ack("a", s + 1)
        if s == 0:
            d.checkpoint("a", 0, 1, durable=True)
    d.mark_end_sent("a")
    d.disconnect("a", 1.0)
    d.advance(1.0)
    assert d.connect("a", 1, 0, 2, 1.0).outcome == ATTACHED
    d.add([0, 1])
    d.sent("a", d.next_for("a"))
    d.ack("a", 1)
    d.disconnect("a", 2.0)  # a crash in epoch 1, before any checkpoint in it
    assert d.connect("b", 0, 1, 2, 2.0).outcome == ATTACHED and d.epoch_of("b") == 0
    assert d.next_for("b") == 1
    d.sent("b", 1)
    assert d.next_for("b") is None, "the end waits for the acknowledgement"
    d.ack("b", 2)
    assert d.next_for("b") == SEND_END
    d.mark_end_sent("b")
    d.disconnect("b", 3.0)
    assert d.connect("b2", 1, 0, 2, 3.0).outcome == ATTACHED and d.next_for("b2") == 0
    assert d.capacity == 1, "the step consumed before the crash is not made again"
    assert d.connect("late", 0, 0, 2, 3.0).outcome in (REFUSED, WAIT)


# -- the daemon: real gRPC rank services, real `BatchClient`s --------------------------------------------


def _lengths(n: int, seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.0, 0.9, n), 2, 250).astype(int).tolist()


def _run(client, until, record, state_at=()):
    """Consumes `client` epoch by epoch, recording each step; takes `state_dict()` after the steps in
    `state_at` (counted over the run), and stops (a crash) after `until` steps. Returns the states taken."""
    states, n = [], 0
    for epoch in range(client.epoch, client.job_epochs()):
        client.set_epoch(epoch)
        for batch, info in client:
            record.append((epoch, info.step, batch["sample_ids"].tolist(), batch["input_ids"].clone()))
            n += 1
            if n in state_at:
                states.append(client.state_dict())
            if n == until:
                return states
    return states


def _lineage(first, resumed, state):
    """The steps of the lineage that survives: the first run's before `state`, then the resumed run's."""
    at = (state["epoch"], state["next_step"])
    return [x for x in first if (x[0], x[1]) < at] + resumed


def test_trainers_restarted_from_a_checkpoint_get_the_same_batches_and_every_id_once(job_factory):
    """Two trainers take a checkpoint at their 3rd step and a torn one at their 7th, crash two steps
    into epoch 1, and restart from the 3rd-step checkpoint: they get every step after it again, the
    same batches (deterministic mode), across the epoch boundary, and the surviving lineage trains
    every id once per epoch. A trainer resuming before the floor is refused, naming it."""
    n = 240
    spec = JobSpec(
        world_size=2,
        token_budget=256,
        seed=2,
        epochs=2,
        deterministic=True,
        policy=PolicySpec(name="balanced", window=16, depth=3),
    )
    job = job_factory(spec, _lengths(n))

    first_runs = per_rank(lambda r: _first_run(job, r), 2)
    for r in range(2):
        first, states = first_runs[r]
        assert [s["next_step"] for s in states] == [3, 7] and states[0]["epoch"] == 0
        assert first[-1][0] == 1 and first[-1][1] == 1, "crashed two steps into epoch 1"
    resumed_runs = per_rank(lambda r: _resume(job, r, first_runs[r][1][0]), 2)
    for e in range(2):
        ids = []
        for r in range(2):
            first, states = first_runs[r]
            resumed = resumed_runs[r]
            again = {(x[0], x[1]): x for x in resumed}
            for x in first:
                if (x[0], x[1]) >= (0, 3):  # re-delivered: the same batch
                    y = again[(x[0], x[1])]
                    assert x[2] == y[2] and torch.equal(x[3], y[3]), (x[0], x[1])
            ids += [i for x in _lineage(first, resumed, states[0]) if x[0] == e for i in x[2]]
        assert sorted(ids) == list(range(n)), f"epoch {e}: every id once"
    job.wait_state("done")
    with job.client(0) as late:  # the floor: the older of the last two checkpoints (step 3 of epoch 0)
        late.load_state_dict({**first_runs[0][1][0], "next_step": 1})
        with pytest.raises(BatchdError, match="holds steps only from epoch"):
            list(late)


def _first_run(job, r):
    first: list = []
    with job.client(r) as c:
        epoch0 = None
        states, n = [], 0
        for epoch in range(2):
            c.set_epoch(epoch)
            for batch, info in c:
                first.append((epoch, info.step, batch["sample_ids"].tolist(), batch["input_ids"].clone()))
                n += 1
                if n in (3, 7):
                    states.append(c.state_dict())  # the one at 7 is torn: its save never completes
                if epoch == 1 and info.step == 1:
                    return first, states  # a crash two steps into epoch 1
            epoch0 = n
    raise AssertionError(f"epoch 1 too short: {epoch0=} {len(first)=}")


def _resume(job, r, state):
    resumed: list = []
    with job.client(r) as c:
        c.load_state_dict(state)
        _run(c, until=10**9, record=resumed)
    return resumed


def test_a_restarted_rank_service_still_rewinds_its_trainer(tmp_path, job_factory):
    """The held batches are journaled (their steps) and re-made by a restarted rank service: a trainer
    restarted from its checkpoint after the service was killed and restarted gets the same batches."""
    spec = JobSpec(
        world_size=1, token_budget=256, seed=4, epochs=1, policy=PolicySpec(name="local", window=16, depth=3)
    )
    job = job_factory(spec, _lengths(160), rank_state_dir=tmp_path)
    first: list = []
    with job.client(0) as c:
        states = _run(c, until=9, record=first, state_at=(3, 6))
    job.restart_rank(0)
    resumed: list = []
    with job.client(0) as c:
        c.load_state_dict(states[0])
        _run(c, until=10**9, record=resumed)
    again = {(x[0], x[1]): x for x in resumed}
    assert [x[1] for x in resumed][:6] == [3, 4, 5, 6, 7, 8]
    for x in first[3:]:
        y = again[(x[0], x[1])]
        assert x[2] == y[2] and torch.equal(x[3], y[3]), x[1]
    assert sorted(i for x in _lineage(first, resumed, states[0]) for i in x[2]) == list(range(160))


def test_past_the_retention_budget_a_rewind_is_refused_naming_where_it_may_resume(job_factory, caplog):
    spec = JobSpec(
        world_size=1, token_budget=256, seed=4, policy=PolicySpec(name="local", window=16, depth=3)
    )
    job = job_factory(spec, _lengths(160), retain_bytes=1)
    first: list = []
    with caplog.at_level(logging.WARNING, logger="batchd.rank"), job.client(0) as c:
        states = _run(c, until=6, record=first, state_at=(2,))
    assert "pass the retention budget" in caplog.text
    with job.client(0) as c:
        c.load_state_dict(states[0])
        with pytest.raises(BatchdError, match=r"holds steps only from epoch 0 step \d+") as refused:
            list(c)
    # the budget freed every step the trainer consumed (how many its acks had told is timing's)
    floor = int(re.search(r"holds steps only from epoch 0 step (\d+)", str(refused.value)).group(1))
    assert floor > states[0]["next_step"], str(refused.value)


@pytest.mark.parametrize("over_budget, expected", [("singleton", 5199), ("truncate", 256), ("reject", 256)])
def test_trainers_learn_the_longest_sample_the_job_sends(job_factory, over_budget, expected):
    """`BatchClient.job_max_tokens()`: what a trainer sizes its model's positions by (a 5,199-token sample
    under a 256-token budget: its own step under `singleton`, cut or refused otherwise)."""
    spec = JobSpec(
        world_size=1,
        token_budget=256,
        policy=PolicySpec(name="local", window=16, depth=3, over_budget=over_budget),
    )
    lengths = _lengths(40)
    lengths[7] = 5199
    job = job_factory(spec, lengths)
    with job.client(0) as c:
        assert c.job_max_tokens() == expected
        longest = max(int(b["input_ids"].shape[-1]) for b, _ in c)
    assert longest <= expected


def test_a_two_phase_rewind_sends_the_same_pixels_and_exchange_again(tmp_path, job_factory):
    """Two-phase steps (each step's images spread over the ranks for the encoder): trainers restarted
    from a checkpoint get the same batches, pixels and exchange arrays included, from memory and from a
    rank service restarted from its journal (which re-makes the images its held steps encode)."""
    from batchd.service.preprocess import SyntheticData, SyntheticSource

    rng = np.random.default_rng(3)
    lengths, images = [], []
    for _ in range(120):
        ims = tuple((4 * t, t) for t in (int(rng.choice([4, 16])) for _ in range(int(rng.choice([0, 1, 2])))))
        lengths.append(int(rng.integers(8, 100)) + sum(t for _, t in ims))
        images.append(ims)
    spec = JobSpec(
        world_size=2,
        token_budget=512,
        seed=3,
        deterministic=True,
        policy=PolicySpec(name="balanced", window=12, depth=2),
        phases=Phases(count=2),
    )

    def sources():
        return [
            SyntheticSource(
                SyntheticData(lengths, 64, images=images, patch_dim=8), r, 2, spec.seed, 0, spec.shuffle
            )
            for r in range(2)
        ]

    job = job_factory(spec, sources=sources(), rank_state_dir=tmp_path)
    record: list[list] = [[], []]
    states: list[list[dict]] = [[], []]

    def first(r: int) -> None:
        with job.client(r) as c:
            for n, (batch, info) in enumerate(c, 1):
                record[r].append((info.step, {k: v.clone() for k, v in batch.items() if torch.is_tensor(v)}))
                if n in (3, 5):
                    states[r].append(c.state_dict())
                if n == 8:
                    return True
        return False

    assert per_rank(first, 2) == [True, True], "each trainer crashed at its 8th step"
    assert any("vision_send_splits" in b for r in range(2) for _, b in record[r]), "steps exchange images"

    def again(r: int) -> list:
        with job.client(r, reconnect_timeout_s=30) as c:
            c.load_state_dict(states[r][0])
            return [(info.step, batch) for _, (batch, info) in zip(range(5), c, strict=False)]

    for restart in (False, True):
        if restart:
            source = sources()[1]
            job.restart_rank(1, source)
        for r, steps in enumerate(per_rank(again, 2)):
            sent = dict(record[r])
            assert [s for s, _ in steps] == [3, 4, 5, 6, 7]
            for s, batch in steps:
                keys = {k for k, v in batch.items() if torch.is_tensor(v)}
                assert keys == set(sent[s]), (restart, r, s)
                for k in keys:
                    assert torch.equal(batch[k], sent[s][k]), (restart, r, s, k)


def test_trainers_taking_5s_per_step_rewind_past_a_2s_lease(job_factory):
    """Timeouts judge liveness, never speed: steps of 5 s under a 2 s lease, a checkpoint, a crash two
    steps later and a restart from the checkpoint: the job goes on, every id once in what survives."""
    n = 60
    spec = JobSpec(
        world_size=2, token_budget=256, seed=6, policy=PolicySpec(name="balanced", window=8, depth=2)
    )
    job = job_factory(spec, _lengths(n, seed=6), lease_s=2.0)
    first: list[list] = [[], []]
    saved: list[dict] = [{}, {}]

    def crashing(r: int) -> bool:
        with job.client(r) as c:
            for k, (batch, info) in enumerate(c, 1):
                first[r].append((0, info.step, batch["sample_ids"].tolist(), batch["input_ids"]))
                if k == 1:
                    saved[r] = c.state_dict()
                time.sleep(
                    5.0 if k <= 2 else 0.0
                )  # the stand-in for a slow GPU step, not a wait for an event
                if k == 3:
                    return True
        return False

    assert per_rank(crashing, 2) == [True, True]
    resumed = per_rank(lambda r: _resume(job, r, saved[r]), 2)
    ids = [i for r in range(2) for x in _lineage(first[r], resumed[r], saved[r]) for i in x[2]]
    assert sorted(ids) == list(range(n)) and job.state.failure is None
