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
free in-process reference moves, moves across nodes cross the network). Steps 1 and its quotas are
unchanged: the same T and the same chosen samples as node-blind, so the progress bound above holds as
is. Then, with K_n ranks on node n (K_n x T slots):

2'. Group each node's chosen samples on their own (count-optimal at capacity c); pool its loose
    (incomplete) groups with every other node's and group the pool. c: the smallest capacity whose
    groups number <= N x T (binary search as in step 2; no refinement: c = L). Pool only as many loose
    groups as the slots need, those carrying the fewest bytes first. If even all loose groups pooled at
    c = L do not fit ("widened"), whole groups are pooled too (least filled first) at node-blind's
    refined capacity, which always fits for padded cost; if nothing fits the round is planned
    node-blind (`stats`: node_aware, node_widened, node_fallback).
3'. Fill: split the costliest groups (wherever they are) until N x T groups or only singletons.
4'. Balance: every node keeps its groups up to its K_n x T slots; over-full nodes hand the excess,
    the groups with the fewest of their bytes (`sample_bytes`), to under-full nodes (the one holding
    most of the group's bytes first); a pooled group lives where most of its bytes do.
5'. Deal: each node sorts its groups by cost and cuts them into T rows of K_n (IDLE last); row j of
    every node forms step perm[j], perm one seeded shuffle shared by all nodes, so a step costs about
    the same on every node. Place inside a node by home-rank affinity (`_place_on`).
Invariants as node-blind: each chosen sample exactly once, exactly T steps per rank, no group over the
budget but over-budget singletons, deterministic for a seeded rng. `plan_moves` counts intra-node and
cross-node moves of any plan. Measured: docs/benchmarks.md (Node-aware balancing).

Cost: O(P log P) for P pooled samples plus O(log L) regroupings of the chosen ones (node-aware: plus
O(log G) regroupings of the pooled groups).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence

from ._cost import CostModel
from ._grouping import best_fit_decreasing, contiguous_greedy, split_largest
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
        stats: When given, counts node-aware rounds: `node_aware` (planned per node) and
            `node_fallback` (per-node grouping did not fit, the round was planned node-blind).

    Returns:
        plan[rank][step] -> the samples of that rank's group (empty tuple = IDLE); T steps per rank.

    Raises:
        ValueError: `nodes` does not hold one int >= 0 per rank.
    """
    if nodes is not None:
        nodes = check_nodes(nodes, world_size)
    if not pool or capacity < 1:
        return [[] for _ in range(world_size)]
    groups = rank_groups(form_groups(pool, token_budget, cost), token_budget, cost, now, max_wait, rng, final)
    k = len(groups)
    if final:
        target = min(-(-k // world_size), capacity)
    else:
        target = max(min(k // world_size, capacity), 1)
    slots = world_size * target
    chosen_groups = _choose(groups, slots, target, world_size)
    if nodes is not None:
        planned = _plan_nodes(chosen_groups, nodes, target, token_budget, cost, rng, refine)
        if stats is not None:
            keys = ["node_fallback"] if planned is None else ["node_aware"] + ["node_widened"] * planned[1]
            for key in keys:
                stats[key] = stats.get(key, 0) + 1
        if planned is not None:
            return planned[0]
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


def plan_moves(plan: Sequence[Sequence[Sequence[Sample]]], nodes: Sequence[int] | None = None) -> dict[str, int]:
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
    return {"intra_node_samples": intra, "intra_node_bytes": intra_bytes,
            "cross_node_samples": cross, "cross_node_bytes": cross_bytes}


def _group_sorted(ordered: Sequence[Entry], keys: Sequence[float], capacity: int, cost: CostModel) -> list[Group]:
    """`form_groups` of entries already sorted longest first (`keys`: their lengths, or item costs for an
    additive model), without sorting them again."""
    if cost.additive:
        idx = best_fit_decreasing(keys, capacity)
    else:
        idx = contiguous_greedy(keys, capacity)
    return [[ordered[i] for i in g] for g in idx]


def _plan_nodes(
    chosen_groups: Sequence[Group],
    nodes: Sequence[int],
    target: int,
    token_budget: int,
    cost: CostModel,
    rng: random.Random,
    refine: bool,
) -> tuple[list[list[tuple[Sample, ...]]], bool] | None:
    """The node-aware plan of the chosen samples (module docstring, "Node-aware") and whether it had to
    pool whole groups ("widened"), or None when no pooling fits N x T groups (the caller then plans
    node-blind; `rng` is untouched in that case)."""
    world_size = len(nodes)
    ids = sorted(set(nodes))
    position = {n: i for i, n in enumerate(ids)}
    where = [position[n] for n in nodes]  # rank -> node position
    count = len(ids)
    members: list[list[int]] = [[] for _ in ids]
    for r, i in enumerate(where):
        members[i].append(r)
    slots_of = [len(m) * target for m in members]
    slots = world_size * target
    entries = [e for g in chosen_groups for e in g]
    local: list[list[Entry]] = [[] for _ in ids]
    homeless: list[Entry] = []  # home rank outside [0, N): no node of its own, always pooled
    for e in entries:
        h = e.sample.home_rank
        (local[where[h]] if h < world_size else homeless).append(e)
    local = [sorted(x, key=_ORDER) for x in local]
    keyed = [(x, [cost.item(e.sample.length) for e in x] if cost.additive else [e.sample.length for e in x])
             for x in local]

    def node_of(e: Entry) -> int:
        h = e.sample.home_rank
        return where[h] if h < world_size else -1

    def bytes_at(group: Group, i: int) -> int:
        return sum(sample_bytes(e.sample) for e in group if node_of(e) == i)

    def split(c: int) -> tuple[list[tuple[int, Group]], list[tuple[int, Group]]]:
        """Each node's groups under capacity c: (complete ones, loose ones), tagged with the node."""
        complete, loose = [], []
        for i, (ordered, keys) in enumerate(keyed):
            for g in _group_sorted(ordered, keys, c, cost):
                (complete if cost.complete(group_lengths(g), c) else loose).append((i, g))
        return complete, loose

    def needed(c: int) -> int:
        """Groups needed under capacity c when every node's loose groups are pooled and regrouped."""
        complete, loose = split(c)
        return len(complete) + len(form_groups([e for _, g in loose for e in g] + homeless, c, cost))

    def smallest(fits: Callable[[int], bool]) -> int | None:
        """The smallest capacity in [longest fitting item, L] that `fits` (binary search, as `_refine`)."""
        fitting = [cost.item(e.sample.length) for e in entries if cost.item(e.sample.length) <= token_budget]
        lo, hi, found = (math.ceil(max(fitting)) if fitting else token_budget), token_budget, None
        while lo <= hi:
            mid = (lo + hi) // 2
            if fits(mid):
                found, hi = mid, mid - 1
            else:
                lo = mid + 1
        return found

    if refine:
        capacity = smallest(lambda c: needed(c) <= slots)
    else:
        capacity = token_budget if needed(token_budget) <= slots else None
    widened = capacity is None
    if widened:  # pooling the loose groups is not enough: pool whole groups too, at node-blind's capacity
        capacity = smallest(lambda c: len(form_groups(entries, c, cost)) <= slots) if refine else None
        capacity = token_budget if capacity is None else capacity

    # Pool only as many groups as the slots require: loose ones first (then, widened, complete ones),
    # those carrying the fewest bytes first; every other group stays whole on its node.
    complete, loose = split(capacity)

    def by_bytes(t: tuple[int, Group]) -> tuple[int, int, int]:
        return (sum(sample_bytes(e.sample) for e in t[1]), t[0], t[1][0].sample.id)

    def by_fill(t: tuple[int, Group]) -> tuple[float, int, int, int]:
        lengths = group_lengths(t[1])
        return (sum(lengths) / capacity, *by_bytes(t))

    loose.sort(key=by_bytes)
    stay = [] if widened else complete
    candidates = loose + (sorted(complete, key=by_fill) if widened else [])

    def pooled(m: int) -> list[Group]:
        return form_groups([e for _, g in candidates[:m] for e in g] + homeless, capacity, cost)

    def total(m: int) -> int:
        return len(stay) + len(candidates) - m + len(pooled(m))

    lo, hi, best = 0, len(candidates), None
    while lo <= hi:
        mid = (lo + hi) // 2
        if total(mid) <= slots:
            best, hi = mid, mid - 1
        else:
            lo = mid + 1
    if best is None:
        return None
    owned: list[list[Group]] = [[] for _ in ids]
    for i, g in stay + candidates[best:]:
        owned[i].append(g)
    for g in pooled(best):  # a pooled group lives where most of its bytes do
        owned[max(range(count), key=lambda j: (bytes_at(g, j), slots_of[j] - len(owned[j]), -j))].append(g)

    # Fill idle slots by splitting the costliest groups, wherever they are (as node-blind does); the
    # halves stay on their group's node until the balancing below.
    def group_cost(g: Group) -> float:
        return cost.cost(group_lengths(g))

    tagged = [(i, g) for i in range(count) for g in owned[i]]
    if len(tagged) < slots:
        owned = [[] for _ in ids]
        for i, g in _split_costliest(tagged, slots, group_cost):
            owned[i].append(g)

    # Over-full nodes hand their excess to under-full ones: the groups with the fewest of their bytes.
    excess: list[tuple[int, int, Group]] = []
    for i in range(count):
        extra = len(owned[i]) - slots_of[i]
        if extra > 0:
            ranked = sorted(owned[i], key=lambda g, i=i: (bytes_at(g, i), g[0].sample.id))
            excess.extend((bytes_at(g, i), i, g) for g in ranked[:extra])
            owned[i] = ranked[extra:]
    excess.sort(key=lambda t: (t[0], t[1], t[2][0].sample.id))
    for _, _, g in excess:
        dest = max((j for j in range(count) if len(owned[j]) < slots_of[j]),
                   key=lambda j: (bytes_at(g, j), slots_of[j] - len(owned[j]), -j))
        owned[dest].append(g)

    # Deal: each node's groups by cost into rows of K_n; row s of every node makes step perm[s].
    perm = list(range(target))
    rng.shuffle(perm)
    plan: list[list[tuple[Sample, ...]]] = [[()] * target for _ in range(world_size)]
    for i in range(count):
        k = len(members[i])
        ordered = sorted(owned[i], key=lambda g: (-group_cost(g), g[0].sample.id))
        ordered += [[] for _ in range(slots_of[i] - len(ordered))]
        for step, row in enumerate(perm):
            chunk = ordered[row * k : (row + 1) * k]
            for rank, group in zip(members[i], _place_on(chunk, members[i])):
                plan[rank][step] = tuple(e.sample for e in group)
    return plan, widened


def _split_costliest(tagged: Sequence[tuple[int, Group]], slots: int,
                     cost_of: Callable[[Group], float]) -> list[tuple[int, Group]]:
    """Splits the costliest multi-sample group in halves (longest-first order kept, each half tagged
    like its group) until there are `slots` groups or only singletons; O(splits x log groups)."""
    items: list[tuple[int, Group] | None] = list(tagged)
    heap = [(-cost_of(g), j) for j, (_, g) in enumerate(tagged) if len(g) > 1]
    heapq.heapify(heap)
    alive = len(items)
    while alive < slots and heap:
        _, j = heapq.heappop(heap)
        i, g = items[j]
        items[j] = None
        half = len(g) // 2
        for part in (g[:half], g[half:]):
            items.append((i, part))
            if len(part) > 1:
                heapq.heappush(heap, (-cost_of(part), len(items) - 1))
        alive += 1
    return [t for t in items if t is not None]


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
