"""How well a job's cost model predicted its measured steps (the trainers' self-check, no I/O).

The planner balances each step's *planned* cost across ranks (`StepInfo.cost`, under the job's cost
model); what the ranks then spend is their *measured* compute time. When the cost model is right, the
measured imbalance across ranks follows the planned one and the time is a straight line in the cost;
when it is wrong, the plan balances the wrong thing: the measured imbalance is larger than planned and
the line fits badly. `cost_check` reports both, so a user sees which (then: `batchd calibrate`).

The figures are made from sums that ranks can all-reduce (`CheckSums`: per step the max and the sum
across ranks, and six moments), so a trainer never gathers every rank's steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["CheckSums", "cost_check"]

MOMENTS = ("n", "x", "y", "xy", "xx", "yy")


@dataclasses.dataclass
class CheckSums:
    """The all-reducible part of a cost check over `world` ranks: per step, whether every rank had a
    positive cost and time (`counted`: a MIN across ranks), the max and sum of the costs and of the times
    across ranks, and over the counted (step, rank) pairs the moments n, sum x, sum y, sum xy, sum x^2,
    sum y^2 (x: cost, y: seconds; SUM across ranks)."""

    world: int
    counted: list[int]
    cost_max: list[float]
    cost_sum: list[float]
    time_max: list[float]
    time_sum: list[float]
    moments: list[float]

    @staticmethod
    def local(
        costs: Sequence[float], seconds: Sequence[float], counted: Sequence[int], world: int
    ) -> CheckSums:
        """One rank's part: its own per-step values as max and sum, its moments over the steps `counted`
        (the all-reduced MIN of `own_counted`)."""
        m = [0.0] * len(MOMENTS)
        for c, s, keep in zip(costs, seconds, counted, strict=True):
            if keep:
                for k, v in enumerate((1.0, c, s, c * s, c * c, s * s)):
                    m[k] += v
        return CheckSums(world, list(counted), list(costs), list(costs), list(seconds), list(seconds), m)

    def result(self) -> dict[str, float | int | None]:
        """The check (`cost_check`'s keys) from the all-reduced sums."""
        steps = [i for i, keep in enumerate(self.counted) if keep]
        out: dict[str, float | int | None] = dict.fromkeys(
            ("planned_imbalance", "measured_imbalance", "r2", "slope_s", "intercept_s")
        )
        out = {"steps": len(steps), **out}
        if not steps:
            return out
        w = self.world
        out["planned_imbalance"] = sum(self.cost_max[i] * w / self.cost_sum[i] for i in steps) / len(steps)
        out["measured_imbalance"] = sum(self.time_max[i] * w / self.time_sum[i] for i in steps) / len(steps)
        n, sx, sy, sxy, sxx, syy = self.moments
        vxx, vyy, vxy = sxx - sx * sx / n, syy - sy * sy / n, sxy - sx * sy / n
        if n < 3 or vxx <= 1e-12 * max(sxx, 1e-300):
            return out
        slope = vxy / vxx
        r2 = vxy * vxy / (vxx * vyy) if vyy > 0 else 1.0
        out.update({"r2": r2, "slope_s": slope, "intercept_s": (sy - slope * sx) / n})
        return out


def own_counted(costs: Sequence[float], seconds: Sequence[float]) -> list[int]:
    """Per step, 1 when this rank's cost and time are both positive (MIN across ranks: every rank's)."""
    return [int(c > 0 and s > 0) for c, s in zip(costs, seconds, strict=True)]


def cost_check(
    costs: Sequence[Sequence[float]], seconds: Sequence[Sequence[float]]
) -> dict[str, float | int | None]:
    """`costs[step][rank]` planned, `seconds[step][rank]` measured (each rank's own compute, no waits).

    Returns:
        steps: the steps compared (those where every rank has a positive planned cost and time; an IDLE
            rank's zero-weight step would count as imbalance the plan chose);
        planned_imbalance / measured_imbalance: the mean over those steps of max / mean across ranks;
        r2: the R^2 of the least-squares line seconds = intercept_s + slope_s x cost over every (step, rank)
            of them (None with fewer than 3 points or no spread in cost);
        slope_s, intercept_s: that line.

    Raises:
        ValueError: `costs` and `seconds` of different shapes, or a negative or non-finite value.
    """
    if len(costs) != len(seconds):
        raise ValueError(f"costs and seconds must hold the same steps, got {len(costs)=} {len(seconds)=}")
    world = len(costs[0]) if costs else 1
    for step, (c, s) in enumerate(zip(costs, seconds, strict=True)):
        if len(c) != world or len(s) != world:
            raise ValueError(
                f"step {step}: one cost and one time per rank ({world=}), got {len(c)=} {len(s)=}"
            )
        for v in (*c, *s):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"step {step}: costs and times must be finite and >= 0, got {v=}")
    counted = [min(own_counted(c, s)) if c else 0 for c, s in zip(costs, seconds, strict=True)]
    per_rank = [
        CheckSums.local([c[r] for c in costs], [s[r] for s in seconds], counted, world) for r in range(world)
    ]
    total = CheckSums(
        world,
        counted,
        [max(p.cost_max[i] for p in per_rank) for i in range(len(costs))],
        [sum(p.cost_sum[i] for p in per_rank) for i in range(len(costs))],
        [max(p.time_max[i] for p in per_rank) for i in range(len(costs))],
        [sum(p.time_sum[i] for p in per_rank) for i in range(len(costs))],
        [sum(p.moments[k] for p in per_rank) for k in range(len(MOMENTS))],
    )
    return total.result()
