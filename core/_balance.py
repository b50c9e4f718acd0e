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

Cost: O(P log P) for P pooled samples plus O(log L) regroupings of the chosen ones.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from ._cost import CostModel
from ._grouping import split_largest
from ._policy import Entry, Group, form_groups, group_lengths, rank_groups
from ._types import Sample


def _refine(chosen: list[Entry], slots: int, token_budget: int, cost: CostModel) -> list[Group] | None:
    """Groups `chosen` under the smallest capacity that still needs <= `slots` groups."""
    fitting = [cost.item(e.sample.length) for e in chosen if cost.item(e.sample.length) <= token_budget]
    lo = int(math.ceil(max(fitting))) if fitting else token_budget
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

    Returns:
        plan[rank][step] -> the samples of that rank's group (empty tuple = IDLE); T steps per rank.
    """
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
