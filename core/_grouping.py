"""Group formation over a window of realized lengths: pure functions on lists of ints.

All functions take lengths sorted longest first and return groups as lists of indices into that list.

- `contiguous_greedy` (padded cost): walk longest first, each group takes floor(L / longest) samples.
  On a sorted window this is count-optimal (an exchange argument: a group that starts later starts
  shorter and can only hold more), and groups hold near-equal lengths, so padding is low.
- `odb_greedy`: the published ODB 0.1.2 rule, kept faithful as the reference baseline: the longest
  sample stands alone, and each later group holds floor(L / L_prev) samples where L_prev is the shortest
  length of the previous group. It is conservative (never over token_budget) but forms more groups than
  `contiguous_greedy` where groups are small (the long tail): a group sized by the previous group's
  shortest sample may hold fewer samples than its own longest allows. Counts: docs/benchmarks.md.
- `best_fit_decreasing` (additive costs): each sample goes to the open group with the least room that
  still fits it (11/9 OPT + 6/9 bins worst case), O(n log n) with bisect.
- `fixed_chunks`: the fixed-batch-size baselines.
- `split_largest` / `odb_split`: turn k groups into more when alignment needs more steps.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

Groups = list[list[int]]


def contiguous_greedy(lengths: Sequence[int], token_budget: int) -> Groups:
    """Count-optimal padded grouping of a longest-first window; a sample over token_budget stands alone."""
    groups: Groups = []
    i, n = 0, len(lengths)
    while i < n:
        k = max(token_budget // lengths[i], 1)
        groups.append(list(range(i, min(i + k, n))))
        i += k
    return groups


def odb_greedy(costs: Sequence[float], token_budget: float) -> Groups:
    """ODB 0.1.2's `_group_by_length`, walked longest first (see module docstring).

    `costs` are the samples' lone costs, longest first: their lengths for padded cost, exactly as
    ODB does; for additive cost models k x cost(L_prev) bounds the group's cost the same way.
    """
    groups: Groups = []
    batch: list[int] = []
    size = 0
    for i, c in enumerate(costs):
        batch.append(i)
        if len(batch) >= size:
            size = max(int(token_budget // c), 1)
            groups.append(batch)
            batch = []
    if batch:
        groups.append(batch)
    return groups


def best_fit_decreasing(costs: Sequence[float], token_budget: float) -> Groups:
    """Best-fit decreasing bin packing of costs sorted largest first; over-budget items stand alone."""
    groups: Groups = []
    room: list[tuple[float, int]] = []  # (remaining room, group index), sorted
    for i, c in enumerate(costs):
        if c > token_budget:
            groups.append([i])
            continue
        j = bisect.bisect_left(room, (c, -1))
        if j < len(room):
            rem, g = room.pop(j)
            groups[g].append(i)
            rem -= c
        else:
            g = len(groups)
            groups.append([i])
            rem = token_budget - c
        if rem > 0:
            bisect.insort(room, (rem, g))
    return groups


def fixed_chunks(n: int, batch_size: int) -> Groups:
    """Consecutive chunks of `batch_size` (the last one may be short)."""
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


def split_largest(groups: Groups, target: int, key: Callable[[list[int]], float]) -> Groups:
    """Splits the group with the largest `key` in two halves until there are `target` groups.

    Stops early when every group is a singleton. Halves keep index order, so a longest-first group
    splits into a long half and a short half (both costing at most the original).
    """
    out = [list(g) for g in groups]
    while len(out) < target:
        best = max((j for j, g in enumerate(out) if len(g) > 1), key=lambda j: key(out[j]), default=None)
        if best is None:
            break
        g = out[best]
        half = len(g) // 2
        out[best : best + 1] = [g[:half], g[half:]]
    return out


def odb_split(groups: Groups, target: int) -> Groups:
    """ODB 0.1.2's split: take the last group with >= 2 samples, move its longest sample into a new
    singleton group right after it; repeat until `target` groups or only singletons remain."""
    out = [list(g) for g in groups]
    while len(out) < target:
        j = next((j for j in range(len(out) - 1, -1, -1) if len(out[j]) > 1), None)
        if j is None:
            break
        longest = min(out[j])  # indices are longest first
        out[j].remove(longest)
        out.insert(j + 1, [longest])
    return out
