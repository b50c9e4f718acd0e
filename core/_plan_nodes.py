"""The node-aware balanced plan of one round (`PlanInputs.nodes` given).

Moves inside a node are in-process reference moves, moves across nodes cross the network, so the plan
keeps samples on their node where it can (docs/design/balancing.md, "Node-aware plan"):

1. Choose per node: each node groups and ranks its own pool (node-pure groups; a home rank outside
   [0, N) is filed under rank home % N's node), T is node-blind's rule on the total group count, and
   each node takes K_n x T groups keeping its ranks' quotas (`choose`).
2. Deficit nodes receive the other nodes' unchosen groups, the fewest bytes first (`_receive`).
3. Refine: padded cost with every node full regroups all nodes under one capacity with outliers pooled
   across nodes (`_refine_pooled`); otherwise each node refines alone. Then split groups until every
   node holds its slots (`_fill_nodes`) and pad with IDLE.
4. Deal by global levels with cross-node swaps (`deal_levels`), shuffle the rows (one permutation for
   all nodes) and place each node's row on its ranks (`place_on`).

Invariants as node-blind (`_plan_blind`): each chosen sample exactly once, T steps per rank, no group of
several samples over the budget, every rank's quota min(T, B_r) met from its own node's groups, a
function of the inputs and the rng's state; plus every step's slowest rank costs exactly its level.
Cost: O(P log P) for P pooled samples, O(log L) regroupings of the chosen ones per node, and
O(swaps x N x T) for the deal.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ._cost import CostModel
from ._plan_blind import Plan, choose, refine_groups, round_target
from ._plan_deal import deal_levels, place_on
from ._plan_moves import sample_bytes
from ._policy import _ORDER, Entry, Group, form_groups, group_lengths, rank_groups

if TYPE_CHECKING:
    from ._plan_inputs import PlanInputs

# `outliers`' price of pooling one sample across nodes, in slots (None: never pool, refine per node).
POOL_PENALTY: float | None = 0.05


@dataclasses.dataclass(frozen=True)
class _Topology:
    """The nodes of a round: `ids` sorted node indices, `where[rank]` its node's position in `ids`,
    `members[i]` the ranks of node i in rank order."""

    ids: list[int]
    where: list[int]
    members: list[list[int]]

    @classmethod
    def of(cls, nodes: Sequence[int]) -> _Topology:
        ids = sorted(set(nodes))
        position = {n: i for i, n in enumerate(ids)}
        where = [position[n] for n in nodes]
        members: list[list[int]] = [[] for _ in ids]
        for r, i in enumerate(where):
            members[i].append(r)
        return cls(ids, where, members)

    def node_of(self, e: Entry) -> int:
        """The node position of an entry's home rank (a home rank outside [0, N): rank home % N's)."""
        return self.where[e.sample.home_rank % len(self.where)]


def _group_bytes(g: Group) -> int:
    return sum(sample_bytes(e.sample) for e in g)


def plan_nodes(inputs: PlanInputs, rng: random.Random) -> tuple[Plan, int] | None:
    """The node-aware plan of a non-empty round (`inputs.nodes` set, `inputs.pool` non-empty,
    `inputs.capacity` >= 1) and its number of cross-node swaps, or None when the swap repair exceeded its
    guard (the caller then plans node-blind from a fresh rng). Draws one 64-bit seed from `rng` for the
    per-node rankings, then the row shuffle."""
    assert inputs.nodes is not None
    topo = _Topology.of(inputs.nodes)
    world_size, cost = inputs.world_size, inputs.cost
    local: list[list[Entry]] = [[] for _ in topo.ids]
    for e in inputs.pool:
        local[topo.node_of(e)].append(e)
    seed = rng.getrandbits(64)
    ranked = [_rank_node(inputs, x, random.Random(f"node:{seed}:{topo.ids[i]}")) for i, x in enumerate(local)]
    target = round_target(sum(map(len, ranked)), world_size, inputs.capacity, inputs.final)
    slots_of = [len(m) * target for m in topo.members]
    chosen = [choose(ranked[i], slots_of[i], target, world_size) for i in range(len(topo.ids))]
    _receive(ranked, chosen, slots_of)
    chosen = _refine_nodes(inputs, chosen, slots_of, topo.node_of)

    def group_cost(g: Group) -> float:
        return cost.cost(group_lengths(g)) if g else 0.0

    if sum(map(len, chosen)) < world_size * target:
        _fill_nodes(chosen, slots_of, group_cost, _group_bytes)
    for i in range(len(chosen)):
        chosen[i] += [[] for _ in range(slots_of[i] - len(chosen[i]))]  # IDLE
    held = deal_levels(chosen, [len(m) for m in topo.members], target, group_cost)
    if held is None:
        return None
    held_groups, swaps = held
    perm = list(range(target))
    rng.shuffle(perm)
    plan: Plan = [[()] * target for _ in range(world_size)]
    for i, ranks in enumerate(topo.members):
        kn = len(ranks)
        for step, row in enumerate(perm):
            chunk = held_groups[i][row * kn : (row + 1) * kn]
            for rank, group in zip(ranks, place_on(chunk, ranks), strict=False):
                plan[rank][step] = tuple(e.sample for e in group)
    return plan, swaps


def _rank_node(inputs: PlanInputs, entries: list[Entry], rng: random.Random) -> list[Group]:
    """A node's own pool grouped (node-pure) and ranked for emission with the node's generator."""
    if not entries:
        return []
    budget, cost = inputs.token_budget, inputs.cost
    groups = form_groups(entries, budget, cost)
    return rank_groups(groups, budget, cost, inputs.now, inputs.max_wait, rng, inputs.final)


def _receive(ranked: Sequence[Sequence[Group]], chosen: list[list[Group]], slots_of: Sequence[int]) -> None:
    """Deficit nodes (fewer chosen groups than slots) receive the other nodes' unchosen groups, the fewest
    bytes first (ties by first sample id), one per free slot, nodes in order. In place."""
    short = [i for i in range(len(chosen)) for _ in range(slots_of[i] - len(chosen[i]))]
    if not short:
        return
    left: list[Group] = []
    for i in range(len(chosen)):
        if len(ranked[i]) > len(chosen[i]):
            taken = {id(g) for g in chosen[i]}
            left.extend(g for g in ranked[i] if id(g) not in taken)
    left.sort(key=lambda g: (_group_bytes(g), g[0].sample.id))
    for i, g in zip(short, left, strict=False):
        chosen[i].append(g)


def _refine_nodes(
    inputs: PlanInputs,
    chosen: list[list[Group]],
    slots_of: Sequence[int],
    node_of: Callable[[Entry], int],
) -> list[list[Group]]:
    """Step 3's regrouping: pooled outliers under one capacity (padded cost, every node full,
    `POOL_PENALTY` set) if some capacity fits, else each full node alone under the smallest capacity
    that still fits its slots (`refine_groups`); unchanged without `inputs.refine`."""
    if not inputs.refine:
        return chosen
    budget, cost = inputs.token_budget, inputs.cost
    full = all(len(chosen[i]) == slots_of[i] for i in range(len(chosen)))
    if POOL_PENALTY is not None and not cost.additive and full:
        mixed = _refine_pooled(chosen, slots_of, budget, cost, POOL_PENALTY, node_of)
        if mixed is not None:
            return mixed
    for i in range(len(chosen)):
        if chosen[i] and len(chosen[i]) == slots_of[i]:
            refined = refine_groups([e for g in chosen[i] for e in g], slots_of[i], budget, cost)
            if refined is not None:
                chosen[i] = refined
    return chosen


def outliers(entries: Sequence[Entry], capacity: int, penalty: float) -> tuple[list[Group], list[Entry]]:
    """Contiguous (padded-cost) groups of one node's entries under `capacity`, with outliers taken out:
    a DP over the longest-first order minimizing slots used, where a group costs one slot and an outlier
    (left to the cross-node pool, grouped densely there) costs its share length / capacity of a slot plus
    `penalty`. Returns (groups, outliers). O(entries log entries)."""
    ordered = sorted(entries, key=_ORDER)
    a = [e.sample.length for e in ordered]
    m = len(a)
    best = [0.0] * (m + 1)
    step = [0] * (m + 1)
    for i in range(m - 1, -1, -1):
        j = min(m, i + max(1, capacity // a[i]))
        best[i], step[i] = 1 + best[j], j
        if a[i] <= capacity:
            out = best[i + 1] + a[i] / capacity + penalty
            if out < best[i]:
                best[i], step[i] = out, -1
    groups: list[Group] = []
    loose: list[Entry] = []
    i = 0
    while i < m:
        if step[i] < 0:
            loose.append(ordered[i])
            i += 1
        else:
            groups.append(ordered[i : step[i]])
            i = step[i]
    return groups, loose


def _pool_outliers(
    entries: Sequence[Sequence[Entry]],
    slots_of: Sequence[int],
    c: int,
    cost: CostModel,
    penalty: float,
    node_of: Callable[[Entry], int],
) -> list[list[Group]] | None:
    """One probe of `_refine_pooled` at capacity c: every node's `outliers` groups (None if some node's
    exceed its slots), the outliers of all nodes grouped together (None if the total exceeds the slots),
    each pooled group (most samples first) on the node with free slots holding most of its bytes."""
    own: list[list[Group]] = []
    loose: list[Entry] = []
    for i, x in enumerate(entries):
        groups, out = outliers(x, c, penalty)
        if len(groups) > slots_of[i]:
            return None
        own.append(groups)
        loose.extend(out)
    mixed = form_groups(loose, c, cost)
    if sum(map(len, own)) + len(mixed) > sum(slots_of):
        return None
    free = [slots_of[i] - len(own[i]) for i in range(len(own))]
    for g in sorted(mixed, key=lambda g: (-len(g), g[0].sample.id)):
        weight: dict[int, int] = {}
        for e in g:
            weight[node_of(e)] = weight.get(node_of(e), 0) + sample_bytes(e.sample)
        home = max((j for j in range(len(own)) if free[j] > 0), key=lambda j: (weight.get(j, 0), free[j], -j))
        own[home].append(g)
        free[home] -= 1
    return own


def _refine_pooled(
    chosen: Sequence[Sequence[Group]],
    slots_of: Sequence[int],
    token_budget: int,
    cost: CostModel,
    penalty: float,
    node_of: Callable[[Entry], int],
) -> list[list[Group]] | None:
    """Every node's chosen samples regrouped under one capacity c with outliers pooled across nodes
    (`_pool_outliers`), c the smallest that fits (binary search from the costliest sample that fits up
    to `token_budget`), or None. O(log L) probes."""
    entries = [[e for g in groups for e in g] for groups in chosen]
    fitting = [
        cost.item(e.sample.length) for x in entries for e in x if cost.item(e.sample.length) <= token_budget
    ]
    lo, hi = (math.ceil(max(fitting)) if fitting else token_budget), token_budget
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        planned = _pool_outliers(entries, slots_of, mid, cost, penalty, node_of)
        if planned is not None:
            found, hi = planned, mid - 1
        else:
            lo = mid + 1
    return found


def _fill_nodes(
    chosen: list[list[Group]],
    slots_of: Sequence[int],
    group_cost: Callable[[Group], float],
    group_bytes: Callable[[Group], int],
) -> None:
    """Splits groups in halves (longest-first order kept) until every node holds its slots or only
    singletons are left: the costliest multi-sample group of a node short of slots first (both halves
    stay); when no short node has one, the costliest anywhere, whose half with fewer bytes moves to the
    node shortest of slots. In place; O(splits x (nodes + log groups))."""
    count = len(chosen)
    heaps: list[list[tuple[float, int, Group]]] = [[] for _ in range(count)]
    seq = 0
    for i in range(count):
        for g in chosen[i]:
            if len(g) > 1:
                heaps[i].append((-group_cost(g), seq, g))
                seq += 1
        heapq.heapify(heaps[i])
    removed: set[int] = set()  # id() of split groups, dropped from `chosen` at the end
    held = [len(c) for c in chosen]
    while True:
        short = [i for i in range(count) if held[i] < slots_of[i]]
        if not short:
            break
        own = [i for i in short if heaps[i]]
        if own:
            i = min(own, key=lambda j: (heaps[j][0][0], j))
        else:
            full = [j for j in range(count) if heaps[j]]
            if not full:
                break
            i = min(full, key=lambda j: (heaps[j][0][0], j))
        _, _, g = heapq.heappop(heaps[i])
        removed.add(id(g))
        half = len(g) // 2
        parts = [g[:half], g[half:]]
        dest = [i, i]
        if held[i] >= slots_of[i]:  # split on a full node: the lighter half goes to the shortest node
            light = min((0, 1), key=lambda p: group_bytes(parts[p]))
            dest[light] = max(short, key=lambda j: (slots_of[j] - held[j], -j))
        for part, j in zip(parts, dest, strict=False):
            chosen[j].append(part)
            held[j] += 1
            if len(part) > 1:
                heapq.heappush(heaps[j], (-group_cost(part), seq, part))
                seq += 1
        held[i] -= 1
    if removed:
        for i in range(count):
            chosen[i] = [g for g in chosen[i] if id(g) not in removed]
