"""`plan_round(PlanInputs) -> RoundPlan`: the recorded plans are kept, and inputs and results validate.

`tests/data/plan_rounds.json` (written by `tests/_plan_cases.py`) holds 200 seeded rounds, node-blind
and node-aware over every cost model, with the plans and stats the planner returned when it still took
twelve positional arguments (before its split into `core/_plan*.py`): the refactor changed none.
Re-recorded once since, when level rows (`core/_plan_level.py`) changed the node-blind plans (the
node-aware ones stayed as recorded).
"""

from __future__ import annotations

import json

import pytest
from _plan_cases import FIXTURE, inputs, outcome

from batchd.core import CostModel, PlanInputs, RoundPlan, Sample, plan_round
from batchd.testing import Entry

RECORDED = json.loads(FIXTURE.read_text())


def test_the_fixture_covers_both_planners():
    aware = sum(1 for r in RECORDED if r["stats"].get("node_aware"))
    swapped = sum(1 for r in RECORDED if r["stats"].get("node_swaps"))
    blind = sum(1 for r in RECORDED if r["inputs"]["nodes"] is None and any(r["plan"][0]))
    assert len(RECORDED) == 200 and aware >= 100 and swapped >= 50 and blind >= 20


@pytest.mark.parametrize("index", range(len(RECORDED)))
def test_plan_round_returns_the_recorded_plan(index):
    recorded = RECORDED[index]
    assert outcome(recorded["inputs"]) == {"plan": recorded["plan"], "stats": recorded["stats"]}


def test_the_plan_is_a_function_of_the_inputs():
    case = next(r["inputs"] for r in RECORDED if r["stats"].get("node_swaps"))
    first, second = plan_round(inputs(case)), plan_round(inputs(case))
    assert first == second and first.node_aware and first.node_swaps == first.stats["node_swaps"] > 0
    assert first.target == len(first.plan[0]) >= 1
    assert isinstance(first.plan, tuple) and all(isinstance(steps, tuple) for steps in first.plan)


def _inputs(**kw):
    args = dict(
        pool=[Entry(Sample(0, 8, -1, 0), 0)],
        world_size=2,
        capacity=1,
        final=False,
        token_budget=64,
        cost=CostModel(),
        now=0,
        max_wait=4,
        seed=0,
    )
    return PlanInputs(**{**args, **kw})


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("world_size", 0, "world_size=0"),
        ("capacity", -1, "capacity=-1"),
        ("final", 1, "final=1"),
        ("token_budget", 0, "token_budget=0"),
        ("cost", "padded", "cost='padded'"),
        ("now", -1, "now=-1"),
        ("max_wait", 0, "max_wait=0"),
        ("seed", 1.5, "seed=1.5"),
        ("seed", True, "seed=True"),
        ("refine", None, "refine=None"),
        ("pool", [Sample(0, 8)], r"pool\[0\]"),
        ("nodes", [0], r"len\(nodes\)=1"),
        ("nodes", [0, -1], r"nodes\[1\]=-1"),
    ],
)
def test_plan_inputs_name_the_bad_value(field, value, match):
    with pytest.raises(ValueError, match=match):
        _inputs(**{field: value})


def test_plan_inputs_store_tuples_and_an_empty_round_plans_nothing():
    x = _inputs(pool=[], nodes=[3, 3])
    assert x.pool == () and x.nodes == (3, 3)
    empty = plan_round(x)
    assert empty == RoundPlan(((), ())) and empty.target == 0 and empty.stats == {}
    assert plan_round(_inputs(capacity=0)).plan == ((), ())
    one = plan_round(_inputs())
    assert (
        one.target == 1 and one.stats == {} and sorted(map(len, (one.plan[0][0], one.plan[1][0]))) == [0, 1]
    )


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"plan": (((),), ())}, "same number of steps"),
        ({"plan": (), "node_aware": True, "node_fallback": True}, "not both"),
        ({"plan": (), "node_swaps": 2}, "node_swaps=2"),
        ({"plan": (), "node_aware": True, "node_swaps": -1}, "node_swaps=-1"),
    ],
)
def test_round_plan_validates(kw, match):
    with pytest.raises(ValueError, match=match):
        RoundPlan(**kw)


def test_round_plan_stats_keep_the_coordinator_keys():
    assert RoundPlan((), node_aware=True, node_swaps=3).stats == {"node_aware": 1, "node_swaps": 3}
    assert RoundPlan((), node_fallback=True).stats == {"node_fallback": 1}
    assert RoundPlan(((),)).stats == {}
