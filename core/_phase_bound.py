"""A tighter lower bound on an encoder phase's peak: `vision_bound` plus a counting argument on big items.

`vision_bound` (max(C / N, c_1, and of the kN + 1 costliest items some rank encodes k + 1)) misses steps
whose items are nearly all big and nearly equal: with 123 images of cost ~5,900 and 35 smaller ones
(1,500-4,600) on 64 ranks, 59 ranks must encode two big images each, leaving ~600 of room under C / N,
so the smaller images cannot fit beside them; the plan's peak sits ~12% above `vision_bound`, and that is
the bound's slack, not the plan's (a placement below ~13,300 is impossible, see below). `encoder_bound`
proves such caps infeasible and returns the largest cap it refuted.

Refuting a cap T (`_refutes`). For k >= 1, let H be the j costliest items, all costlier than T / (k + 1), so a
rank of load <= T encodes at most k of them; with j > (k - 1)N at least p = j - (k - 1)N ranks encode
exactly k. Such a rank's room for other items is at most T minus the k cheapest items of H, so every item
outside H costlier than that room (the set M) goes to one of the other N - p ranks. Those ranks hold the
remaining j - kp items of H, at least the cheapest j - kp of them; if M's total exceeds
(N - p) T minus those, no placement meets T. More ranks with k items of H only shrink the room left for M
when any k items of H fit one rank (each further such rank takes T of room and frees at most T), which is
checked; otherwise the k is skipped. Every j and k is tried; T < C / N is refuted by the total alone.

`encoder_bound` bisects between `vision_bound` and an LPT placement's peak (`BISECT` steps), keeping the
largest refuted cap: each refuted cap is a proof on its own, so the result is a valid lower bound whatever
the shape of the refuted set. O(BISECT x (m / N) x m log m) for m items: a measuring tool (the benchmarks'
"bound" columns), not the planner's floor.

Pure and deterministic.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Sequence

from ._phases import vision_bound
from ._types import check_int

BISECT = 30  # bisection steps between vision_bound and the LPT peak


def _lpt_peak(costs: Sequence[float], n: int) -> float:
    loads = [0.0] * n
    heapq.heapify(loads)
    for c in costs:  # costliest first
        heapq.heappush(loads, heapq.heappop(loads) + c)
    return max(loads)


class _Sorted:
    """Items costliest first, with what every refutation reads: prefix sums, and negated costs (ascending,
    for bisect). Built once per bound, not once per bisection step."""

    def __init__(self, costs: Sequence[float]) -> None:
        self.c = costs
        self.prefix = [0.0, *itertools.accumulate(costs)]
        self.desc = [-x for x in costs]


def _refutes(items: _Sorted, n: int, cap: float) -> bool:
    """True when no placement of the items on n ranks has every rank's load <= `cap` (module docstring:
    the total, then the counting argument for every k and j)."""
    m, prefix, desc = len(items.c), items.prefix, items.desc
    tol = 1e-12 * max(cap, 1.0)
    if prefix[-1] > n * cap + tol * n:
        return True
    k = 1
    while (k - 1) * n < m:
        lim = cap / (k + 1)
        big = bisect.bisect_left(desc, -lim)  # items costlier than lim: c[:big]
        if prefix[k] > cap + tol:  # the k costliest do not fit one rank: the fewest p is no best case
            k += 1
            continue
        for j in range(max(k, (k - 1) * n + 1), big + 1):
            p = j - (k - 1) * n
            room_k = cap - (prefix[j] - prefix[j - k])  # room beside the k cheapest items of H
            end = bisect.bisect_left(desc, -room_k, lo=j)  # M = c[j:end], each costlier than room_k
            mass = prefix[end] - prefix[j]
            rest = j - k * p
            room = (n - p) * cap - (prefix[j] - prefix[j - rest])
            if mass > room + tol * n:
                return True
        k += 1
    return False


def encoder_bound(costs: Sequence[float], n: int) -> float:
    """A lower bound on the max rank load of any placement of items of these costs on n ranks, at least
    `vision_bound` (module docstring). 0 without items."""
    check_int("n", n, lo=1)
    c = sorted(costs, reverse=True)
    if not c:
        return 0.0
    lo, hi = vision_bound(c, n), _lpt_peak(c, n)
    items = _Sorted(c)
    for _ in range(BISECT):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        if _refutes(items, n, mid):
            lo = mid
        else:
            hi = mid
    return lo
