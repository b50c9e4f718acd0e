"""The exact optimum of one step's encoder placement, as a MILP solved by HiGHS (scipy), for small steps.

Minimum makespan on identical machines (P||Cmax): items i of cost c_i (images, audio clips) go to ranks
r = 0..N-1; x_ir = 1 when rank r encodes item i; minimize T subject to sum_r x_ir = 1 for every item and
sum_i c_i x_ir <= T for every rank. With owners, a second MILP keeps T at that optimum and
minimizes the items encoded off their owners (lexicographic: peak first, then moves). Costs are scaled to
a largest of 1 (HiGHS's presolve returned suboptimal peaks as optimal with costs in the thousands) and
the relative MIP gap is 0.

This is the yardstick of the heuristics (`plan_vision`: greedy, then local search), measured in
benchmarks/phase_balance.py on real steps; a caller may use it on steps small enough to prove (3 ranks
x 8 images: ~0.05 s; 8 ranks x ~40 images: often not within 5 s, when `optimal` is False and the
placement is the best found). scipy is an optional dependency (`pip install batchd[exact]`), imported on
first use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ._types import check_int, check_number


@dataclasses.dataclass(frozen=True, slots=True)
class ExactPlacement:
    """An optimal placement: `where[i]` = the rank encoding item i, `peak` its max rank load, `optimal`
    whether HiGHS proved it optimal (False: the best found when the time limit hit)."""

    where: tuple[int, ...]
    peak: float
    optimal: bool
    seconds: float


def exact_placement(
    costs: Sequence[float],
    n: int,
    owners: Sequence[int] | None = None,
    time_limit_s: float = 10.0,
    node_limit: int | None = None,
) -> ExactPlacement | None:
    """The least-peak placement of items of `costs` on `n` ranks (module docstring).

    Args:
        costs: Each item's encoder cost (> 0).
        n: Ranks.
        owners: Each item's owner rank; with it, a second solve keeps the least peak and moves the fewest
            items off their owners.
        time_limit_s: HiGHS's time limit, per solve.
        node_limit: At most this many branch-and-bound nodes per solve (None: no limit). Unlike the time
            limit it makes the result independent of the machine's speed (a plan's input).

    Returns:
        The placement, or None when the solver found no feasible one in time.
    """
    import time

    check_int("n", n, lo=1)
    check_number("time_limit_s", time_limit_s, gt=0.0)
    if node_limit is not None:
        check_int("node_limit", node_limit, lo=1)
    m = len(costs)
    if any(c <= 0 for c in costs):
        raise ValueError(f"costs must be > 0, got min(costs)={min(costs)!r}")
    if owners is not None and len(owners) != m:
        raise ValueError(f"owners must hold one rank per item ({m=}), got {len(owners)=}")
    if m == 0:
        return ExactPlacement((), 0.0, True, 0.0)
    scale = max(costs)  # HiGHS works on costs scaled to <= 1: its presolve returned suboptimal peaks,
    unit = [c / scale for c in costs]  # "optimal", with costs in the thousands
    t0 = time.perf_counter()
    limits = {"time_limit": time_limit_s} | ({} if node_limit is None else {"node_limit": node_limit})
    first = _solve(unit, n, None, None, limits)
    if first is None:
        return None
    where, optimal = first
    if owners is not None:
        peak = max(_loads(where, unit, n))
        second = _solve(unit, n, owners, peak * (1 + 1e-7), limits)
        if second is not None:
            where, optimal = second[0], optimal and second[1]
    return ExactPlacement(where, max(_loads(where, costs, n)), optimal, time.perf_counter() - t0)


def _loads(where: Sequence[int], costs: Sequence[float], n: int) -> list[float]:
    load = [0.0] * n
    for r, c in zip(where, costs, strict=True):
        load[r] += c
    return load


def _solve(
    unit: Sequence[float], n: int, owners: Sequence[int] | None, cap: float | None, limits: dict[str, float]
) -> tuple[tuple[int, ...], bool] | None:
    """One MILP: without `owners`, minimize the peak T; with them, minimize the items moved off their
    owners subject to every rank's load <= `cap`. (placement, proved optimal) or None."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    m = len(unit)
    nv = m * n + 1  # x_ir at i * n + r, then T
    obj = np.zeros(nv)
    if owners is None:
        obj[-1] = 1.0
    else:
        for i, o in enumerate(owners):
            obj[i * n : (i + 1) * n] = 1.0
            obj[i * n + o] = 0.0
    a = lil_matrix((m + n, nv))
    for i in range(m):
        a[i, i * n : (i + 1) * n] = 1.0
    for r in range(n):
        for i, c in enumerate(unit):
            a[m + r, i * n + r] = c
        a[m + r, nv - 1] = -1.0
    lo = np.concatenate([np.ones(m), np.full(n, -np.inf)])
    hi = np.concatenate([np.ones(m), np.zeros(n)])
    integrality = np.ones(nv)
    integrality[-1] = 0
    ub = np.ones(nv)
    ub[-1] = np.inf if cap is None else cap
    res = milp(
        obj,
        constraints=LinearConstraint(a.tocsr(), lo, hi),
        integrality=integrality,
        bounds=Bounds(np.zeros(nv), ub),
        options={**limits, "disp": False, "mip_rel_gap": 0.0},
    )
    if res.x is None:
        return None
    x = res.x[:-1].reshape(m, n)
    return tuple(int(np.argmax(x[i])) for i in range(m)), bool(res.status == 0)
