"""Cross-rank balancing (policy `balanced`): OrchMLLM-style batch post-balancing for one round.

The coordinator sees every rank's buffered metadata (lengths, never payloads) and plans the round's
T steps for all N ranks at once:

1. Group the pooled window count-optimally under L (`form_groups`), rank the groups as `local` does
   (old samples first, then complete groups in random order, then incomplete ones by quality) and take
   the best N x T, T = max(min(floor(K / N), capacity), 1): whole rows of N groups, so no rank idles;
   the rest recirculate. When every rank is exhausted (join) the round takes everything,
   T = min(ceil(K / N), capacity). One exception to "the best" (`_choose`): every rank r gets at least
   q_r = min(T, B_r) of its B_r pooled samples into the round (progress, below); the ranked prefix
   almost always does that already, and is then taken as is.
2. Refine (binary search over capacity): the smallest capacity c <= L whose grouping of the chosen
   samples still needs at most N x T groups. All groups then cost <= c, which evens them out: the
   slowest rank per step costs c instead of L. Greedy contiguous grouping is monotone in c, so the
   search is exact for padded cost; for additive costs a non-monotone probe just keeps the last
   grouping that fitted.
3. Fill: if fewer than N x T groups remain (last round), split the costliest groups so idle slots get
   work (splits never raise a group's cost).
4. Deal: sort groups by cost and cut into rows of N (minimizes the sum over steps of the row maximum
   for a fixed multiset of groups), then shuffle the rows (seeded) so step cost does not trend.
5. Place: inside a row, each group goes to the rank that owns most of its samples (greedy on the
   affinity count), so only the remainder moves; `moved` counts samples placed off their home rank.

Progress (the `min` rule's bound, kept): a join epoch takes at most max_r n_r steps, n_r the size of
rank r's sampler view. Ranking alone does not give it: a rank whose window holds only short samples
that form an incomplete group is passed over round after round, reads nothing new while its window is
full, and ends the epoch late (a regression test has 10 steps for max_r n_r = 9). With the quotas q_r:
K <= P <= N x W (W the window), so T <= W, and a rank still reading holds a full window (B_r = W >= T)
and loses >= T samples per round of T steps, while an exhausted rank with B_r < T empties. So after S
steps every rank has at most max(0, n_r - S) samples left; a non-final round has a rank still reading
with >= W >= T samples left, and the final round has T <= ceil(P / N) <= max_r B_r, so each round ends
by step max_r n_r. The quotas fit: sum_r q_r <= N x T groups. The premise is a full window on every
rank still reading, which the simulator always has; a daemon rank whose loader lags reports fewer.

Node-aware (`nodes` given, `nodes[r]` the node of rank r; OrchMLLM's point: moves inside a node are
free in-process reference moves, moves across nodes cross the network). With K_n ranks on node n:

1'. Choose per node. Each node groups and ranks its own pool (`form_groups`, `rank_groups`; node-pure
    groups, a home rank outside [0, N) filed under rank home % N's node), each with its own generator
    seeded from the round's. T is node-blind's rule on the total count K = sum_n g_n of node-pure
    groups, and each node runs `_choose` on its ranked groups with K_n x T slots and its ranks' quotas
    q_r = min(T, B_r). The rest of its pool recirculates on the node: it never has to move.
2'. Deficit nodes (fewer than K_n x T groups: final rounds, a lagging loader) receive the other nodes'
    unchosen groups, the fewest bytes (`sample_bytes`) first. In a final round with T = ceil(K / N)
    every group is then taken (unchosen groups number at most the free slots).
3'. Refine. Padded cost (contiguous grouping): node-pure groups waste padding, since a node's window is
    N / K_n times sparser in length than the pooled one (measured: 93.7% vs 99.9% padding efficiency on
    odb-synthetic's first window). So when every node is full, each node regroups its chosen samples
    (own and received) under one capacity c with outliers taken out (`_outliers`: a DP that pools a
    sample when that saves more than its share of a slot plus `POOL_PENALTY`), the outliers of all
    nodes are grouped together (dense: the pooled window), and c is the smallest capacity under which
    every node's groups fit its slots and all groups fit N x T; pooled groups go to the free slots of
    the node holding most of their bytes. Otherwise (additive costs, where node-pure groups waste
    nothing, or no c fits) each node refines alone: the smallest c_n whose grouping of its chosen
    samples still needs <= K_n x T groups (no further cross-node move).
    Fill: if fewer than N x T groups remain, split the costliest multi-sample group of a node short of
    slots (both halves stay); when none has one, the costliest anywhere, whose lighter half moves to the
    node shortest of slots; until N x T groups or only singletons (IDLE pads the rest).
4'. Deal globally, place node-locally (`_deal_levels`): sort all N x T groups by cost and cut rows of N;
    row s's level l_s is its first group's cost (node-blind's cost profile). Each node deals its own
    groups top-down, K_n per row; a group above its row's level is a violation, repaired (costliest
    first) by swapping one of the node's groups costing more than that level for another node's group
    costing at most it, held in a row whose level covers the first's cost, the pair moving the fewest
    samples (both cross nodes; `stats["node_swaps"]`); failing such a pair, the violating group for the
    cheapest group of another node in the rows whose level covers it. Then every step's slowest rank
    costs exactly l_s: the compute of the global cost sort of the round's groups. Rows are shuffled
    (seeded, one permutation for all nodes) and placed inside each node by home-rank affinity
    (`_place_on`).
Progress with nodes: sum over node n's ranks of q_r <= K_n x T, so `_choose`'s invariant holds on each
node alone and every rank's quota is met from its own node's chosen groups; received groups, splits and
the per-node regrouping only add or rearrange samples. K <= P <= N x W still, the final round's
T <= ceil(P / N) <= max_r B_r, so the bound above holds as is. The same chosen samples as node-blind
are not kept (the round may take other, or fewer, samples), only the quotas. Fallback: if the swap
repair exceeds 4 x N x T swaps (it provably terminates; the bound is a guard) the round is planned
node-blind (`stats["node_fallback"]`; never observed). Invariants as node-blind: each chosen sample
exactly once, exactly T steps per rank, no group over the budget but over-budget singletons,
deterministic for a seeded rng. `plan_moves` counts intra-node and cross-node moves of any plan.
Measured: docs/benchmarks.md (Node-aware balancing).

Cost: O(P log P) for P pooled samples plus O(log L) regroupings of the chosen ones (node-aware: the
same per node, plus O(swaps x N x T) for the deal).
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Callable, Sequence

from ._cost import CostModel
from ._grouping import split_largest
from ._policy import _ORDER, Entry, Group, form_groups, group_lengths, rank_groups
from ._types import Sample, check_int


def _refine(chosen: list[Entry], slots: int, token_budget: int, cost: CostModel) -> list[Group] | None:
    """Groups `chosen` under the smallest capacity that still needs <= `slots` groups."""
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


def plan_round(
    pool: Sequence[Entry],
    world_size: int,
    capacity: int,
    final: bool,
    token_budget: int,
    cost: CostModel,
    now: int,
    max_wait: int,
    rng: random.Random,
    refine: bool = True,
    nodes: Sequence[int] | None = None,
    stats: dict[str, int] | None = None,
) -> list[list[tuple[Sample, ...]]]:
    """Plans one round for every rank.

    Args:
        pool: Every rank's buffered entries (sample metadata and arrival round).
        world_size: N.
        capacity: The smallest free output capacity over ranks (T never exceeds it).
        final: No rank will receive more samples this epoch: take everything that fits in `capacity`.
        token_budget: L_max.
        cost: The cost model.
        now: The round number (for ages).
        max_wait: Rounds after which a sample is emitted first.
        rng: Seeded generator for the row shuffle.
        refine: Run step 2 (capacity binary search).
        nodes: `nodes[r]` is the node index of rank r: plan node-aware (module docstring, "Node-aware");
            None plans node-blind, exactly as without topology.
        stats: When given, counts node-aware rounds: `node_aware` (planned per node), `node_fallback`
            (the round was planned node-blind, `_deal_levels`) and `node_swaps` (groups swapped across
            nodes to keep every step under its level).

    Returns:
        plan[rank][step] -> the samples of that rank's group (empty tuple = IDLE); T steps per rank.

    Raises:
        ValueError: `nodes` does not hold one int >= 0 per rank.
    """
    if nodes is not None:
        nodes = check_nodes(nodes, world_size)
    if not pool or capacity < 1:
        return [[] for _ in range(world_size)]
    if nodes is not None:
        state = rng.getstate()
        planned = _plan_nodes(pool, nodes, capacity, final, token_budget, cost, now, max_wait, rng, refine)
        if planned is None:  # planned node-blind, as if without topology
            rng.setstate(state)
        if stats is not None:
            key = "node_fallback" if planned is None else "node_aware"
            stats[key] = stats.get(key, 0) + 1
            if planned is not None:
                stats["node_swaps"] = stats.get("node_swaps", 0) + planned[1]
        if planned is not None:
            return planned[0]
    groups = rank_groups(form_groups(pool, token_budget, cost), token_budget, cost, now, max_wait, rng, final)
    k = len(groups)
    if final:
        target = min(-(-k // world_size), capacity)
    else:
        target = max(min(k // world_size, capacity), 1)
    slots = world_size * target
    chosen_groups = _choose(groups, slots, target, world_size)
    if refine and len(chosen_groups) == slots:
        refined = _refine([e for g in chosen_groups for e in g], slots, token_budget, cost)
        if refined is not None:
            chosen_groups = refined
    if len(chosen_groups) < slots:
        flat = [e for g in chosen_groups for e in g]
        idx, i = [], 0
        for g in chosen_groups:
            idx.append(list(range(i, i + len(g))))
            i += len(g)
        idx = split_largest(idx, slots, key=lambda g: cost.cost([flat[j].sample.length for j in g]))
        chosen_groups = [[flat[j] for j in g] for g in idx]
    chosen_groups.sort(key=lambda g: -cost.cost(group_lengths(g)))
    rows = [chosen_groups[i : i + world_size] for i in range(0, len(chosen_groups), world_size)]
    rng.shuffle(rows)
    plan: list[list[tuple[Sample, ...]]] = [[] for _ in range(world_size)]
    for row in rows:
        for rank, group in enumerate(_place(row, world_size)):
            plan[rank].append(tuple(e.sample for e in group) if group else ())
    return plan


def _choose(groups: Sequence[Group], slots: int, target: int, world_size: int) -> list[Group]:
    """The round's groups: the first `slots` of the ranked list, unless that would leave a rank behind.

    Every rank r must see at least q_r = min(target, B_r) of its B_r pooled samples emitted (the
    progress guarantee, module docstring). When the ranked prefix already does that (the usual case)
    it is the answer. Otherwise one pass in ranked order takes a group if it covers a sample some rank
    still needs, or if it leaves at least as many free slots as samples still needed (each needed
    sample costs at most one group). Taking a needed group lowers both sides by >= 1, so the invariant
    free slots >= samples needed holds from the start (sum_r q_r <= N x T = slots) to the end, and
    every needed sample's group is reached with a slot free for it.
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


def _place(row: Sequence[Group], world_size: int) -> list[Group | None]:
    """Assigns each group of a row to a distinct rank, greedily by how many of its samples live there."""
    pairs = []
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


# -- node-aware planning ---------------------------------------------------------------------------------
def sample_bytes(sample: Sample) -> int:
    """Bytes a sample carries when it moves: its `nbytes` if known (> 0), else 8 x length (int32
    input_ids + labels)."""
    return sample.nbytes if sample.nbytes > 0 else 8 * sample.length


def check_nodes(nodes: Sequence[int], world_size: int) -> list[int]:
    """Returns `nodes` as a list if it holds one node index (an int >= 0) per rank; ValueError otherwise."""
    if isinstance(nodes, str | bytes) or not isinstance(nodes, Sequence):
        raise ValueError(f"nodes must be a sequence of node indices, one per rank, got {nodes=!r}")  # noqa: TRY004
    if len(nodes) != world_size:
        raise ValueError(f"nodes must hold one node index per rank ({world_size=}), got {len(nodes)=}")
    for r, v in enumerate(nodes):
        check_int(f"nodes[{r}]", v, lo=0)
    return list(nodes)


def plan_moves(
    plan: Sequence[Sequence[Sequence[Sample]]], nodes: Sequence[int] | None = None
) -> dict[str, int]:
    """Counts the samples (and their bytes, `sample_bytes`) a plan places off their home rank.

    `plan[rank][step]` is a group of samples (empty = IDLE), as `plan_round` returns it; `nodes[r]` is
    the node of rank r (None: every rank is its own node, so every move is cross-node). A sample placed
    on a rank other than its home rank moves intra-node when both ranks share a node, cross-node
    otherwise (a home rank outside the plan's ranks counts as cross-node).

    Returns:
        {"intra_node_samples", "intra_node_bytes", "cross_node_samples", "cross_node_bytes"}.
    """
    n = len(plan)
    where = check_nodes(nodes, n) if nodes is not None else list(range(n))
    intra = intra_bytes = cross = cross_bytes = 0
    for rank, steps in enumerate(plan):
        node = where[rank]
        for group in steps:
            for s in group:
                home = s.home_rank
                if home == rank:
                    continue
                if home < n and where[home] == node:
                    intra += 1
                    intra_bytes += sample_bytes(s)
                else:
                    cross += 1
                    cross_bytes += sample_bytes(s)
    return {
        "intra_node_samples": intra,
        "intra_node_bytes": intra_bytes,
        "cross_node_samples": cross,
        "cross_node_bytes": cross_bytes,
    }


def _plan_nodes(
    pool: Sequence[Entry],
    nodes: Sequence[int],
    capacity: int,
    final: bool,
    token_budget: int,
    cost: CostModel,
    now: int,
    max_wait: int,
    rng: random.Random,
    refine: bool,
) -> tuple[list[list[tuple[Sample, ...]]], int] | None:
    """The node-aware plan (module docstring, "Node-aware") and its number of swaps, or None when the
    swap repair did not converge within its bound (the caller then plans node-blind)."""
    world_size = len(nodes)
    ids = sorted(set(nodes))
    position = {n: i for i, n in enumerate(ids)}
    where = [position[n] for n in nodes]  # rank -> node position
    count = len(ids)
    members: list[list[int]] = [[] for _ in ids]
    for r, i in enumerate(where):
        members[i].append(r)

    def node_of(e: Entry) -> int:  # a home rank outside [0, N) is filed under rank home % N's node
        return where[e.sample.home_rank % world_size]

    local: list[list[Entry]] = [[] for _ in ids]
    for e in pool:
        local[node_of(e)].append(e)

    # 1'. Choose per node: node-pure groups, ranked with a per-node generator; T from their total count.
    seed = rng.getrandbits(64)
    ranked = [
        rank_groups(
            form_groups(x, token_budget, cost),
            token_budget,
            cost,
            now,
            max_wait,
            random.Random(f"node:{seed}:{ids[i]}"),
            final,
        )
        if x
        else []
        for i, x in enumerate(local)
    ]
    k = sum(map(len, ranked))
    if final:
        target = min(-(-k // world_size), capacity)
    else:
        target = max(min(k // world_size, capacity), 1)
    slots_of = [len(m) * target for m in members]
    chosen = [_choose(ranked[i], slots_of[i], target, world_size) for i in range(count)]

    def group_bytes(g: Group) -> int:
        return sum(sample_bytes(e.sample) for e in g)

    # 2'. Deficit nodes receive the other nodes' unchosen groups, the fewest bytes first.
    short = [i for i in range(count) for _ in range(slots_of[i] - len(chosen[i]))]
    if short:
        left = []
        for i in range(count):
            if len(ranked[i]) > len(chosen[i]):
                taken = {id(g) for g in chosen[i]}
                left.extend(g for g in ranked[i] if id(g) not in taken)
        left.sort(key=lambda g: (group_bytes(g), g[0].sample.id))
        for i, g in zip(short, left, strict=False):
            chosen[i].append(g)

    # 3'. Refine per node: the smallest capacity whose grouping of the node's chosen samples (own and
    # received, regrouped on the node) still fits its slots.
    pooled_ok = False
    if (
        refine
        and POOL_PENALTY is not None
        and not cost.additive
        and all(len(chosen[i]) == slots_of[i] for i in range(count))
    ):
        mixed = _refine_pooled(chosen, slots_of, token_budget, cost, POOL_PENALTY, node_of)
        if mixed is not None:
            chosen, pooled_ok = mixed, True
    if refine and not pooled_ok:
        for i in range(count):
            if chosen[i] and len(chosen[i]) == slots_of[i]:
                refined = _refine([e for g in chosen[i] for e in g], slots_of[i], token_budget, cost)
                if refined is not None:
                    chosen[i] = refined

    def group_cost(g: Group) -> float:
        return cost.cost(group_lengths(g)) if g else 0.0

    # Fill (final rounds, a lagging loader): split the costliest groups until N x T groups or only
    # singletons, inside the nodes that lack slots first; else elsewhere, one half moving to such a node.
    if sum(map(len, chosen)) < world_size * target:
        _fill_nodes(chosen, slots_of, group_cost, group_bytes)
    for i in range(count):
        chosen[i] += [[] for _ in range(slots_of[i] - len(chosen[i]))]  # IDLE

    # 4'. Deal globally, place node-locally: levels of the global cost sort, then swaps.
    held = _deal_levels(chosen, [len(m) for m in members], target, group_cost)
    if held is None:
        return None
    held_groups, swaps = held
    perm = list(range(target))
    rng.shuffle(perm)
    plan: list[list[tuple[Sample, ...]]] = [[()] * target for _ in range(world_size)]
    for i in range(count):
        kn = len(members[i])
        for step, row in enumerate(perm):
            chunk = held_groups[i][row * kn : (row + 1) * kn]
            for rank, group in zip(members[i], _place_on(chunk, members[i]), strict=False):
                plan[rank][step] = tuple(e.sample for e in group)
    return plan, swaps


# `_outliers`' price of pooling one sample across nodes, in slots (None: never pool, refine per node).
POOL_PENALTY: float | None = 0.05


def _outliers(entries: Sequence[Entry], capacity: int, penalty: float) -> tuple[list[Group], list[Entry]]:
    """Contiguous (padded-cost) groups of one node's entries under `capacity`, with outliers taken out:
    a DP over the longest-first order minimizing slots used, where a group costs one slot and an outlier
    (left to the cross-node pool, grouped densely there) costs its share length / capacity of a slot plus
    `penalty`. Returns (groups, outliers)."""
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
    groups, loose, i = [], [], 0
    while i < m:
        if step[i] < 0:
            loose.append(ordered[i])
            i += 1
        else:
            groups.append(ordered[i : step[i]])
            i = step[i]
    return groups, loose


def _refine_pooled(
    chosen: Sequence[Sequence[Group]],
    slots_of: Sequence[int],
    token_budget: int,
    cost: CostModel,
    penalty: float,
    node_of: Callable[[Entry], int],
) -> list[list[Group]] | None:
    """Every node's chosen samples regrouped under one capacity c with outliers pooled across nodes
    (`_outliers`), c the smallest that fits: each node's own groups within its slots, all groups within
    N x T. Pooled groups go to nodes with free slots, the one holding most of their bytes first."""
    entries = [[e for g in groups for e in g] for groups in chosen]
    total = sum(slots_of)

    def attempt(c: int) -> list[list[Group]] | None:
        own, loose = [], []
        for i, x in enumerate(entries):
            groups, out = _outliers(x, c, penalty)
            if len(groups) > slots_of[i]:
                return None
            own.append(groups)
            loose.extend(out)
        mixed = form_groups(loose, c, cost)
        if sum(map(len, own)) + len(mixed) > total:
            return None
        free = [slots_of[i] - len(own[i]) for i in range(len(own))]
        count = len(own)
        for g in sorted(mixed, key=lambda g: (-len(g), g[0].sample.id)):
            weight: dict[int, int] = {}
            for e in g:
                weight[node_of(e)] = weight.get(node_of(e), 0) + sample_bytes(e.sample)
            home = max(
                (j for j in range(count) if free[j] > 0), key=lambda j: (weight.get(j, 0), free[j], -j)
            )
            own[home].append(g)
            free[home] -= 1
        return own

    fitting = [
        cost.item(e.sample.length) for x in entries for e in x if cost.item(e.sample.length) <= token_budget
    ]
    lo, hi, found = (math.ceil(max(fitting)) if fitting else token_budget), token_budget, None
    while lo <= hi:
        mid = (lo + hi) // 2
        planned = attempt(mid)
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


def _deal_levels(
    chosen: Sequence[Sequence[Group]], sizes: Sequence[int], target: int, group_cost: Callable[[Group], float]
) -> tuple[list[list[Group]], int] | None:
    """Deals every node's K_n x T groups (IDLE = []) into T rows of K_n so that each row's costliest group
    is at most the row's level l_s, the cost of the s-th row's first group in the global cost sort cut
    into rows of N; returns each node's groups in row order and the number of swaps, or None if the
    repair did not converge (never seen; bound 4 x N x T swaps).

    Each node's groups go to rows top-down by cost (its i-th costliest to row ceil(i / K_n)). A group
    above its row's level is a violation; the costliest one, at a row of level l, is repaired by the
    swap `_cheap_pair` finds (one of the node's groups costing > l for another node's group costing
    <= l in a row whose level covers the first; fewest samples moved), else by swapping it (cost c)
    with the cheapest group another node holds in the rows whose level is >= c. That group exists and
    is cheaper: the rows with level >= c hold every group costing >= c of the global sort, and the
    violating node fills its share of them with such groups, so another node holds a cheaper one
    there. Either way the partner node stays valid (only groups of rows whose level covers them shift,
    within those rows) and the violating node's sorted costs drop pointwise, its violation total
    strictly, so no state repeats and the repair ends."""
    world_size = sum(sizes)
    everything = sorted((group_cost(g) for groups in chosen for g in groups), reverse=True)
    levels = [everything[s * world_size] for s in range(target)]

    def key(g: Group) -> tuple[float, int]:
        return (-group_cost(g), g[0].sample.id if g else -1)

    held = [sorted(groups, key=key) for groups in chosen]
    costs = [[group_cost(g) for g in groups] for groups in held]
    count = len(held)

    def first_violation(i: int) -> int | None:
        kn = sizes[i]
        for p, c in enumerate(costs[i]):
            if c > levels[p // kn]:
                return p
        return None

    heap = []
    for i in range(count):
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
            rows = sum(1 for level in levels if level >= c)  # rows 0..rows-1 have level >= c
            best = None
            for m in range(count):
                if m == n:
                    continue
                q = sizes[m] * rows - 1
                d = costs[m][q]
                if d < c and (best is None or d < best[0]):
                    best = (d, m, q)
            if best is None:
                return None
            _, m, q = best
        else:
            p, m, q = pair
        g, h = held[n].pop(p), held[m].pop(q)
        costs[n].pop(p)
        costs[m].pop(q)
        for i, x in ((n, h), (m, g)):
            j = bisect.bisect_left([key(y) for y in held[i]], key(x))
            held[i].insert(j, x)
            costs[i].insert(j, group_cost(x))
        swaps += 1
        for i in (n, m):
            p = first_violation(i)
            if p is not None:
                heapq.heappush(heap, (-costs[i][p], i))
    return held, swaps


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
    a row whose level is >= y's cost. Returns (y's position, z's node, z's position) or None."""
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
            if best_row[r] is None or cand < best_row[r]:
                best_row[r] = cand
    prefix: list[tuple[int, int, int] | None] = []
    run = None
    for r in range(target):
        if best_row[r] is not None and (run is None or best_row[r] < run):
            run = best_row[r]
        prefix.append(run)
    best = None
    for p, c in enumerate(costs[n]):
        if c <= limit:
            break
        rows = sum(1 for level in levels if level >= c)
        z = prefix[rows - 1] if rows else None
        if z is not None:
            cand = (len(held[n][p]) + z[0], p, z[1], z[2])
            if best is None or cand < best:
                best = cand
    return None if best is None else best[1:]


def _place_on(row: Sequence[Group], ranks: Sequence[int]) -> list[Group]:
    """Assigns the groups of a node's row (len(row) == len(ranks); [] = IDLE) to its ranks, greedily by
    how many of each group's samples live on each rank; returns the group of each rank in `ranks` order."""
    slot = {r: j for j, r in enumerate(ranks)}
    pairs = []
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
    return out
