"""The node-local plan of one round: each node plans its own samples, kept if it costs as node-blind.

Node-blind balancing (`_plan_blind`) pools every rank's window, so almost every sample trains on another
node than its own. With an additive cost a node whose window holds a few steps of samples fills its own
ranks' steps about as fully as the pooled window does, and then nothing needs to cross a node.
`plan_round` calls `plan_local` for additive costs, packed and attention (node-pure padded groups pad
more: docs/design/balancing.md, "Node-local rounds"):

1. Plan the round node-blind (`blind_rows`). Its rows that hold an over-budget sample are kept as they
   are: level rows gather those rigid outliers from every node into few steps, which one node cannot.
   Over-budget samples that node-blind leaves waiting wait here too.
2. The other samples: t = the largest t <= node-blind's other rows such that the nodes n (K_n ranks)
   holding K_n x t complete groups of their own (`CostModel.complete`) hold all but `THIN_SHARE` of
   the ranks; the others are thin. Each node runs the node-blind round (`blind_rows`: grouping,
   ranking, level rows, quotas) on its own pool, ranks and seed, with t steps (a thin node: a final
   round, its whole pool if it fits); step s is every node's s-th costliest row, so costly rows meet
   costly rows. Before that, with the ranks' `unread` counts, `share_out` moves work from the nodes
   holding more than their ranks' share of the job's remaining work to those holding less, so that
   every node's sources run dry about together and the epoch ends without a tail of light steps.
3. Each node fills the room under each step's level (its costliest group on any node) with its own
   waiting samples, oldest first (`_top_up`), then swaps one young sample per group for a waiting
   one that fills more (`_swap_up`); the room a thin node has left is filled from the other nodes'
   waiting samples where none of its own fits: with step 2's sharing out and the over-budget steps,
   the only samples that cross a node in a kept round. Before the top-up, a rank short of
   min(T, B_r) (node-blind's over-budget rows hold none of its samples) swaps its waiting samples in
   for those of ranks above their quota (`_repair`).
4. The round is kept if every rank r gets min(T, B_r) of its B_r samples and its cost per unit
   of work (sum over steps of the slowest rank's cost / the samples' own costs) is within
   `LOCAL_TOLERANCE` of node-blind's for the same round. Otherwise, or when no t >= 1 exists, in a final
   or mixed round, or with a home rank outside [0, N), the round is node-blind's, bit for bit.

Invariants of a kept round (node-blind's): each chosen sample in exactly one group, T steps per rank,
no group of several samples over the budget, every rank's quota, a function of the inputs; and it
costs at most (1 + LOCAL_TOLERANCE) x node-blind's per unit of work, and a sample leaves its node only
in an over-budget step, into room on a thin node that none of that node's waiting samples fits, or
by `share_out` (from a node above its share of the remaining work to one below). Cost: node-blind's
plan plus one per node on its own pool (O(P log P) in all), and O(waiting + placed x K) per step for
the top-up.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._cost import CostModel
from ._plan_blind import Plan, blind_rows, deal_rows, place, quotas
from ._plan_deal import place_on
from ._plan_nodes import _Topology
from ._policy import Entry, Group, form_groups, group_lengths

if TYPE_CHECKING:
    from ._plan_inputs import PlanInputs

# a node-local round is kept if its cost per unit of work is at most (1 + this) x node-blind's
LOCAL_TOLERANCE = 0.01
# at most this share of the ranks may sit on thin nodes (fewer than K_n x t complete groups of their own)
THIN_SHARE = 0.25

Rows = list[list[Group]]  # rows[s] -> the groups of step s


def plan_local(inputs: PlanInputs, rng: random.Random) -> tuple[Plan, bool]:
    """The round (plan[rank][step]) and whether it is node-local (`inputs.nodes` set, pool non-empty,
    capacity >= 1). Draws from `rng` as `plan_blind` does: the ranking, then the row shuffle, so a round
    not kept is `plan_blind`'s."""
    assert inputs.nodes is not None
    n = inputs.world_size
    members = _Topology.of(inputs.nodes).members
    blind = blind_rows(inputs, rng)
    local = _local_round(inputs, members, blind)
    if local is None:
        return deal_rows(inputs, blind, rng), False
    fixed, per_node = local
    order = list(range(len(fixed) + len(per_node[0])))
    rng.shuffle(order)
    plan: Plan = [[] for _ in range(n)]
    for s in order:
        step = place(fixed[s], n) if s < len(fixed) else _place_nodes(per_node, s - len(fixed), members, n)
        for rank, group in enumerate(step):
            plan[rank].append(tuple(e.sample for e in group) if group else ())
    return plan, True


def _place_nodes(
    per_node: Sequence[Rows], s: int, members: Sequence[Sequence[int]], n: int
) -> list[Group | None]:
    """Step s of a node-local round: each node's row s on its own ranks by home-rank affinity (`place_on`),
    each group longest first."""
    step: list[Group | None] = [None] * n
    for i, ranks in enumerate(members):
        row = per_node[i][s] + [[] for _ in range(len(ranks) - len(per_node[i][s]))]
        for r, g in zip(ranks, place_on(row, ranks), strict=True):
            step[r] = sorted(g, key=lambda e: e.order)
    return step


def rows_cost(rows: Sequence[Sequence[Group]], inputs: PlanInputs) -> tuple[float, float]:
    """(sum over rows of the costliest group's cost, the work: sum of the samples' own costs) of a
    round's rows; their ratio is the round's cost per unit of work."""
    cost = inputs.cost
    total = sum(max((cost.cost(group_lengths(g)) for g in row if g), default=0.0) for row in rows)
    return total, sum(cost.item(e.sample.length) for row in rows for g in row for e in g)


def _local_round(
    inputs: PlanInputs, members: Sequence[Sequence[int]], blind: Rows
) -> tuple[Rows, list[Rows]] | None:
    """Steps 1-4: (the node-blind rows kept, per node its rows) if the round is kept, else None."""
    if inputs.final or inputs.mix or not blind:
        return None
    n, cost, budget = inputs.world_size, inputs.cost, inputs.token_budget
    node_of = {r: i for i, ranks in enumerate(members) for r in ranks}
    if any(e.sample.home_rank not in node_of for e in inputs.pool):
        return None
    fixed = [row for row in blind if any(len(g) == 1 and cost.item(g[0].sample.length) > budget for g in row)]
    out = {e.sample.id for row in fixed for g in row for e in g}
    pools: list[list[Entry]] = [[] for _ in members]
    for e in inputs.pool:
        if e.sample.id not in out and cost.item(e.sample.length) <= budget:
            pools[node_of[e.sample.home_rank]].append(e)
    if inputs.unread is not None:
        share_out(inputs, members, pools, len(blind) - len(fixed))
    planned = _node_rows(inputs, members, pools, len(blind) - len(fixed))
    if planned is None:
        return None
    per_node, thin = planned
    rows = fixed + [[g for i in range(len(members)) for g in per_node[i][s]] for s in range(len(per_node[0]))]
    got: dict[int, int] = {}
    for row in rows:
        for g in row:
            for e in g:
                got[e.sample.home_rank] = got.get(e.sample.home_rank, 0) + 1
    need = quotas(inputs.pool, len(rows), n)
    surplus = {r: got.get(r, 0) - need.get(r, 0) for r in got.keys() | need.keys()}
    short = {r: -k for r, k in surplus.items() if k < 0}
    if short and not _repair(inputs, per_node, pools, short, surplus, node_of):
        return None
    if cost.additive:  # fills the groups of `rows` in place
        _top_up(inputs, per_node, pools, surplus, thin)
    b_cost, b_tokens = rows_cost(blind, inputs)
    l_cost, l_tokens = rows_cost(rows, inputs)
    if not (b_tokens > 0 and l_tokens > 0 and l_cost * b_tokens <= (1 + LOCAL_TOLERANCE) * b_cost * l_tokens):
        return None
    return fixed, per_node


def node_shares(
    inputs: PlanInputs, members: Sequence[Sequence[int]], pools: Sequence[Sequence[Entry]]
) -> list[float]:
    """Per node its share of the job's remaining work in ranks' worth (they sum to N): N x R_n / sum R,
    where R_n, node n's remaining work, is its pooled samples' cost plus each of its ranks' `unread`
    samples at that rank's mean pooled sample cost (the pool's mean for a rank with none pooled)."""
    assert inputs.unread is not None
    cost = inputs.cost
    work: dict[int, float] = {}
    count: dict[int, int] = {}
    for pool in pools:
        for e in pool:
            work[e.sample.home_rank] = work.get(e.sample.home_rank, 0.0) + cost.item(e.sample.length)
            count[e.sample.home_rank] = count.get(e.sample.home_rank, 0) + 1
    mean = sum(work.values()) / max(sum(count.values()), 1)
    unread = inputs.unread
    left = [
        sum(work.get(r, 0.0) + unread[r] * (work[r] / count[r] if count.get(r) else mean) for r in ranks)
        for ranks in members
    ]
    total = sum(left)
    if total <= 0:
        return [float(len(ranks)) for ranks in members]
    return [inputs.world_size * x / total for x in left]


def share_out(
    inputs: PlanInputs, members: Sequence[Sequence[int]], pools: list[list[Entry]], rows: int
) -> None:
    """Step 2a: a node n whose share s_n of the remaining work (`node_shares`) exceeds its K_n ranks
    hands (s_n - K_n) x rows x L of it, its oldest samples first (one whose cost is more than twice the
    amount left stays, and each rank keeps `rows` of its own), to the nodes below their share, each
    (costliest first) to the one with the most room (K_m - s_m) x rows x L left: so every node's own
    samples run out about when the others' do, and the epoch ends without a tail on the nodes that
    had the most work. In place; the importing node plans a received sample as aged (it goes this
    round) under a rank of no quota."""
    cost, budget = inputs.cost, float(inputs.token_budget)
    shares = node_shares(inputs, members, pools)
    moving: list[Entry] = []
    for i, pool in enumerate(pools):
        want = (shares[i] - len(members[i])) * rows * budget
        if want <= 0:
            continue
        own: dict[int, int] = {}
        for e in pool:
            own[e.sample.home_rank] = own.get(e.sample.home_rank, 0) + 1
        keep = []
        for e in sorted(pool, key=lambda e: (e.arrival, e.sample.id)):
            c = cost.item(e.sample.length)
            if want >= c / 2 and own[e.sample.home_rank] > rows:  # its rank keeps its quota at home
                moving.append(e)
                own[e.sample.home_rank] -= 1
                want -= c
            else:
                keep.append(e)
        pool[:] = keep
    room = {i: (len(members[i]) - s) * rows * budget for i, s in enumerate(shares) if s < len(members[i])}
    for e in sorted(moving, key=lambda e: (-cost.item(e.sample.length), e.sample.id)):
        to = max(room, key=lambda i: (room[i], -i))  # shares sum to N: one above its share, one below
        pools[to].append(Entry(e.sample, min(e.arrival, inputs.now - inputs.max_wait)))
        room[to] -= cost.item(e.sample.length)


def _node_rows(
    inputs: PlanInputs, members: Sequence[Sequence[int]], pools: Sequence[list[Entry]], most: int
) -> tuple[list[Rows], list[bool]] | None:
    """Step 2: per node its t rows (global home ranks, row 0 costliest) and whether it is thin (fewer
    than K_n x t complete groups: a final round of its pool, rows light or IDLE), or None when t < 1."""
    from ._plan_inputs import PlanInputs

    budget, cost = inputs.token_budget, inputs.cost
    subs: list[list[Entry]] = []
    grouped = []
    for i, pool in enumerate(pools):
        local, k = {r: j for j, r in enumerate(members[i])}, len(members[i])
        entries = [  # a sample `share_out` moved here: under rank k, of no quota
            Entry(e.sample._replace(home_rank=local.get(e.sample.home_rank, k)), e.arrival) for e in pool
        ]
        subs.append(entries)
        grouped.append(form_groups(entries, budget, cost))
    fills = [
        sum(1 for g in groups if cost.complete(group_lengths(g), budget)) // len(members[i])
        for i, groups in enumerate(grouped)
    ]
    n, t = inputs.world_size, most
    while t >= 1 and sum(len(members[i]) for i, f in enumerate(fills) if f < t) > THIN_SHARE * n:
        t -= 1
    if t < 1:
        return None
    out: list[Rows] = []
    for i, pool in enumerate(pools):
        k = len(members[i])
        back = {e.sample.id: e for e in pool}
        sub = PlanInputs(
            pool=subs[i],
            world_size=k,
            capacity=t,
            final=fills[i] < t,  # thin: everything it has
            token_budget=budget,
            cost=cost,
            now=inputs.now,
            max_wait=inputs.max_wait,
            seed=f"{inputs.seed}:node:{i}",
            refine=inputs.refine,
            level_rows=inputs.level_rows,
        )
        rows = blind_rows(sub, random.Random(sub.seed), grouped[i]) if pool else []
        if len(rows) > t or (len(rows) < t and fills[i] >= t):
            return None
        rows += [[] for _ in range(t - len(rows))]
        out.append(
            [
                [[back[e.sample.id] for e in g] for g in row] + [[] for _ in range(k - len(row))]
                for row in rows
            ]
        )
    return out, [f < t for f in fills]


def _levels(inputs: PlanInputs, per_node: Sequence[Rows]) -> list[float]:
    """Per row its level: its costliest group on any node, at most the budget."""
    cost, budget = inputs.cost, float(inputs.token_budget)
    return [
        min(
            budget, max((cost.cost(group_lengths(g)) for node in per_node for g in node[s] if g), default=0.0)
        )
        for s in range(len(per_node[0]))
    ]


def _repair(
    inputs: PlanInputs,
    per_node: list[Rows],
    pools: Sequence[list[Entry]],
    short: dict[int, int],
    surplus: dict[int, int],
    node_of: dict[int, int],
) -> bool:
    """Gives each rank r short of its quota (its node's t rows cover min(t, B_r), node-blind's kept
    over-budget rows may hold none of its samples) short[r] of its waiting samples, cheapest first,
    each swapped into its node's rows for a sample of a rank above its quota (`surplus`, updated) that
    costs at least as much less the group's room under its row's level; False where one cannot be. In
    place: the swapped-out sample waits."""
    cost, levels = inputs.cost, _levels(inputs, per_node)
    taken = {e.sample.id for node in per_node for row in node for g in row for e in g}
    for r, missing in sorted(short.items()):
        node = node_of[r]
        mine = sorted(
            (e for e in pools[node] if e.sample.home_rank == r and e.sample.id not in taken),
            key=lambda e: (cost.item(e.sample.length), e.sample.id),
        )
        for x in mine[:missing]:
            cx = cost.item(x.sample.length)
            best = None  # (cost given up, row, group, position)
            for s, row in enumerate(per_node[node]):
                for j, g in enumerate(row):
                    room = levels[s] - cost.cost(group_lengths(g))
                    for p, y in enumerate(g):
                        cy = cost.item(y.sample.length)
                        if (
                            surplus.get(y.sample.home_rank, 0) > 0
                            and cx <= cy + room
                            and (best is None or cy < best[0])
                        ):
                            best = (cy, s, j, p)
            if best is None:
                return False
            _, s, j, p = best
            y = per_node[node][s][j][p]
            per_node[node][s][j][p] = x
            surplus[y.sample.home_rank] -= 1
            surplus[r] += 1
            taken.add(x.sample.id)
            missing -= 1
        if missing:
            return False
    return True


def _top_up(
    inputs: PlanInputs,
    per_node: list[Rows],
    pools: Sequence[list[Entry]],
    surplus: dict[int, int],
    thin: Sequence[bool],
) -> None:
    """Step 3: each node fills the room under each row's level (the row's costliest group over all
    nodes, at most the budget) with its own waiting samples, costliest first, each into the group of
    that row it fits most tightly, then `_swap_up`; a thin node's room left (IDLE groups included) is
    then filled the same way from the other nodes' waiting samples. In place."""
    cost, rows, levels = inputs.cost, len(per_node[0]), _levels(inputs, per_node)
    taken = {e.sample.id for node in per_node for row in node for g in row for e in g}
    spare: list[Entry] = []
    for i, node in enumerate(per_node):
        left = [e for e in pools[i] if e.sample.id not in taken]
        left.sort(key=lambda e: (e.arrival, -cost.item(e.sample.length), e.sample.id))
        for s in range(rows):
            if left:
                left = _swap_up(inputs, node[s], *_fill(cost, node[s], levels[s], left), surplus)
        spare.extend(left)
    spare.sort(key=lambda e: (e.arrival, -cost.item(e.sample.length), e.sample.id))
    for i, node in enumerate(per_node):
        for s in range(rows if thin[i] else 0):
            if spare:
                _, spare = _fill(cost, node[s], levels[s], spare)


def _fill(
    cost: CostModel, row: list[Group], level: float, left: list[Entry]
) -> tuple[list[float], list[Entry]]:
    """Best fit decreasing of `left` (costliest first) into the groups of `row` (IDLE ones too) up to
    `level` each; returns the room left per group and the samples left, in order. In place.
    O(left + placed x groups)."""
    room = [level - cost.cost(group_lengths(g)) if g else level for g in row]
    most = max(room, default=0.0)  # a sample costing more fits no group: O(1) to skip it
    keep = []
    for e in left:
        c = cost.item(e.sample.length)
        if c > most:
            keep.append(e)
            continue
        best = min((j for j in range(len(row)) if room[j] >= c), key=lambda j: room[j])
        row[best].append(e)
        room[best] -= c
        most = max(room)
    return room, keep


def _swap_up(
    inputs: PlanInputs, groups: list[Group], room: list[float], left: list[Entry], surplus: dict[int, int]
) -> list[Entry]:
    """Raises each group toward its row's level by one swap: one of its samples that has waited fewer
    than max_wait // 2 rounds (so a waiting sample is never pushed back) and whose rank keeps its quota
    (`surplus[rank]`: samples taken beyond it, updated) leaves for the waiting sample that adds the most
    cost within the group's room. Returns the waiting samples, costliest first. O(group samples x log
    waiting) per group."""
    cost = inputs.cost
    patience = max(1, inputs.max_wait // 2)
    keys = sorted((cost.item(e.sample.length), e.sample.id) for e in left)  # ascending
    by_id = {e.sample.id: e for e in left}
    for j, g in enumerate(groups):
        if room[j] <= 0 or not keys:
            continue
        best: tuple[float, int, int] | None = None  # (gain, position in g, position in keys)
        for p, y in enumerate(g):
            if inputs.now - y.arrival >= patience or surplus.get(y.sample.home_rank, 0) <= 0:
                continue
            cy = cost.item(y.sample.length)
            k = bisect.bisect_right(keys, (cy + room[j], math.inf)) - 1
            if k >= 0 and keys[k][0] > cy and (best is None or keys[k][0] - cy > best[0]):
                best = (keys[k][0] - cy, p, k)
        if best is None:
            continue
        gain, p, k = best
        x = by_id.pop(keys.pop(k)[1])
        y, g[p] = g[p], x
        room[j] -= gain
        by_id[y.sample.id] = y
        surplus[y.sample.home_rank] -= 1
        surplus[x.sample.home_rank] = surplus.get(x.sample.home_rank, 0) + 1
        bisect.insort(keys, (cost.item(y.sample.length), y.sample.id))
    return [by_id[i] for _, i in reversed(keys)]
