"""Seeded planner inputs and the recorded plans `test_plan_equivalence.py` compares against.

`tests/data/plan_rounds.json` holds, per case, the inputs of one `plan_round` call and the plan and stats
the planner returned for them when the fixture was recorded (the planner before its split into
`core/_plan*.py`, commit 57403fc). The inputs are drawn from a seeded generator like the hypothesis
strategy of `test_node_balance.py` (small pools, every cost model, node-blind and every kind of
topology), plus a few larger pools that exercise the node-aware refine, fill and swap paths.

Regenerate (only after an intended change of the plans): `python tests/_plan_cases.py`.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from batchd.core import CostModel, PlanInputs, Sample, plan_round
from batchd.testing import Entry

FIXTURE = Path(__file__).resolve().parent / "data" / "plan_rounds.json"
BUDGET = 64


def _topology(rng: random.Random, world_size: int) -> list[int] | None:
    kind = rng.randrange(4)
    if kind == 0:
        return None
    if kind == 1:
        k = rng.randint(1, world_size)
        return [r // k for r in range(world_size)]
    if kind == 2:
        return [rng.randint(0, 5) for _ in range(world_size)]
    return [r % 2 for r in range(world_size)]


def _case(rng: random.Random, large: bool) -> dict[str, Any]:
    world_size = rng.randint(2, 16) if large else rng.randint(1, 12)
    size = rng.randint(60, 260) if large else rng.randint(0, 60)
    budget = 256 if large else BUDGET
    pool = [
        [
            rng.randint(1, budget + budget // 2),
            rng.randrange(world_size + (1 if rng.random() < 0.05 else 0)),
            rng.randint(0, 6),
            rng.choice([0, 1, 5000]),
        ]
        for _ in range(size)
    ]
    nodes = _topology(rng, world_size)
    if large and nodes is None:
        nodes = [r // 2 for r in range(world_size)]
    return {
        "pool": pool,
        "world_size": world_size,
        "capacity": rng.randint(0, 6) if not large else rng.randint(1, 8),
        "final": rng.random() < 0.4,
        "token_budget": budget,
        "cost": [rng.choice(["padded", "padded", "packed", "attention"]), rng.choice([64, 4096])],
        "now": 6,
        "max_wait": 4,
        "seed": rng.choice([rng.randrange(4), f"plan:{rng.randrange(9)}:0:{rng.randrange(9)}"]),
        "refine": rng.random() < 0.8,
        "nodes": nodes,
    }


def inputs(case: dict[str, Any]) -> PlanInputs:
    """The `PlanInputs` of a recorded case (sample id = its index in `pool`)."""
    pool = [
        Entry(Sample(i, length, -1, home, (), nbytes), age)
        for i, (length, home, age, nbytes) in enumerate(case["pool"])
    ]
    return PlanInputs(
        pool=pool,
        world_size=case["world_size"],
        capacity=case["capacity"],
        final=case["final"],
        token_budget=case["token_budget"],
        cost=CostModel(*case["cost"]),
        now=case["now"],
        max_wait=case["max_wait"],
        seed=case["seed"],
        refine=case["refine"],
        nodes=case["nodes"],
    )


def outcome(case: dict[str, Any]) -> dict[str, Any]:
    """What the planner returns for a case: the plan as sample ids, rank -> step -> group, and stats."""
    result = plan_round(inputs(case))
    return {
        "plan": [[[s.id for s in group] for group in steps] for steps in result.plan],
        "stats": dict(sorted(result.stats.items())),
    }


def cases(count: int = 200, large: int = 24, seed: int = 20261202) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_case(rng, i >= count - large) for i in range(count)]


def main() -> int:
    recorded = [{"inputs": c, **outcome(c)} for c in cases()]
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(recorded, separators=(",", ":")) + "\n")
    print(f"wrote {len(recorded)} cases to {FIXTURE} ({FIXTURE.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
