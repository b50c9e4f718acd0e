"""The budget after an out-of-memory step: the one rule the coordinator applies when a trainer reports one.

A trainer whose step of planned cost C (the step's cost in budget units, `StepInfo.cost`: rows x longest
when padded, the token sum when packed) ran out of memory says so; the job's token budget L then becomes
`lowered_budget(L, C)`: 7/8 of the smaller of L and C, rounded down to `BUDGET_QUANTUM`. The new budget is
below C, so the step that failed can never be planned again as it was, and below L, so a report of a step
planned under an older, higher budget still lowers it. Steps planned under it may still run out of memory
(memory is not only a function of the cost): each such report lowers it again, by an eighth at least, so
a job settles within a few restarts, or reaches the floor, where `lowered_budget` raises.

Samples longer than the new budget then follow the job's rule for samples over the budget (the rank cuts
text samples to it), as in a job started with that budget.
"""

from __future__ import annotations

import math

from ._calibrate import BUDGET_QUANTUM

OOM_SHARE = 7 / 8  # the new budget's share of the failed step's cost


def lowered_budget(budget: int, cost: float) -> int:
    """The token budget after a step of planned cost `cost` ran out of memory under budget `budget`
    (module docstring): a multiple of BUDGET_QUANTUM below both. Raises ValueError when no budget of at
    least BUDGET_QUANTUM is below them, or on a budget < 1 or a cost that is not positive and finite."""
    if budget < 1:
        raise ValueError(f"the budget must be >= 1, got {budget=}")
    if not (math.isfinite(cost) and cost > 0):
        raise ValueError(f"an out-of-memory step has a positive planned cost, got {cost=}")
    new = int(min(budget, cost) * OOM_SHARE) // BUDGET_QUANTUM * BUDGET_QUANTUM
    if new >= min(budget, cost):  # a cost within a quantum of a multiple of it
        new -= BUDGET_QUANTUM
    if new < BUDGET_QUANTUM:
        raise ValueError(
            f"a step of planned cost {cost:g} ran out of memory under token budget {budget}: no budget of "
            f"at least {BUDGET_QUANTUM} tokens is below it; the model does not fit this device at any budget"
        )
    return new
