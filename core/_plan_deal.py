"""The node-aware plan's deal: global cost levels per step, node-local rows, cross-node swaps.

`deal_levels` takes every node's K_n x T groups and returns them in row order such that each step's
costliest group is at most that step's level l_s: the cost of the first group of row s when all
N x T groups are sorted by cost and cut into rows of N (the node-blind deal's cost profile). Violations
are repaired by swapping groups across nodes (`_cheap_pair`, else `_cheapest_fit`); why the repair
ends and why a partner always exists: docs/design/balancing.md ("Deal by levels"). `place_on` then
assigns a node's row to its ranks by home-rank affinity.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence

from ._policy import Group

GroupCost = Callable[[Group], float]


def deal_levels(
    chosen: Sequence[Sequence[Group]], sizes: Sequence[int], target: int, group_cost: GroupCost
) -> tuple[list[list[Group]], int] | None:
    """Deals every node's groups (node i holds sizes[i] x `target` of them, IDLE = []) into `target`
    rows of sizes[i] each, so that each row's costliest group is at most the row's level.

    Returns each node's groups in row order (row s of node i: positions s x sizes[i] onwards) and the
    number of cross-node swaps made, or None if the repair exceeded its guard of 4 x N x T swaps (it
    provably terminates; never observed). Each node starts top-down by cost (its i-th costliest group
    in row i // sizes[n]); every swap exchanges one group of the violating node for one of another node,
    so each node keeps its group count. O(N x T log(N x T)) plus O(swaps x N x T).
    """
    world_size = sum(sizes)
    everything = sorted((group_cost(g) for groups in chosen for g in groups), reverse=True)
    levels = [everything[s * world_size] for s in range(target)]

    def key(g: Group) -> tuple[float, int]:
        return (-group_cost(g), g[0].sample.id if g else -1)

    held = [sorted(groups, key=key) for groups in chosen]
    costs = [[group_cost(g) for g in groups] for groups in held]

    def first_violation(i: int) -> int | None:
        kn = sizes[i]
        for p, c in enumerate(costs[i]):
            if c > levels[p // kn]:
                return p
        return None

    heap = []
    for i in range(len(held)):
        p = first_violation(i)
        if p is not None:
            heap.append((-costs[i][p], i))
    heapq.heapify(heap)
    swaps, bound = 0, 4 * world_size * target
    while heap:
        top, n = heapq.heappop(heap)
        p = first_violation(n)
        if p is None:
            continue
        c = costs[n][p]
        if -top != c:  # stale entry: requeue at the node's current worst violation
            heapq.heappush(heap, (-c, n))
            continue
        if swaps >= bound:
            return None
        pair = _cheap_pair(held, costs, sizes, levels, n, levels[p // sizes[n]])
        if pair is None:  # the costliest violation itself, for the cheapest group where its cost fits
            fit = _cheapest_fit(costs, sizes, levels, n, c)
            if fit is None:
                return None
            m, q = fit
        else:
            p, m, q = pair
        _swap(held, costs, key, group_cost, (n, p), (m, q))
        swaps += 1
        for i in (n, m):
            p = first_violation(i)
            if p is not None:
                heapq.heappush(heap, (-costs[i][p], i))
    return held, swaps


def _swap(
    held: list[list[Group]],
    costs: list[list[float]],
    key: Callable[[Group], tuple[float, int]],
    group_cost: GroupCost,
    a: tuple[int, int],
    b: tuple[int, int],
) -> None:
    """Exchanges group a = (node, position) with group b, each reinserted into its new node's cost
    order (`key`); `costs` follows `held`. In place; O(groups of the two nodes)."""
    (n, p), (m, q) = a, b
    g, h = held[n].pop(p), held[m].pop(q)
    costs[n].pop(p)
    costs[m].pop(q)
    for i, x in ((n, h), (m, g)):
        j = bisect.bisect_left([key(y) for y in held[i]], key(x))
        held[i].insert(j, x)
        costs[i].insert(j, group_cost(x))


def _cheapest_fit(
    costs: Sequence[Sequence[float]], sizes: Sequence[int], levels: Sequence[float], n: int, c: float
) -> tuple[int, int] | None:
    """The cheapest group, costing less than `c`, that a node other than n holds in the rows whose level
    is >= c (the last such position of each node): (node, position), or None. O(nodes + T)."""
    rows = sum(1 for level in levels if level >= c)  # rows 0..rows-1 have level >= c
    best = None
    for m in range(len(costs)):
        if m == n:
            continue
        q = sizes[m] * rows - 1
        d = costs[m][q]
        if d < c and (best is None or d < best[0]):
            best = (d, m, q)
    return None if best is None else (best[1], best[2])


def _cheap_pair(
    held: Sequence[Sequence[Group]],
    costs: Sequence[Sequence[float]],
    sizes: Sequence[int],
    levels: Sequence[float],
    n: int,
    limit: float,
) -> tuple[int, int, int] | None:
    """The swap that moves the fewest samples for a violation of node n at a row of level `limit`: one
    of n's groups y costing more than `limit` for another node's group z costing at most `limit` held in
    a row whose level is >= y's cost. Returns (y's position, z's node, z's position) or None.
    O(N x T + T^2)."""
    target = len(levels)
    best_row: list[tuple[int, int, int] | None] = [None] * target  # cheapest z by the rows it sits in
    for m in range(len(held)):
        if m == n:
            continue
        k = sizes[m]
        for q in range(len(held[m]) - 1, -1, -1):  # cheapest first; stop above the limit
            if costs[m][q] > limit:
                break
            r = q // k
            cand = (len(held[m][q]), m, q)
            current = best_row[r]
            if current is None or cand < current:
                best_row[r] = cand
    prefix: list[tuple[int, int, int] | None] = []
    run: tuple[int, int, int] | None = None
    for here in best_row:
        if here is not None and (run is None or here < run):
            run = here
        prefix.append(run)
    best: tuple[int, int, int, int] | None = None
    for p, c in enumerate(costs[n]):
        if c <= limit:
            break
        rows = sum(1 for level in levels if level >= c)
        z = prefix[rows - 1] if rows else None
        if z is not None:
            cand4 = (len(held[n][p]) + z[0], p, z[1], z[2])
            if best is None or cand4 < best:
                best = cand4
    return None if best is None else (best[1], best[2], best[3])


def place_on(row: Sequence[Group], ranks: Sequence[int]) -> list[Group]:
    """Assigns the groups of a node's row (len(row) == len(ranks); [] = IDLE) to its ranks, greedily by
    how many of each group's samples live on each rank; returns the group of each rank in `ranks`
    order. O(samples x log samples)."""
    slot = {r: j for j, r in enumerate(ranks)}
    pairs: list[tuple[int, int, int]] = []
    for g, group in enumerate(row):
        counts: dict[int, int] = {}
        for e in group:
            j = slot.get(e.sample.home_rank)
            if j is not None:
                counts[j] = counts.get(j, 0) + 1
        pairs.extend((-c, g, j) for j, c in counts.items())
    pairs.sort()
    out: list[Group | None] = [None] * len(ranks)
    placed = set()
    for _, g, j in pairs:
        if g not in placed and out[j] is None:
            out[j] = row[g]
            placed.add(g)
    free = iter(j for j in range(len(ranks)) if out[j] is None)
    for g, group in enumerate(row):
        if g not in placed:
            out[next(free)] = group
    return [[] if g is None else g for g in out]  # every rank is filled: len(row) == len(ranks)
