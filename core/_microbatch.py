"""Pipeline microbatches of balanced cost: one rank's step split into M parts that cost alike.

A pipeline-parallel schedule (GPipe, 1F1B, interleaved) runs a step as M microbatches through every
stage; the step takes as long as its slowest microbatch times the pipeline depth, so microbatches
of unequal cost leave every stage idle on the cheap ones (WLB-LLM's imbalance across microbatches).
Chunking a step's samples into M runs of equal *count*, as schedules do by default, is blind to their
lengths; `balanced_split` partitions them by *cost* instead.

`balanced_split(costs, m)`: longest-processing-time first (each sample, costliest first, to the
cheapest part so far), then local search: while moving one sample, or swapping two, between the
costliest and the cheapest part lowers the costlier of the two, do the best such change. Contract:

* the parts are a partition of range(len(costs)): every index exactly once, each part ascending;
* exactly `m` parts (some empty when there are fewer than `m` samples);
* the costliest part costs at most (4/3 - 1/(3m)) x the optimum (LPT's bound; the search only
  lowers it), and the costliest and the cheapest part differ by at most the costliest sample of the
  costliest part (otherwise a move would still help);
* deterministic: ties go to the lowest index.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._types import check_int


def balanced_split(costs: Sequence[float], m: int) -> list[list[int]]:
    """Partitions sample indices into `m` parts of near-equal total cost (see module docstring)."""
    check_int("m", m, lo=1)
    if any(not c >= 0 for c in costs):
        raise ValueError(f"costs must be >= 0, got {list(costs)=}")
    parts: list[list[int]] = [[] for _ in range(m)]
    loads = [0.0] * m
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        j = min(range(m), key=lambda j: (loads[j], j))
        parts[j].append(i)
        loads[j] += costs[i]
    for _ in range(4 * len(costs) * m + 1):  # each change lowers sum(load^2): it ends; the cap only bounds it
        hi = max(range(m), key=lambda j: (loads[j], -j))
        lo = min(range(m), key=lambda j: (loads[j], j))
        gap = loads[hi] - loads[lo]
        if gap <= 0:
            break
        best: tuple[float, int, int | None] | None = None  # (distance of the shift from gap/2, i, k)
        for i in parts[hi]:
            if 0 < costs[i] < gap:
                score = abs(gap / 2 - costs[i])
                if best is None or score < best[0]:
                    best = (score, i, None)
            for k in parts[lo]:
                d = costs[i] - costs[k]
                if 0 < d < gap:
                    score = abs(gap / 2 - d)
                    if best is None or score < best[0]:
                        best = (score, i, k)
        if best is None:
            break
        _, move, swap = best
        parts[hi].remove(move)
        parts[lo].append(move)
        loads[hi] -= costs[move]
        loads[lo] += costs[move]
        if swap is not None:
            parts[lo].remove(swap)
            parts[hi].append(swap)
            loads[lo] -= costs[swap]
            loads[hi] += costs[swap]
    return [sorted(p) for p in parts]


def chunk_split(n: int, m: int) -> list[list[int]]:
    """The count-based split a pipeline schedule does by default: `m` consecutive runs of near-equal
    sample count (the first n % m one longer); the baseline `balanced_split` is measured against."""
    check_int("n", n, lo=0)
    check_int("m", m, lo=1)
    size, extra = divmod(n, m)
    out, start = [], 0
    for j in range(m):
        stop = start + size + (j < extra)
        out.append(list(range(start, stop)))
        start = stop
    return out
