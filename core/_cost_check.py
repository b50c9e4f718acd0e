"""How well a job's cost model predicted its measured steps (the trainers' self-check, no I/O).

The planner balances each step's *planned* cost across ranks (`StepInfo.cost`, under the job's cost
model); what the ranks then spend is their *measured* compute time. When the cost model is right, the
measured imbalance across ranks follows the planned one and the time is a straight line in the cost;
when it is wrong, the plan balances the wrong thing: the measured imbalance is larger than planned and
the line fits badly. `cost_check` reports both, so a user sees which (then: `batchd calibrate`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["cost_check"]


def cost_check(
    costs: Sequence[Sequence[float]], seconds: Sequence[Sequence[float]]
) -> dict[str, float | int | None]:
    """`costs[step][rank]` planned, `seconds[step][rank]` measured (each rank's own compute, no waits).

    Returns:
        steps: the steps compared (those where every rank has a positive planned cost and time; an IDLE
            rank's zero-weight step would count as imbalance the plan chose);
        planned_imbalance / measured_imbalance: the mean over those steps of max / mean across ranks;
        r2: the R^2 of the least-squares line seconds = intercept_s + slope_s x cost over every (step, rank)
            of them (None with fewer than 3 points or no spread in cost; 1.0 when every time is equal);
        slope_s, intercept_s: that line.

    Raises:
        ValueError: `costs` and `seconds` of different shapes, or a negative or non-finite value.
    """
    if len(costs) != len(seconds):
        raise ValueError(f"costs and seconds must hold the same steps, got {len(costs)=} {len(seconds)=}")
    world = len(costs[0]) if costs else 1
    rows = []
    for step, (c, s) in enumerate(zip(costs, seconds, strict=True)):
        if len(c) != world or len(s) != world:
            raise ValueError(
                f"step {step}: one cost and one time per rank ({world=}), got {len(c)=} {len(s)=}"
            )
        for v in (*c, *s):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"step {step}: costs and times must be finite and >= 0, got {v=}")
        if c and min(c) > 0 and min(s) > 0:
            rows.append((c, s))
    out: dict[str, float | int | None] = {"steps": len(rows)}
    out.update(dict.fromkeys(("planned_imbalance", "measured_imbalance", "r2", "slope_s", "intercept_s")))
    if not rows:
        return out
    out["planned_imbalance"] = sum(max(c) * world / sum(c) for c, _ in rows) / len(rows)
    out["measured_imbalance"] = sum(max(s) * world / sum(s) for _, s in rows) / len(rows)
    xs = [x for c, _ in rows for x in c]
    ys = [y for _, s in rows for y in s]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    vxx = sum((x - mx) ** 2 for x in xs)
    if n < 3 or vxx <= 1e-12 * sum(x * x for x in xs):
        return out
    vxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    vyy = sum((y - my) ** 2 for y in ys)
    slope = vxy / vxx
    r2 = vxy * vxy / (vxx * vyy) if vyy > 0 else 1.0
    out.update({"r2": r2, "slope_s": slope, "intercept_s": my - slope * mx})
    return out
