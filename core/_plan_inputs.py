"""One round's plan as data: `PlanInputs` (everything a plan depends on) and `RoundPlan` (the result).

The planners (`_plan_blind`, `_plan_nodes`) read `PlanInputs`; `_plan.plan_round` returns a
`RoundPlan`. This module imports no planner, so both sides import it without a cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ._choices import NODE_PLANS
from ._cost import CostModel
from ._plan_moves import check_nodes
from ._policy import Entry
from ._types import Sample, check_bool, check_choice, check_int

PlanSteps = tuple[tuple[tuple[Sample, ...], ...], ...]  # plan[rank][step] -> samples (() = IDLE)


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """Everything one round's plan depends on; the plan is a function of these alone.

    Attributes:
        pool: Every rank's buffered entries (sample metadata and arrival round); sample ids unique,
            home ranks normally in [0, world_size) (others are never placed home; node-aware files
            them under rank home % world_size's node). Stored as a tuple.
        world_size: N >= 1.
        capacity: The smallest free output capacity over ranks (>= 0); T never exceeds it, and 0
            plans no step.
        final: No rank will receive more samples this epoch: take everything that fits in `capacity`.
        token_budget: L >= 1, the most a group of several samples may cost.
        cost: The cost model.
        now: The round number (>= 0), for ages.
        max_wait: Rounds (>= 1) after which a sample is emitted first.
        seed: Seeds the round's generator (`random.Random(seed)`): the ranking tie-breaks and the row
            shuffle. An int or a str (the coordinator's is "plan:{seed}:{epoch}:{round}").
        refine: Regroup the chosen samples under the smallest capacity that still fits.
        nodes: `nodes[r]` the node index (int >= 0) of rank r: plan node-aware; None plans node-blind.
            Stored as a tuple.
        mix: Give the round's steps the sampler stream's make-up (`_plan_mix`: additive costs fill
            the groups from the oldest samples; rows reordered to even out sample counts), for
            optimizer updates of several steps (the coordinator sets it with `tokens_per_update` /
            `samples_per_update`); the rng draws are the same either way. The node-blind plan only
            (node-aware ignores it).
        level_rows: Node-blind: take the round's groups row by row so each step's ranks cost alike
            (`_plan_level`); off, the first N x T groups in ranked order.
        node_plan: How a round with `nodes` is planned (`NODE_PLANS`, `PolicySpec.nodes`): `aware` (this
            planner's default, so `nodes` alone plans node-aware) balances inside each node first;
            `local` plans node-local rounds where they cost as node-blind (`_plan_local`, packed and
            attention cost; padded cost plans node-blind); `blind` ignores `nodes`.
        unread: `unread[r]` the samples rank r's source still holds this epoch, beyond its window
            (>= 0); node-local rounds share out each node's remaining work by it. None: unknown (no
            sharing out). Stored as a tuple.

    Raises:
        ValueError: a field out of its range or of the wrong type, naming it.
    """

    pool: Sequence[Entry]
    world_size: int
    capacity: int
    final: bool
    token_budget: int
    cost: CostModel
    now: int
    max_wait: int
    seed: int | str
    refine: bool = True
    nodes: Sequence[int] | None = None
    mix: bool = False
    level_rows: bool = True
    node_plan: str = "aware"
    unread: Sequence[int] | None = None

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, lo=1)
        check_int("capacity", self.capacity, lo=0)
        check_bool("final", self.final)
        check_int("token_budget", self.token_budget, lo=1)
        cost, seed = self.cost, self.seed
        if not isinstance(cost, CostModel):
            raise ValueError(f"cost must be a CostModel, got {cost=!r}")
        check_int("now", self.now, lo=0)
        check_int("max_wait", self.max_wait, lo=1)
        if isinstance(seed, bool) or not isinstance(seed, int | str):
            raise ValueError(f"seed must be an int or a str, got {seed=!r}")
        check_bool("refine", self.refine)
        check_bool("level_rows", self.level_rows)
        check_choice("node_plan", self.node_plan, NODE_PLANS)
        check_bool("mix", self.mix)
        pool = tuple(self.pool)
        for i, e in enumerate(pool):
            if not isinstance(e, Entry):
                raise ValueError(f"pool[{i}] must be an Entry, got {e=!r}")
        object.__setattr__(self, "pool", pool)
        if self.nodes is not None:
            object.__setattr__(self, "nodes", tuple(check_nodes(self.nodes, self.world_size)))
        if self.unread is not None:
            unread = tuple(self.unread)
            if len(unread) != self.world_size:
                raise ValueError(f"unread must have world_size={self.world_size} entries, got {len(unread)=}")
            for r, u in enumerate(unread):
                check_int(f"unread[{r}]", u, lo=0)
            object.__setattr__(self, "unread", unread)


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """One round's plan and how it was made.

    Attributes:
        plan: plan[rank][step] -> the samples of that rank's group (() = IDLE); every rank has the
            same number of steps T (0 when the pool is empty or the capacity is 0).
        node_aware: The round was planned per node.
        node_fallback: Node-aware planning was asked for but the round was planned node-blind (the swap
            repair exceeded its guard).
        node_swaps: Groups swapped across nodes to keep every step under its level (node-aware only).
        node_local: The round was planned node-local (`_plan_local`): no sample leaves its node but
            those of its over-budget steps.

    Raises:
        ValueError: ranks of different step counts, both `node_aware` and `node_fallback`, or swaps
            without `node_aware`.
    """

    plan: PlanSteps
    node_aware: bool = False
    node_fallback: bool = False
    node_swaps: int = 0
    node_local: bool = False

    def __post_init__(self) -> None:
        steps = {len(p) for p in self.plan}
        if len(steps) > 1:
            raise ValueError(f"every rank must have the same number of steps, got {sorted(steps)=}")
        node_aware, node_fallback = self.node_aware, self.node_fallback
        if node_aware and node_fallback:
            raise ValueError(f"a round is planned node-aware or fallen back, not both: {node_fallback=}")
        check_int("node_swaps", self.node_swaps, lo=0)
        if self.node_local and (node_aware or node_fallback):
            raise ValueError(f"a node-local round is neither node-aware nor fallen back: {self.node_local=}")
        node_swaps = self.node_swaps
        if node_swaps and not node_aware:
            raise ValueError(f"only a node-aware plan swaps groups, got {node_swaps=}")

    @property
    def target(self) -> int:
        """T, the steps every rank runs this round."""
        return len(self.plan[0]) if self.plan else 0

    @property
    def stats(self) -> dict[str, int]:
        """The round's planning counts, to be summed over rounds: {} node-blind, {"node_aware": 1,
        "node_swaps": s} planned per node, {"node_fallback": 1} fallen back, {"node_local": 1} node-local
        (the coordinator's `plan_stats` and the simulator's `node_planned_rounds` /
        `node_fallback_rounds` / `node_swaps` / `node_local_rounds`)."""
        if self.node_aware:
            return {"node_aware": 1, "node_swaps": self.node_swaps}
        if self.node_fallback:
            return {"node_fallback": 1}
        if self.node_local:
            return {"node_local": 1}
        return {}
