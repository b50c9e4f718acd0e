"""Target rules and the coordinator's protocol checks."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from batchd.core import (
    Coordinator,
    CostModel,
    JobSpec,
    PlanInputs,
    PolicySpec,
    ProtocolError,
    RankCommit,
    RankReport,
    RankState,
    Sample,
    plan_round,
)
from batchd.testing import Entry, target_min, target_odb

report_st = st.builds(
    lambda cap, buf, groups, ex: (cap, buf, min(groups, buf), ex),
    st.integers(0, 12),
    st.integers(0, 40),
    st.integers(1, 40),
    st.booleans(),
)


def _reports(raw):
    return [RankReport(r, 0, cap, buf, groups, ex) for r, (cap, buf, groups, ex) in enumerate(raw)]


@given(st.lists(report_st, min_size=1, max_size=64))
def test_min_rule_capacity_progress_and_no_split(raw):
    reports = _reports(raw)
    t = target_min(reports)
    assert all(t <= r.capacity for r in reports), "T exceeds a rank's capacity"
    active = [r for r in reports if r.groups > 0]
    assert all(t <= r.groups for r in active), "the min rule would make an active rank split"
    if active and all(r.capacity >= 1 for r in reports):
        assert t >= 1, "no progress although every rank has room and some rank has data"
    if not active:
        assert t == 0


@given(st.lists(report_st, min_size=1, max_size=64))
def test_odb_rule_capacity_and_split_feasibility(raw):
    reports = _reports(raw)
    t = target_odb(reports)
    active = [r for r in reports if r.groups > 0]
    if not active or min(r.capacity for r in reports) == 0:
        assert t == 0
        return
    assert 1 <= t <= min(r.capacity for r in reports)
    assert all(t <= r.buffered for r in active), "a rank could not split up to T"


@given(
    world_size=st.integers(1, 8),
    pool=st.lists(st.tuples(st.integers(1, 200), st.integers(0, 7), st.integers(0, 6)), max_size=60),
    capacity=st.integers(1, 6),
    final=st.booleans(),
    cost=st.sampled_from(["padded", "packed", "attention"]),
    refine=st.booleans(),
    mix=st.booleans(),
)
# Two complete 64-token groups on rank 0 outrank rank 1's incomplete [1, 1]: ranked alone, the round
# (T = 1, 2 slots) left rank 1 with nothing, the starvation behind the join step bound's failure.
@example(
    world_size=2,
    pool=[(64, 0, 0), (64, 0, 0), (1, 1, 0), (1, 1, 0)],
    capacity=1,
    final=False,
    cost="padded",
    refine=True,
    mix=False,
)
def test_balanced_plan_emits_a_quota_of_every_rank(world_size, pool, capacity, final, cost, refine, mix):
    """`plan_round`: T steps for every rank, each sample at most once, and every rank r gets at least
    min(T, B_r) of its B_r pooled samples (the progress behind the join bound max_r n_r steps)."""
    entries = [Entry(Sample(i, n, -1, home % world_size), age) for i, (n, home, age) in enumerate(pool)]
    budget = 64
    inputs = PlanInputs(
        entries, world_size, capacity, final, budget, CostModel(cost), 6, 4, 0, refine, mix=mix
    )
    plan = plan_round(inputs).plan
    assert len(plan) == world_size
    target = len(plan[0])
    assert all(len(steps) == target for steps in plan)
    assert target <= capacity and (target >= 1 or not entries)
    emitted = [s for steps in plan for group in steps for s in group]
    ids = {s.id for s in emitted}
    assert len(ids) == len(emitted) and ids <= {e.sample.id for e in entries}
    if entries:  # T <= ceil(P / N) <= max_r B_r: no round outlasts every rank's pooled samples
        assert target <= max(1, -(-len(entries) // world_size))
    for r in range(world_size):
        held = sum(1 for e in entries if e.sample.home_rank == r)
        got = sum(1 for s in emitted if s.home_rank == r)
        assert got >= min(target, held), f"rank {r}: {got} of its {held} samples in a round of {target} steps"
    if final and capacity * world_size >= len(entries):
        assert len(emitted) == len(entries)


def test_seed_max_rule_would_break_capacity():
    """Why batchd does not use the seed's T = max(min C, min B): buffers outgrow output queues."""
    reports = _reports([(2, 30, 5, False), (4, 20, 9, False)])
    seed_rule = max(min(r.capacity for r in reports), min(r.buffered for r in reports))
    assert seed_rule > max(r.capacity for r in reports)
    assert target_min(reports) <= 2


def test_coordinator_rejects_bad_rounds():
    c = Coordinator(
        JobSpec(world_size=2, token_budget=100, policy=PolicySpec(name="local", window=512, depth=8))
    )
    ok = [RankReport(0, 0, 1, 1, 1, False), RankReport(1, 0, 1, 1, 1, False)]
    with pytest.raises(ProtocolError, match=r"missing .* rank\(s\) \[1\]"):
        c.decide(ok[:1])
    with pytest.raises(ProtocolError, match="duplicate report from rank 0"):
        c.decide([ok[0], ok[0]])
    with pytest.raises(ProtocolError, match="round 3"):
        c.decide([ok[0], RankReport(1, 3, 1, 1, 1, False)])
    with pytest.raises(ProtocolError, match="outside world_size"):
        c.decide([ok[0], RankReport(5, 0, 1, 1, 1, False)])
    with pytest.raises(ProtocolError, match="before its decision"):
        c.commit([])
    d = c.decide(ok)
    assert d.target == 1
    with pytest.raises(ProtocolError, match="already decided"):
        c.decide(ok)
    with pytest.raises(ProtocolError, match="committed 0 steps"):
        c.commit([RankCommit(0, 0, (), 0, False), RankCommit(1, 0, ((),), 0, False)])


def test_rank_rejects_out_of_order_messages():
    r = RankState(
        JobSpec(world_size=1, token_budget=100, policy=PolicySpec(name="local", window=2, depth=8)), 0
    )
    r.push(Sample(1, 10))
    with pytest.raises(ProtocolError, match="already buffered"):
        r.push(Sample(1, 10))
    r.push(Sample(2, 10))
    with pytest.raises(ProtocolError, match="full"):
        r.push(Sample(3, 10))
    c = Coordinator(
        JobSpec(world_size=1, token_budget=100, policy=PolicySpec(name="local", window=512, depth=8))
    )
    report = r.report(4)
    with pytest.raises(ProtocolError, match="push during round"):
        r.push(Sample(4, 10))
    decision = c.decide([report])
    commit = r.apply(decision)
    totals = c.commit([commit])
    steps = r.finalize(totals)
    assert [s.info.local_samples for s in steps] == [2] and totals.done is False
    r.mark_exhausted()
    with pytest.raises(ProtocolError, match="after its source was exhausted"):
        r.push(Sample(5, 10))


def test_over_budget_policies():
    for policy, outcome in (("singleton", "over_budget"), ("truncate", "truncated"), ("reject", "rejected")):
        r = RankState(
            JobSpec(
                world_size=1,
                token_budget=100,
                policy=PolicySpec(name="local", window=4, depth=8, over_budget=policy),
            ),
            0,
        )
        assert r.push(Sample(1, 150, 120)) == outcome
        if policy == "reject":
            assert r.rejected == [(1, "length 150 costs 150 > token_budget 100")] and not r.buffer
        elif policy == "truncate":
            assert r.buffer[0].sample.length == 100 and r.buffer[0].sample.loss_tokens == 100
        else:
            assert r.buffer[0].sample.length == 150
