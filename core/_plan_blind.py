"""The node-blind balanced plan of one round, and the steps the node-aware plan shares with it.

`plan_blind` plans T steps for all N ranks from the pooled window (docs/design/balancing.md, "Node-blind
plan"): group and rank the pool, take N x T groups row by row so each step's ranks cost alike
(`_plan_level.level_choice`), or else the best N x T keeping every rank's quota (`choose`) regrouped under
the smallest capacity that still fits (`refine_groups`); sort by cost, cut rows of N (an epoch's last
round: `final_rows`, then `split_to_slots` fills each row's idle ranks), shuffle the rows and place each
group on the rank holding most of its samples (`place`).

Invariants: each chosen sample is in exactly one group, every rank gets exactly T steps (IDLE = empty),
no group of several samples costs more than the budget, every rank r receives at least
q_r = min(T, B_r) of its B_r pooled samples; the plan is a function of the inputs and the rng's state.
Cost: O(P log P) for P pooled samples, O(T x K x N) for the level rows of K groups, plus O(log L)
regroupings of the chosen ones.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._cost import CostModel
from ._grouping import split_largest
from ._plan_level import final_rows, level_choice
from ._plan_mix import IDLE_SLACK, mix_groups, mix_order, rows_waste
from ._policy import Entry, Group, form_groups, group_lengths, rank_groups
from ._types import Sample

if TYPE_CHECKING:
    from ._plan_inputs import PlanInputs

Plan = list[list[tuple[Sample, ...]]]  # plan[rank][step] -> the samples of that step (() = IDLE)


def round_target(groups: int, world_size: int, capacity: int, final: bool) -> int:
    """T, the round's steps per rank, from the number of candidate groups: whole rows of N groups,
    T = max(min(floor(groups / N), capacity), 1); a final round takes everything that fits,
    T = min(ceil(groups / N), capacity). O(1)."""
    if final:
        return min(-(-groups // world_size), capacity)
    return max(min(groups // world_size, capacity), 1)


def refine_groups(chosen: list[Entry], slots: int, token_budget: int, cost: CostModel) -> list[Group] | None:
    """Groups `chosen` under the smallest capacity c <= `token_budget` that still needs <= `slots`
    groups (binary search over c, from the costliest sample that fits), or None if none does.
    O(log L) groupings of `chosen`."""
    fitting = [cost.item(e.sample.length) for e in chosen if cost.item(e.sample.length) <= token_budget]
    lo = math.ceil(max(fitting)) if fitting else token_budget
    best = None
    hi = token_budget
    while lo <= hi:
        mid = (lo + hi) // 2
        groups = form_groups(chosen, mid, cost)
        if len(groups) <= slots:
            best, hi = groups, mid - 1
        else:
            lo = mid + 1
    return best


def choose(groups: Sequence[Group], slots: int, target: int, world_size: int) -> list[Group]:
    """The round's groups: the first `slots` of the ranked `groups`, unless that would leave a rank behind.

    Every rank r (< `world_size`) must see at least q_r = min(target, B_r) of its B_r samples in
    `groups` chosen. When the ranked prefix already does that (the usual case) it is the answer.
    Otherwise one pass in ranked order takes a group if it covers a sample some rank still needs, or if
    it leaves at least as many free slots as samples still needed; this keeps the invariant
    free slots >= samples needed (it holds at the start since sum_r q_r <= `slots`), so every quota is
    met. At most `slots` groups, in ranked order. O(samples in `groups`).
    """
    head = list(groups[:slots])
    if len(groups) <= slots:
        return head
    pooled: dict[int, int] = {}
    for g in groups:
        for e in g:
            pooled[e.sample.home_rank] = pooled.get(e.sample.home_rank, 0) + 1
    need = {r: min(target, b) for r, b in pooled.items() if r < world_size}
    covered = dict.fromkeys(need, 0)
    for g in head:
        for e in g:
            if e.sample.home_rank in covered:
                covered[e.sample.home_rank] += 1
    if all(covered[r] >= q for r, q in need.items()):
        return head
    owed = sum(need.values())
    chosen: list[Group] = []
    for g in groups:
        if len(chosen) == slots:
            break
        helps = False
        for e in g:
            r = e.sample.home_rank
            if need.get(r, 0) > 0:
                need[r] -= 1
                owed -= 1
                helps = True
        if helps or slots - len(chosen) - 1 >= owed:
            chosen.append(g)
    return chosen


def quotas(pool: Sequence[Entry], target: int, world_size: int) -> dict[int, int]:
    """q_r = min(target, B_r) for every rank r < `world_size` with B_r > 0 pooled samples. O(P)."""
    pooled: dict[int, int] = {}
    for e in pool:
        if e.sample.home_rank < world_size:
            pooled[e.sample.home_rank] = pooled.get(e.sample.home_rank, 0) + 1
    return {r: min(target, b) for r, b in pooled.items()}


def place(row: Sequence[Group], world_size: int) -> list[Group | None]:
    """Assigns each group of a row (at most `world_size` groups) to a distinct rank, greedily by how many
    of its samples live there; ranks left without a group get None. O(samples x log samples)."""
    pairs: list[tuple[int, int, int]] = []
    for g, group in enumerate(row):
        counts: dict[int, int] = {}
        for e in group:
            counts[e.sample.home_rank] = counts.get(e.sample.home_rank, 0) + 1
        pairs.extend((-c, g, r) for r, c in counts.items() if r < world_size)
    pairs.sort()
    out: list[Group | None] = [None] * world_size
    placed = set()
    for _, g, r in pairs:
        if g not in placed and out[r] is None:
            out[r] = row[g]
            placed.add(g)
    free = iter(r for r in range(world_size) if out[r] is None)
    for g, group in enumerate(row):
        if g not in placed:
            out[next(free)] = group
    return out


def split_to_slots(groups: list[Group], slots: int, cost: CostModel) -> list[Group]:
    """Splits the costliest group in halves (longest-first order kept) until `slots` groups or only
    singletons remain; a split never raises a group's cost. O(splits x groups)."""
    flat = [e for g in groups for e in g]
    idx, i = [], 0
    for g in groups:
        idx.append(list(range(i, i + len(g))))
        i += len(g)
    idx = split_largest(idx, slots, key=lambda g: cost.cost([flat[j].sample.length for j in g]))
    return [[flat[j] for j in g] for g in idx]


def _level(
    inputs: PlanInputs, groups: Sequence[Group], slots: int, target: int, width: int
) -> list[Group] | None:
    """`level_choice` over the ranked `groups` (ages from `inputs.now`; patience max_wait // 2), or None
    in a round the pool cannot fill (T below capacity, the source not yet exhausted: an epoch's end
    draining). There a level choice would leave its rigid outliers as the epoch's last step, which
    nothing can split over the ranks (llava-like, 64 ranks: a last step of 36 singletons and 7 images);
    the ranked prefix leaves the incomplete groups, which split."""
    if not inputs.level_rows or (not inputs.final and target < inputs.capacity):
        return None
    costs = [inputs.cost.cost(group_lengths(g)) for g in groups]
    ages = [inputs.now - min(e.arrival for e in g) for g in groups]
    quota = quotas(inputs.pool, target, inputs.world_size)
    patience = max(1, inputs.max_wait // 2)
    return level_choice(groups, costs, ages, slots, width, quota, inputs.max_wait, patience)


def _rows(chosen: list[Group], n: int, target: int, cost: CostModel, width: int) -> list[list[Group]]:
    """The round's rows: the cost-sorted groups cut into rows of `n`. With fewer than `width` x `target`
    (an epoch's end) two cuts compete: the costliest groups split until n x `target` (or only
    singletons) and cut into rows of n, or `final_rows` into rows of at most `width` <= n, each row's
    costliest groups split to fill its n ranks; the one of lower `_score` wins (ties: the first)."""
    chosen = sorted(chosen, key=lambda g: -cost.cost(group_lengths(g)))
    if width == n and len(chosen) >= n * target:
        return [chosen[i : i + n] for i in range(0, len(chosen), n)]

    def by_cost(groups: list[Group]) -> list[Group]:
        return sorted(groups, key=lambda g: -cost.cost(group_lengths(g)))

    split = by_cost(split_to_slots(chosen, n * target, cost))
    whole = [split[i : i + n] for i in range(0, len(split), n)]
    bounds = final_rows([cost.cost(group_lengths(g)) for g in chosen], width, target)
    spread = [by_cost(split_to_slots(chosen[a:b], n, cost)) for a, b in itertools.pairwise(bounds)]
    return min((whole, spread), key=lambda rows: _score(rows, n, cost))


def _score(rows: list[list[Group]], n: int, cost: CostModel) -> float:
    """The sum over rows of max / mean rank cost (mean over all n ranks: idle ones cost 0)."""
    total = 0.0
    for row in rows:
        costs = [cost.cost(group_lengths(g)) for g in row]
        total += max(costs) * n / sum(costs) if sum(costs) > 0 else 1.0
    return total


def _mixed(
    inputs: PlanInputs, chosen: list[Group], rows: list[list[Group]], slots: int, target: int
) -> list[list[Group]]:
    """The round's rows mixed (`mix_groups` on `chosen` split to `slots`), kept if they leave at most
    `IDLE_SLACK` of their compute idle beyond the unmixed `rows`; else `rows`."""
    n, cost = inputs.world_size, inputs.cost
    base = split_to_slots(chosen, slots, cost) if len(chosen) < slots else chosen
    quota, salt = quotas(inputs.pool, target, n), zlib.crc32(str(inputs.seed).encode())
    mixed = mix_groups(inputs, base, slots, quota, salt)
    if mixed is None:
        return rows
    mixed_rows = _rows(mixed, n, target, cost, n)
    idle, compute = rows_waste(mixed_rows, n, cost)
    return mixed_rows if idle <= rows_waste(rows, n, cost)[0] + IDLE_SLACK * compute else rows


def plan_blind(inputs: PlanInputs, rng: random.Random) -> Plan:
    """The node-blind plan of a non-empty round (`inputs.pool` non-empty, `inputs.capacity` >= 1):
    plan[rank][step], T steps per rank. Draws from `rng` for the ranking and the row shuffle."""
    return deal_rows(inputs, blind_rows(inputs, rng), rng)


def deal_rows(inputs: PlanInputs, rows: list[list[Group]], rng: random.Random) -> Plan:
    """The plan of node-blind rows: shuffled by `rng` (mixed rounds: then in `mix_order`), each row's
    groups placed on the ranks holding most of their samples (`place`). Shuffles `rows` in place."""
    n = inputs.world_size
    rng.shuffle(rows)
    if inputs.mix:
        rows = [rows[i] for i in mix_order([sum(map(len, row)) for row in rows])]
    plan: Plan = [[] for _ in range(n)]
    for row in rows:
        for rank, group in enumerate(place(row, n)):
            plan[rank].append(tuple(e.sample for e in group) if group else ())
    return plan


def blind_rows(
    inputs: PlanInputs, rng: random.Random, groups: list[Group] | None = None
) -> list[list[Group]]:
    """The node-blind round's T rows of at most N groups each, costliest row first (mixed rows: in
    `_mixed`'s order), before the shuffle. Draws from `rng` for the ranking. `groups`: the pool's
    `form_groups`, where the caller has them already."""
    n, budget, cost = inputs.world_size, inputs.token_budget, inputs.cost
    if groups is None:
        groups = form_groups(inputs.pool, budget, cost)
    groups = rank_groups(groups, budget, cost, inputs.now, inputs.max_wait, rng, inputs.final)
    target = round_target(len(groups), n, inputs.capacity, inputs.final)
    slots = n * target
    width = n
    if inputs.final and len(groups) > slots:  # an epoch's last rounds: spread the stub (mixed or not)
        width = -(-len(groups) // -(-len(groups) // n))
    leveled = _level(inputs, groups, target * width, target, width)
    if leveled is None:
        width = n
    chosen = choose(groups, slots, target, n) if leveled is None else leveled
    if inputs.refine and leveled is None and len(chosen) == slots:
        refined = refine_groups([e for g in chosen for e in g], slots, budget, cost)
        if refined is not None:
            chosen = refined
    rows = _rows(chosen, n, target, cost, width)
    if inputs.mix:
        rows = _mixed(inputs, chosen, rows, slots, target)
    return rows
