"""Optimizer updates of a fixed global count: the boundaries (`UpdateWindows`), the loss scale over an
update, the epoch's closing step, and the same through the coordinator, the rank state and the wire."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchd.core import (
    Coordinator,
    CostModel,
    JobSpec,
    PlanInputs,
    PolicySpec,
    RankState,
    Sample,
    Simulator,
    Updates,
    plan_round,
    simulate,
)
from batchd.proto import wire
from batchd.testing import Entry, UpdateWindows

counts_st = st.lists(st.integers(0, 60), min_size=1, max_size=60)


def _rounds(counts: list[int], cuts: list[int]) -> list[list[int]]:
    """`counts` split into consecutive rounds at the positions `cuts` (some rounds may be empty)."""
    edges = sorted({0, len(counts), *(c % (len(counts) + 1) for c in cuts)})
    return [counts[a:b] for a, b in zip(edges, edges[1:], strict=False)]


def _feed(w: UpdateWindows, counts: list[int], cuts: list[int]) -> tuple[list[bool], list[int]]:
    """Every round of one epoch through `w` (the last one final); the ends and window loss per step."""
    ends, loss = [], []
    rounds = _rounds(counts, cuts)
    for i, r in enumerate(rounds):
        got = w.close(r, r, final=i == len(rounds) - 1)
        assert got.first == sum(ends)
        ends += got.ends
        loss += got.loss_tokens
    return ends, loss


def _updates(counts: list[int], ends: list[bool]) -> list[int]:
    out, cur = [], 0
    for c, e in zip(counts, ends, strict=True):
        cur += c
        if e:
            out.append(cur)
            cur = 0
    return out


@given(counts_st, st.integers(1, 200), st.lists(st.integers(0, 100), max_size=8))
def test_cumulative_updates_hold_g_on_average_and_count_c_over_g(counts, g, cuts):
    ends, loss = _feed(UpdateWindows(g, "tokens", "cumulative"), counts, cuts)
    updates = _updates(counts, ends)
    assert [x for x in loss if x] == [u for u in updates if u]  # W at each end = the update's tokens
    total = sum(counts)
    assert sum(updates) == total  # every token in exactly one update
    if 0 < total and max(counts) <= g:
        assert total // g <= len(updates) <= math.ceil(total / g)
    # Update k ends at the first step at which the running count reaches k x g (the last step of the
    # epoch also ends the open one).
    prefix = 0
    for j, (c, e) in enumerate(zip(counts, ends, strict=True)):
        prefix += c
        if j != len(counts) - 1:
            assert e == (prefix >= (sum(ends[:j]) + 1) * g)


@given(counts_st, st.integers(1, 200), st.lists(st.integers(0, 100), max_size=8))
def test_at_least_updates_reach_g_and_overshoot_by_less_than_one_step(counts, g, cuts):
    ends, _ = _feed(UpdateWindows(g, "tokens", "at_least"), counts, cuts)
    cur, last = 0, len(counts) - 1
    for j, (c, e) in enumerate(zip(counts, ends, strict=True)):
        cur += c
        if e:
            if j != last:
                assert g <= cur < g + c or (c >= g and cur - c < g)
            cur = 0
        else:
            assert cur < g


@given(counts_st, st.sampled_from([None, 1, 7, 50]), st.sampled_from(["cumulative", "at_least"]))
def test_boundaries_do_not_depend_on_rounds_and_survive_a_state_round_trip(counts, g, rule):
    whole, _ = _feed(UpdateWindows(g, "tokens", rule), counts, [])
    for cut in range(len(counts)):  # the final round holds a step (else: `closing_step`)
        a = UpdateWindows(g, "tokens", rule)
        first = a.close(counts[:cut], counts[:cut], final=False)
        b = UpdateWindows(g, "tokens", rule)
        b.load_state_dict(a.state_dict())
        second = b.close(counts[cut:], counts[cut:], final=True)
        assert list(first.ends) + list(second.ends) == whole
    if g is None:
        assert all(whole)


def test_an_open_update_without_weight_is_not_closed_at_the_epoch_end():
    w = UpdateWindows(10, "tokens", "cumulative")
    got = w.close([10, 0, 0], [10, 0, 0], final=True)
    assert got.ends == (True, False, False)  # no optimizer step on a zero gradient
    w = UpdateWindows(10, "tokens", "cumulative")
    assert w.close([4], [4], final=False).ends == (False,)
    assert w.closing_step(0, final=True)
    assert not w.closing_step(0, final=False) and not w.closing_step(1, final=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tokens_per_update": 0}, "tokens_per_update must be >= 1"),
        ({"samples_per_update": -3}, "samples_per_update must be >= 1"),
        ({"tokens_per_update": 5, "samples_per_update": 5}, "not both"),
        ({"update_rule": "nearest"}, "update_rule"),
    ],
)
def test_job_spec_refuses_bad_update_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        JobSpec.from_keys(world_size=2, token_budget=64, **kwargs)


# -- through the simulator (the daemon's core) ------------------------------------------------------

spec_st = st.builds(
    lambda n, pol, mode, g, unit, rule, window, seed: JobSpec(
        world_size=n,
        token_budget=256,
        mode=mode,
        quota=50 if mode == "non-join" else None,
        seed=seed,
        policy=PolicySpec(name=pol, window=window, depth=3),
        updates=Updates(
            tokens_per_update=g if unit == "tokens" else None,
            samples_per_update=max(g // 60, 1) if unit == "samples" else None,
            update_rule=rule,
        ),
    ),
    st.integers(1, 4),
    st.sampled_from(["balanced", "local", "odb"]),
    st.sampled_from(["join", "non-join"]),
    st.integers(1, 3000),
    st.sampled_from(["tokens", "samples"]),
    st.sampled_from(["cumulative", "at_least"]),
    st.integers(2, 9),
    st.integers(0, 3),
)


@given(spec_st, st.lists(st.integers(1, 300), min_size=1, max_size=80))
def test_simulated_updates_are_exact_agreed_and_lose_nothing(spec, lengths):
    if spec.policy.name == "balanced" and spec.mode == "non-join":
        spec = spec.replace(mode="join", quota=None)
    if spec.quota is not None:  # a quota over the workload wraps around: ids then repeat by design
        spec = spec.replace(quota=min(spec.quota, len(lengths)))
    ends = []
    for step in Simulator(lengths, spec):
        infos = [s.info for s in step]
        assert len({(i.update, i.update_end, i.update_scale, i.update_loss_tokens) for i in infos}) == 1
        ends.append(infos[0])
    result = simulate(lengths, spec)
    if spec.mode == "join":  # non-join trains a quota of samples, not each id once
        assert result["missing"] == 0 and result["duplicates"] == 0
    assert result["loss_scale_error"] < 1e-9  # per update: scaled rank means x update_scale = token mean
    ended = [i for i in ends if i.update_end]
    assert result["updates"] == len(ended) == (ends[-1].update + ends[-1].update_end if ends else 0)
    assert sum(i.update_loss_tokens for i in ended) == sum(i.global_loss_tokens for i in ends)
    assert [i.update for i in ended] == list(range(len(ended)))
    position = 0  # each step's index inside its update, from the ends before it
    for i in ends:
        assert i.update_step == position
        position = 0 if i.update_end else position + 1


def test_control_per_step_scaling_is_not_exact_over_an_update():
    """The check above can fail: scaling each step by its own tokens inside an update is off."""
    lengths = [17, 250, 3, 90, 128, 40, 7, 200, 66, 31] * 4
    spec = JobSpec(
        world_size=2,
        token_budget=256,
        policy=PolicySpec(name="local", window=6, depth=8),
        updates=Updates(tokens_per_update=700),
    )
    per_step = loss_sum = worst = 0.0
    for step in Simulator(lengths, spec):
        for s in step:
            rank_sum = sum((x.id % 7 + 1.0) * x.loss_tokens for x in s.samples)  # S_r
            per_step += rank_sum / max(s.info.global_loss_tokens, 1)  # each step scaled by its own T
            loss_sum += rank_sum
        if step[0].info.update_end:
            worst = max(worst, abs(per_step - loss_sum / step[0].info.update_loss_tokens))
            per_step = loss_sum = 0.0
    assert worst > 1e-3


# -- the coordinator's closing step and the rank state ---------------------------------------------


def _one_sample_round(coord: Coordinator, ranks: list[RankState], exhausted: bool, sample: Sample | None):
    for r in ranks:
        if sample is not None and r.rank == 0:
            r.push(sample)
        if exhausted:
            r.mark_exhausted()
    decision = coord.decide([r.report(4) for r in ranks])
    totals = coord.commit([r.apply(decision) for r in ranks])
    return totals, [r.finalize(totals) for r in ranks]


def test_an_epoch_that_ends_in_a_round_without_steps_closes_its_update_on_an_idle_step():
    spec = JobSpec(
        world_size=2,
        token_budget=64,
        policy=PolicySpec(name="local", window=4, depth=8),
        updates=Updates(tokens_per_update=1000),
    )
    coord, ranks = Coordinator(spec), [RankState(spec, r) for r in range(2)]
    totals, steps = _one_sample_round(coord, ranks, False, Sample(0, 10, -1, 0))
    assert totals.steps == 1 and totals.update_end == (False,) and not totals.done
    totals, steps = _one_sample_round(coord, ranks, True, None)
    assert totals.done and totals.steps == 1 and totals.update_end == (True,)
    for per_rank in steps:
        (step,) = per_rank
        assert step.info.is_idle and step.info.update_end and step.info.update == 0
        assert step.info.update_loss_tokens == 10
        assert step.info.update_scale == pytest.approx(1000 / 10)
    assert wire.totals_from_pb(wire.totals_to_pb(totals, 0)) == totals


def test_without_updates_every_step_ends_one_and_the_scale_is_per_step():
    spec = JobSpec(world_size=2, token_budget=64, policy=PolicySpec(name="local", window=4, depth=8))
    coord, ranks = Coordinator(spec), [RankState(spec, r) for r in range(2)]
    totals, steps = _one_sample_round(coord, ranks, True, Sample(0, 10, -1, 0))
    (a,), (b,) = steps
    assert a.info.update_end and a.info.update_scale == 1.0 and a.info.loss_scale == 2.0
    assert b.info.is_idle and b.info.loss_scale == 0.0 and b.info.update_loss_tokens == 10


def test_wire_carries_the_update_fields_and_reads_an_old_peer_as_one_update_per_step():
    spec = JobSpec(
        world_size=3,
        token_budget=64,
        updates=Updates(tokens_per_update=123, update_rule="at_least"),
        policy=PolicySpec(name="local", window=512, depth=8),
    )
    assert wire.spec_from_pb(wire.spec_to_pb(spec)) == spec
    plain = JobSpec(world_size=3, token_budget=64, policy=PolicySpec(name="local", window=512, depth=8))
    assert wire.spec_from_pb(wire.spec_to_pb(plain)) == plain
    coord, ranks = Coordinator(spec), [RankState(spec, r) for r in range(3)]
    totals, steps = _one_sample_round(coord, ranks, False, Sample(5, 30, -1, 0))
    info = steps[0][0].info
    assert wire.info_from_pb(wire.info_to_pb(info, 0)) == info
    old = wire.totals_to_pb(totals, 0)
    del old.update_end[:]
    del old.update_loss_tokens[:]
    read = wire.totals_from_pb(old)
    assert read.ends(0) == (True, read.step_loss_tokens[0])
    bad = wire.totals_to_pb(totals, 0)
    bad.update_end.append(True)
    with pytest.raises(ValueError, match="update_end entries"):
        wire.totals_from_pb(bad)


def test_a_coordinator_state_of_other_update_settings_is_refused():
    spec = JobSpec(
        world_size=2,
        token_budget=64,
        updates=Updates(tokens_per_update=100),
        policy=PolicySpec(name="local", window=512, depth=8),
    )
    state = Coordinator(spec).state_dict()
    with pytest.raises(ValueError, match="tokens_per_update"):
        Coordinator(spec.replace(tokens_per_update=200)).load_state_dict(state)
    with pytest.raises(ValueError, match="update_rule"):
        Coordinator(spec.replace(update_rule="at_least")).load_state_dict(state)
    old = Coordinator(
        JobSpec(world_size=2, token_budget=64, policy=PolicySpec(name="local", window=512, depth=8))
    ).state_dict()
    for key in ("tokens_per_update", "samples_per_update", "updates", "update_seen"):
        old.pop(key, None)
    Coordinator(
        JobSpec(world_size=2, token_budget=64, policy=PolicySpec(name="local", window=512, depth=8))
    ).load_state_dict(old)  # saved before the fields


def test_integrations_refuse_an_update_their_weights_cannot_serve():
    """DeepSpeed's gradient cannot be rescaled after the backward: the last step of an update not read
    through weighted_steps is refused before it; read through it, every step's scale is the update's.
    Lightning's automatic loss and the HF / Accelerate accumulation windows refuse updates of several
    steps (tests/test_integrations.py, tests/test_lightning.py show the paths that take them)."""
    from batchd.client import (
        batchd_deepspeed_backward,
        check_one_step_update,
        optimizer_updates,
        weighted_steps,
    )
    from batchd.testing import check_weighted

    spec = JobSpec(
        world_size=2,
        token_budget=64,
        policy=PolicySpec(name="local", window=4, depth=8),
        updates=Updates(tokens_per_update=500),
    )
    sim = Simulator([30] * 40, spec)
    steps = []
    while (got := sim.next_step()) is not None:
        steps.append((None, got[0].info))
    ends = [info for _, info in steps if info.update_end]
    assert not steps[0][1].update_end and any(i.update_scale != 1.0 for i in ends)
    with pytest.raises(ValueError, match="does not take optimizer updates"):
        check_one_step_update(steps[0][1], "an integration that steps every step")
    bad = next(i for i in ends if i.update_scale != 1.0)
    with pytest.raises(ValueError, match="read the stream through batchd.client.weighted_steps"):
        check_weighted(bad, "batchd_deepspeed_backward")

    class Engine:  # only what is read before any forward
        def gradient_accumulation_steps(self):
            return 1

    with pytest.raises(ValueError, match="batchd_deepspeed_backward needs each step weighted"):
        batchd_deepspeed_backward(Engine(), None, bad)
    weighted = list(weighted_steps(iter(steps)))
    assert [i.step for _, i in weighted] == [i.step for _, i in steps]
    for update in optimizer_updates(iter(steps)):
        last = update[-1][1]
        raw = [i for _, i in steps if i.update == last.update]
        for (_, got), want in zip(update, raw, strict=True):
            assert got.update_scale == 1.0
            assert math.isclose(got.loss_scale, want.loss_scale * raw[-1].update_scale)
        check_weighted(last, "x")  # passes
    with pytest.raises(RuntimeError, match="the stream ended inside update 0"):
        list(weighted_steps(iter(steps[:1])))


def _compute(plan, cost: CostModel) -> float:
    """N x the slowest rank, summed over the round's steps."""
    return sum(
        len(plan) * max(cost.cost([s.length for s in p[k]]) for p in plan) for k in range(len(plan[0]))
    )


def _idle(plan, cost: CostModel) -> float:
    """The compute a round's steps leave idle: per step, N x its slowest rank minus every rank's cost."""
    out = 0.0
    for k in range(len(plan[0])):
        costs = [cost.cost([s.length for s in plan[r][k]]) if plan[r][k] else 0.0 for r in range(len(plan))]
        out += len(costs) * max(costs) - sum(costs)
    return out


@given(
    world_size=st.integers(1, 4),
    pool=st.lists(st.tuples(st.integers(1, 64), st.integers(0, 3)), min_size=1, max_size=80),
    capacity=st.integers(1, 6),
    final=st.booleans(),
    cost=st.sampled_from(["padded", "packed", "attention"]),
)
def test_mixing_a_round_never_idles_more(world_size, pool, capacity, final, cost):
    """`PlanInputs.mix` (on with optimizer updates of several steps) regroups and reorders a round, never
    at the price of its balance: its steps leave idle at most the unmixed plan's idle compute plus
    0.5% of their compute (the rng draws are the same either way); a final round still takes all."""
    model = CostModel(cost)
    entries = [Entry(Sample(i, n, -1, home % world_size), 0) for i, (n, home) in enumerate(pool)]
    args = (entries, world_size, capacity, final, 64, model, 3, 4, "mix")
    plain = plan_round(PlanInputs(*args)).plan
    mixed = plan_round(PlanInputs(*args, mix=True)).plan
    assert len(mixed[0]) == len(plain[0])
    assert _idle(mixed, model) <= _idle(plain, model) + 0.005 * _compute(mixed, model) + 1e-6
    ids = [s.id for steps in mixed for group in steps for s in group]
    assert len(ids) == len(set(ids))
    if final and capacity * world_size >= len(entries):
        assert len(ids) == len(entries)


def test_mixing_evens_the_samples_of_packed_groups():
    """Packed groups from a large window: best-fit decreasing fills the last groups with the short
    samples (a few samples in one group, dozens in another); mixed, long samples land in different
    groups and the short ones fill around them, within 0.5% of the compute idle."""
    rng = random.Random(0)
    lengths = [min(4000, int(rng.lognormvariate(5.5, 1.0))) for _ in range(300)]
    entries = [Entry(Sample(i, n, -1, i % 2), 0) for i, n in enumerate(lengths)]
    model = CostModel("packed")
    args = (entries, 2, 8, False, 8192, model, 0, 16, 0)
    plain = plan_round(PlanInputs(*args)).plan
    mixed = plan_round(PlanInputs(*args, mix=True)).plan
    plain_counts = [len(g) for steps in plain for g in steps]
    mixed_counts = [len(g) for steps in mixed for g in steps]
    assert len(mixed_counts) == len(plain_counts)
    assert statistics.pstdev(mixed_counts) < statistics.pstdev(plain_counts) / 3
    assert _idle(mixed, model) <= _idle(plain, model) + 0.005 * _compute(mixed, model)


def test_mixing_takes_the_stream_oldest_first():
    """Mixed, a round is filled from the pool's oldest samples (arrival round, then a seeded order of
    ids that no rank goes first in): with equal lengths that is exactly a prefix of the stream, and
    both ranks' oldest samples are in it; unmixed, complete groups leave in random order."""
    entries = [Entry(Sample(i, 1000, -1, i % 2), i // 24) for i in range(96)]  # arrivals 0..3, 24 each
    model = CostModel("packed")
    args = (entries, 2, 2, False, 8192, model, 10, 64, "stream")
    mixed = plan_round(PlanInputs(*args, mix=True)).plan
    taken = {s.id for steps in mixed for group in steps for s in group}
    assert len(taken) == 32  # 2 ranks x 2 steps x 8 samples of 1000 tokens
    assert taken == set(range(24)) | {i for i in range(24, 48) if i in taken}
    assert len(taken & set(range(24, 48))) == 8
    assert {i % 2 for i in range(24, 48) if i in taken} == {0, 1}
    plain = plan_round(PlanInputs(*args)).plan
    assert {s.id for steps in plain for group in steps for s in group} != taken


def test_mixing_orders_a_round_so_consecutive_steps_hold_alike_samples():
    """Padded rows stay length-homogeneous, so mixing reorders them: the running sample count of the
    round's steps tracks its mean, so two consecutive steps never hold both of its fullest rows."""
    lengths = [60] * 6 + [30] * 12 + [15] * 24 + [7] * 48
    entries = [Entry(Sample(i, n, -1, i % 2), 0) for i, n in enumerate(lengths)]
    model = CostModel("padded")
    args = (entries, 2, 4, True, 64, model, 0, 4, 1)
    mixed = plan_round(PlanInputs(*args, mix=True)).plan
    per_step = [sum(len(mixed[r][k]) for r in range(2)) for k in range(len(mixed[0]))]
    mean = sum(per_step) / len(per_step)
    running = 0.0
    for k, c in enumerate(per_step):
        running += c - mean
        assert abs(running) <= max(per_step) - min(per_step), (k, per_step)
    pairs = [per_step[k] + per_step[k + 1] for k in range(len(per_step) - 1)]
    assert max(pairs) < sorted(per_step)[-1] + sorted(per_step)[-2] or len(set(per_step)) == 1
