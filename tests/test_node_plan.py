"""`decision_for_node`: one node's view of a balanced round (the pure core function the coordinator's
Node streams serialize), and `round_exchanges`, a round's vision traffic by node.

Property: for any plan and any partition of the ranks into nodes, each rank's part appears whole in
exactly its own node's view; of another rank's part a node sees exactly the samples (images) whose home
is one of its ranks; so the union of every node's view is the whole plan.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd.core import (
    Coordinator,
    Exchange,
    ImageRef,
    JobSpec,
    PolicySpec,
    RoundDecision,
    Sample,
    decision_for_node,
    exchanged,
    round_exchanges,
)


@st.composite
def rounds(draw):
    """(decision with plan, vision and maybe audio, node of each rank)."""
    world = draw(st.integers(1, 5))
    steps = draw(st.integers(0, 3))
    ids = iter(range(10_000))
    plan = tuple(
        tuple(
            tuple(
                Sample(next(ids), draw(st.integers(1, 50)), home_rank=draw(st.integers(0, world - 1)))
                for _ in range(draw(st.integers(0, 4)))
            )
            for _ in range(steps)
        )
        for _ in range(world)
    )

    def exchange(rank: int) -> Exchange:
        images = [
            ImageRef(next(ids), 0, draw(st.integers(0, world - 1)), draw(st.integers(0, world - 1)), 1, 1)
            for _ in range(draw(st.integers(0, 3)))
        ]
        return Exchange(rank, world, tuple(sorted(images, key=lambda im: im.owner)))

    vision = tuple(tuple(exchange(r) for _ in range(steps)) for r in range(world))
    audio = (
        tuple(tuple(exchange(r) for _ in range(steps)) for r in range(world)) if draw(st.booleans()) else None
    )
    nodes = [draw(st.integers(0, 2)) for _ in range(world)]
    return RoundDecision(draw(st.integers(0, 9)), steps, plan, vision, audio), nodes


@settings(max_examples=200, deadline=None)
@given(rounds())
def test_each_rank_is_whole_in_its_node_and_the_views_cover_the_plan(case):
    decision, nodes = case
    world = len(nodes)
    members = {n: {r for r in range(world) if nodes[r] == n} for n in set(nodes)}
    views = {n: decision_for_node(decision, ranks) for n, ranks in members.items()}
    for n, view in views.items():
        assert (view.round, view.target, len(view.plan), len(view.vision)) == (
            decision.round,
            decision.target,
            world,
            world,
        )
        for r in range(world):
            assert len(view.plan[r]) == len(decision.plan[r])  # every rank keeps its step count
            if nodes[r] == n:
                assert view.plan[r] == decision.plan[r] and view.vision[r] == decision.vision[r]
                assert decision.audio is None or view.audio[r] == decision.audio[r]
        assert (view.audio is None) == (decision.audio is None)
    for r in range(world):
        for s, group in enumerate(decision.plan[r]):
            for sample in group:  # seen by its rank's node and its home's node, by no other
                seen = {n for n, v in views.items() if sample in v.plan[r][s]}
                assert seen == {nodes[r], nodes[sample.home_rank]}
            union = {x.id for v in views.values() for x in v.plan[r][s]}
            assert union == {x.id for x in group}
        for phase in ("vision", "audio") if decision.audio is not None else ("vision",):
            for s, ex in enumerate(getattr(decision, phase)[r]):
                for im in ex.encode:  # an item (image, clip) is seen by its encoder's node and its home's
                    seen = {n for n, v in views.items() if im in getattr(v, phase)[r][s].encode}
                    assert seen == {nodes[r], nodes[im.home_rank]}


def test_a_decision_without_a_plan_is_everyones():
    decision = RoundDecision(4, 2)
    assert decision_for_node(decision, {0}) is decision


@settings(max_examples=50, deadline=None)
@given(rounds())
def test_round_exchanges_sums_the_steps(case):
    decision, nodes = case
    got = round_exchanges(decision.vision, nodes)
    assert set(got) == {"intra_node_images", "intra_node_rows", "cross_node_images", "cross_node_rows"}
    for key, value in got.items():
        assert value == sum(exchanged(step, nodes)[key] for step in zip(*decision.vision, strict=False))


def test_set_topology_validates_both_before_setting_either():
    core = Coordinator(
        JobSpec(world_size=2, token_budget=512, policy=PolicySpec(name="local", window=8, depth=8))
    )
    core.set_topology([0, 0], [0, 1])
    assert (core.nodes, core.vision_nodes) == ([0, 0], [0, 1])
    with pytest.raises(ValueError, match=r"nodes\[1\]"):
        core.set_topology([1, 1], [0, -1])
    with pytest.raises(ValueError, match="one node index per rank"):
        core.set_topology([0], None)
    assert (core.nodes, core.vision_nodes) == ([0, 0], [0, 1])  # a refused topology changes nothing
    core.set_topology(None, None)
    assert core.nodes is None and core.vision_nodes is None
