"""A second start for an encoder placement: the largest differencing method (Karmarkar-Karp, multiway).

The vision planner's greedies (`batchd.core._phases`) pack items under a bisected cap, first fit; their
local search (`_phase_search.improve`) moves and swaps single items. On steps of many nearly equal big
items (documents, screenshots) both stop 1-3% above the lower bound where a different packing gets
closer. LDM (Karmarkar and Karp 1982; Michiels et al. for N-way) starts from one partial partition per
item and repeatedly merges the two partitions of largest spread (max - min rank load), pairing the
heaviest bins of one with the lightest of the other, so large differences cancel early. `ldm_place`
then gives each bin the rank owning most of its items (kept items cross no link), and the planner runs
the same local search on it and keeps it only where its peak is lower by `LDM_GAIN` (`plan_vision`).

Cost: O(m N log N) for m items on N ranks (a merge touches all N bins), so the planner tries it only
when m x N <= `LDM_MAX_WORK` (64 ranks with up to ~600 items per step; never at 512 ranks).

Pure and deterministic: ties go to the lower item, bin and rank index.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

LDM_MAX_WORK = 40_000  # items x ranks of a step beyond which the planner does not try LDM
# The planner takes the LDM placement only where it lowers the peak by this fraction: its bins mix items of
# every node, so it moves more embeddings across nodes (at 0: document-like, 64 ranks, 7x the cross-node
# images of the greedy plan for 0.25% of peak; at 0.005: 1.6x, docs/benchmarks.md, two-phase balancing).
LDM_GAIN = 0.005


def _bins(costs: Sequence[float], n: int) -> list[list[int]]:
    """The items of each of the n bins of the LDM partition (bins in no particular order)."""
    m = len(costs)
    left: list[int] = []  # node m + k joins nodes left[k] and right[k]; nodes < m are items
    right: list[int] = []
    heap: list[tuple[float, int, list[tuple[float, int]]]] = []
    for i, c in enumerate(costs):
        heap.append((-c, i, [(c, i)]))  # (-(spread), tie-break, nonzero bins: (load, node), heaviest first)
    heapq.heapify(heap)
    tick = m
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = a + [(0.0, -1)] * (n - len(a))
        b = b + [(0.0, -1)] * (n - len(b))
        merged = []
        for k in range(n):  # heaviest of a with lightest of b
            (la, na), (lb, nb) = a[k], b[n - 1 - k]
            if na < 0 or nb < 0:
                node = max(na, nb)
            else:
                left.append(na)
                right.append(nb)
                node = m + len(left) - 1
            if node >= 0:
                merged.append((la + lb, node))
        merged.sort(key=lambda x: (-x[0], x[1]))
        spread = merged[0][0] - (merged[-1][0] if len(merged) == n else 0.0)
        heapq.heappush(heap, (-spread, tick, merged))
        tick += 1
    out: list[list[int]] = []
    for _, root in heap[0][2] if heap else []:
        items, stack = [], [root]
        while stack:
            node = stack.pop()
            if node < m:
                items.append(node)
            else:
                stack += (left[node - m], right[node - m])
        out.append(sorted(items))
    return out


def ldm_place(costs: Sequence[float], owners: Sequence[int], n: int) -> list[int]:
    """where[i]: the rank of item i in the LDM partition of `costs` on n ranks, each bin given to the rank
    owning most of its items (greedily, most kept items first; bins left over take the ranks left over in
    order)."""
    bins = _bins(costs, n)
    pairs = []
    for b, items in enumerate(bins):
        counts: dict[int, int] = {}
        for i in items:
            counts[owners[i]] = counts.get(owners[i], 0) + 1
        pairs += [(-c, b, r) for r, c in counts.items()]
    pairs.sort()
    rank_of: dict[int, int] = {}
    taken: set[int] = set()
    for _, b, r in pairs:
        if b not in rank_of and r not in taken:
            rank_of[b] = r
            taken.add(r)
    free = iter(r for r in range(n) if r not in taken)
    where = [0] * len(costs)
    for b, items in enumerate(bins):
        r = rank_of[b] if b in rank_of else next(free)
        for i in items:
            where[i] = r
    return where
