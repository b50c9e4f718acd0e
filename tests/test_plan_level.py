"""Level rows of the node-blind round plan (`batchd.core._plan_level`): which groups a round takes so a
step's ranks cost alike, how an epoch's last round spreads its stub over its steps, and the
`PolicySpec.level_rows` switch (on by default)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchd.core import CostModel, JobSpec, PlanInputs, PolicySpec, Sample, plan_round, simulate
from batchd.proto.wire import spec_from_pb, spec_to_pb
from batchd.testing import Entry, final_rows, level_choice


def _objective(costs, bounds, n):
    out = 0.0
    for a, b in itertools.pairwise(bounds):
        total = sum(costs[a:b])
        out += costs[a] * n / total if total > 0 else 1.0
    return out


@given(
    costs=st.lists(st.integers(1, 50), min_size=1, max_size=9),
    n=st.integers(1, 4),
    steps=st.integers(1, 3),
)
def test_final_rows_is_the_best_cut_of_the_sorted_costs(costs, n, steps):
    """Against every cut into min(steps, G) non-empty rows of at most n: valid, and no cut is better."""
    costs = sorted(costs, reverse=True)
    g = len(costs)
    steps = max(steps, -(-g // n))  # the round has room for every group
    rows = min(steps, g)
    bounds = final_rows(costs, n, steps)
    assert bounds[0] == 0 and bounds[-1] == g and len(bounds) == rows + 1
    assert all(0 < b - a <= n for a, b in itertools.pairwise(bounds))
    best = min(
        _objective(costs, (0, *cut, g), n)
        for cut in itertools.combinations(range(1, g), rows - 1)
        if all(0 < b - a <= n for a, b in itertools.pairwise((0, *cut, g)))
    )
    assert _objective(costs, bounds, n) <= best + 1e-9


def _groups(spec):
    """Groups of one entry each: spec = [(cost, home rank, age)], the entry's length is its cost."""
    return [[Entry(Sample(i, c, -1, home), 10 - age)] for i, (c, home, age) in enumerate(spec)]


@given(
    spec=st.lists(st.tuples(st.integers(1, 100), st.integers(0, 3), st.integers(0, 6)), max_size=40),
    n=st.integers(1, 4),
    steps=st.integers(1, 3),
    patience=st.integers(1, 6),
)
def test_level_choice_takes_exactly_its_slots_every_aged_group_and_every_quota(spec, n, steps, patience):
    """Either None, or `slots` distinct groups holding every group that waited max_wait (4) rounds and
    min(T, B_r) samples of every rank r."""
    groups = _groups(spec)
    costs = [float(c) for c, _, _ in spec]
    ages = [a for _, _, a in spec]
    slots = n * steps
    held = {r: sum(1 for _, h, _ in spec if h == r) for r in range(4)}
    quota = {r: min(steps, b) for r, b in held.items() if b}
    chosen = level_choice(groups, costs, ages, slots, n, quota, 4, patience)
    if chosen is None:
        return
    ids = [g[0].sample.id for g in chosen]
    assert len(ids) == slots == len(set(ids))
    aged = {i for i, a in enumerate(ages) if a >= 4}
    assert aged <= set(ids)
    for r, q in quota.items():
        assert sum(1 for g in chosen if g[0].sample.home_rank == r) >= q


def _step_ratios(plan, cost):
    out = []
    for k in range(len(plan[0])):
        row = [cost.cost([s.length for s in plan[r][k]]) if plan[r][k] else 0.0 for r in range(len(plan))]
        out.append(max(row) / (sum(row) / len(row)))
    return out


def test_a_round_of_rigid_singletons_takes_rows_of_one_kind():
    """8 ranks, three kinds of singletons that cannot pair under padding (5,000, 6,500 and 8,000 tokens,
    L = 8,192), one of each on every rank, and room for two steps: the round takes two kinds,
    a row each, so both steps are level (the first 16 groups in ranked order, taken before, mixed kinds
    in a step: 1.25 and 1.02)."""
    rng = random.Random(3)
    kinds = [(n, home) for n in (5000, 6500, 8000) for home in range(8)]  # each rank holds one of each
    rng.shuffle(kinds)
    entries = [Entry(Sample(i, n, -1, home), 0) for i, (n, home) in enumerate(kinds)]
    cost = CostModel("padded")
    plan = plan_round(PlanInputs(entries, 8, 2, False, 8192, cost, 0, 16, 0)).plan
    assert len(plan[0]) == 2
    assert _step_ratios(plan, cost) == [1.0, 1.0]
    taken = sorted(s.length for steps in plan for g in steps for s in g)
    assert len(set(taken)) == 2 and len(taken) == 16


def test_an_epochs_last_round_spreads_its_stub_over_its_steps():
    """The final round, 10 rigid singletons of equal cost and 8 ranks, 2 steps: 5 and 5 (max / mean
    1.6 twice), not 8 and 2 (1.0 and 4.0)."""
    entries = [Entry(Sample(i, 6000, -1, i % 8), 0) for i in range(10)]
    cost = CostModel("padded")
    plan = plan_round(PlanInputs(entries, 8, 4, True, 8192, cost, 0, 16, 0)).plan
    assert len(plan[0]) == 2
    assert _step_ratios(plan, cost) == [1.6, 1.6]
    assert sorted(s.id for steps in plan for g in steps for s in g) == list(range(10))


def test_level_rows_lower_the_straggler_bound_compute_of_a_job_and_can_be_turned_off():
    """A simulated job with rigid singletons (30% of samples between L/2 and L, the rest short), 8 ranks:
    level rows cut compute_vs_limit (the sum of each step's slowest rank over the ideal) from 1.08 to
    1.02; `level_rows=False` plans the ranked prefix again. Both train every sample exactly once."""
    rng = random.Random(0)
    lengths = [rng.randint(4200, 8192) if rng.random() < 0.3 else rng.randint(100, 1500) for _ in range(2048)]
    spec = JobSpec(
        world_size=8,
        token_budget=8192,
        shuffle=False,
        policy=PolicySpec(name="balanced", window=64, depth=4),
        cost=CostModel(name="padded"),
    )
    level, prefix = simulate(lengths, spec), simulate(lengths, spec.replace(level_rows=False))
    for r in (level, prefix):
        assert (r["emitted"], r["missing"], r["duplicates"]) == (2048, 0, 0)
    assert level["compute_vs_limit"] < prefix["compute_vs_limit"] - 0.04, (level, prefix)


def test_level_rows_travel_on_the_wire():
    spec = JobSpec(world_size=2, token_budget=64, policy=PolicySpec(name="balanced", window=512, depth=8))
    assert spec.policy.level_rows is True
    for value in (True, False):
        assert spec_from_pb(spec_to_pb(spec.replace(level_rows=value))).policy.level_rows is value
    with pytest.raises(ValueError, match="level_rows"):
        JobSpec(
            world_size=2, token_budget=64, policy=PolicySpec(name="local", window=512, depth=8, level_rows=1)
        )
