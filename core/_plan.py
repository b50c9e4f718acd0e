"""Cross-rank balancing (policy `balanced`): one round's inputs, its plan, and the entry point.

The coordinator sees every rank's buffered metadata (lengths, never payloads) and plans the round's
T steps for all N ranks at once: `plan_round(PlanInputs(...)) -> RoundPlan`. Without a topology the
plan is node-blind (`_plan_blind`); with `nodes` and `node_local` a round is planned per node where
that costs as node-blind (`_plan_local`, additive costs); with `nodes` alone it is node-aware
(`_plan_nodes`, `_plan_deal`), and falls back to node-blind if its swap repair exceeds its guard.
What the planner guarantees and why (progress bound, cost levels, the proofs, measured figures):
docs/design/balancing.md.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ._plan_blind import plan_blind
from ._plan_inputs import PlanInputs, PlanSteps, RoundPlan
from ._plan_local import plan_local
from ._plan_nodes import plan_nodes
from ._types import Sample

__all__ = ["PlanInputs", "PlanSteps", "RoundPlan", "plan_round"]


def plan_round(inputs: PlanInputs) -> RoundPlan:
    """Plans one round for every rank (docs/design/balancing.md).

    Invariants: each chosen sample in exactly one group; exactly T steps per rank, T <= capacity;
    no group of several samples costs more than the budget; every rank r gets at least min(T, B_r) of
    its B_r pooled samples; a final round with T < capacity takes the whole pool; the same inputs give
    the same plan. Node-aware adds: every step's slowest rank costs exactly its level (the global cost
    sort of the round's groups cut into rows of N). Node-local adds: a kept round costs at most
    (1 + LOCAL_TOLERANCE) x node-blind's per token and moves a sample off its node only in an
    over-budget step, into room its thin node's own samples do not fit, or to share out the remaining
    work (`unread`) among the nodes. Cost: O(P log P) for P pooled samples, O(T x K x N)
    for the node-blind level rows of K groups, plus O(log L) regroupings of the chosen ones (node-aware:
    per node, plus O(swaps x N x T)).
    """
    if not inputs.pool or inputs.capacity < 1:
        return RoundPlan(tuple(() for _ in range(inputs.world_size)))
    if inputs.nodes is not None and inputs.node_plan == "local":
        if not inputs.cost.additive:  # padded: node-blind (docs/design/balancing.md, "Why not padded")
            return RoundPlan(_frozen(plan_blind(inputs, random.Random(inputs.seed))))
        plan, local = plan_local(inputs, random.Random(inputs.seed))
        return RoundPlan(_frozen(plan), node_local=local)
    if inputs.nodes is not None and inputs.node_plan == "aware":
        planned = plan_nodes(inputs, random.Random(inputs.seed))
        if planned is not None:
            plan, swaps = planned
            return RoundPlan(_frozen(plan), node_aware=True, node_swaps=swaps)
        return RoundPlan(_frozen(plan_blind(inputs, random.Random(inputs.seed))), node_fallback=True)
    return RoundPlan(_frozen(plan_blind(inputs, random.Random(inputs.seed))))


def _frozen(plan: Sequence[Sequence[tuple[Sample, ...]]]) -> PlanSteps:
    return tuple(tuple(steps) for steps in plan)
