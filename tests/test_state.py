"""Every stateful piece: JSON round trip, and a state from another rank/world/seed is refused."""

from __future__ import annotations

import json

import pytest

from batchd.core import Coordinator, JobSpec, RankState, Sample, Simulator, ViewSource


def _rank(rank=1, **kw):
    args = dict(world_size=4, policy="local", token_budget=1000, window=8, seed=3)
    args.update(kw)
    return RankState(JobSpec(**args), rank)


def _busy_rank():
    r = _rank()
    for i in range(5):
        r.push(Sample(i * 4 + 1, 100 + 40 * i, home_rank=1))
    r.push(Sample(99, 5000, home_rank=1))  # over budget: singleton
    return r


def _source():
    s = ViewSource(50, rank=1, world_size=4, seed=3, shuffle=True, wrap=True)
    for _ in range(17):
        s.next()
    return s


def _coordinator():
    c = Coordinator(JobSpec(world_size=4, token_budget=1000, seed=3, mode="non-join", quota=20))
    c.round, c.emitted = 5, 12
    return c


def _simulator():
    sim = Simulator(list(range(1, 80)), JobSpec(shuffle=False, world_size=3, token_budget=200, seed=3, window=7))
    for _ in range(4):
        sim.next_step()
    return sim


STAGES = {
    "rank": (_busy_rank, _rank),
    "source": (_source, lambda: ViewSource(50, rank=1, world_size=4, seed=3, shuffle=True, wrap=True)),
    "coordinator": (_coordinator, lambda: Coordinator(JobSpec(world_size=4, token_budget=1000, seed=3, mode="non-join", quota=20))),
    "simulator": (_simulator, lambda: Simulator(list(range(1, 80)),
                                                JobSpec(shuffle=False, world_size=3, token_budget=200, seed=3, window=7))),
}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_state_round_trip(name):
    """The shared save/load round trip: JSON-safe, and loading reproduces the same state."""
    make_busy, make_fresh = STAGES[name]
    busy = make_busy()
    state = busy.state_dict()
    text = json.dumps(state)
    fresh = make_fresh()
    fresh.load_state_dict(json.loads(text))
    assert fresh.state_dict() == state


@pytest.mark.parametrize(
    "other, needle",
    [
        (dict(rank=2), "rank"),
        (dict(world_size=8), "world_size"),
        (dict(seed=4), "seed"),
        (dict(policy="odb"), "policy"),
        (dict(token_budget=999), "token_budget"),
    ],
)
def test_rank_state_refuses_a_mismatched_state(other, needle):
    state = _busy_rank().state_dict()
    with pytest.raises(ValueError, match=needle):
        _rank(**other).load_state_dict(state)


def test_source_and_coordinator_refuse_mismatched_states():
    with pytest.raises(ValueError, match="seed"):
        ViewSource(50, rank=1, world_size=4, seed=4).load_state_dict(_source().state_dict())
    with pytest.raises(ValueError, match="world_size"):
        Coordinator(JobSpec(world_size=8, token_budget=1000, seed=3, mode="non-join", quota=20)).load_state_dict(
            _coordinator().state_dict())
    with pytest.raises(ValueError, match="window"):
        Simulator(list(range(1, 80)), JobSpec(shuffle=False, world_size=3, token_budget=200, seed=3, window=8)).load_state_dict(
            _simulator().state_dict())


def test_state_is_refused_mid_round():
    r = _busy_rank()
    r.report(capacity=2)
    with pytest.raises(ValueError, match="between rounds"):
        r.state_dict()
