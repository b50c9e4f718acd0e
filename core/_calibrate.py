"""Fitting a cost model and a token budget to measured steps (`batchd calibrate`'s arithmetic, no I/O).

A measured step is a batch (its samples' lengths and its layout: ``padded`` rows x longest, or ``packed``
documents in one row with per-document attention) with the seconds of its forward, backward and
optimizer step and its peak memory. Both are fitted to the same three terms,

    y = overhead + linear * T + quadratic * Q

with T the tokens the step materializes (rows x longest padded, the sum packed) and Q its attention
pairs (rows x longest^2 padded, the sum of squared lengths packed): the linear term is the matmuls and
the activations, the quadratic one attention's scores. Coefficients are never negative: the fit is least
squares in relative error (a batch ten times larger does not outweigh a small one), over every subset of
the terms, keeping the best one whose coefficients are all >= 0. O(batches).

batchd's cost models are fractions of this: `padded` is T under the padded layout, `packed` T under the
packed one, `attention` T + Q / q packed; `CostFit.cost_model` picks the one the fit supports and its q
(= linear / quadratic: the length at which a sample's attention costs what its other work does).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from ._choices import COLLATE
from ._cost import CostModel
from ._types import check_choice, check_int

LAYOUTS = COLLATE  # the batch layouts measured: the rank service's collations
# a quadratic term smaller than this share of the linear one for one sample of the budget's length is
# noise for the planner: the fit then recommends the linear model of its layout
QUADRATIC_SHARE = 0.05
BUDGET_QUANTUM = 64  # budgets are rounded down to a multiple of this


def batch_terms(lengths: Sequence[int], layout: str) -> tuple[int, int]:
    """(T, Q) of one batch: tokens materialized and attention pairs (module docstring)."""
    check_choice("layout", layout, LAYOUTS)
    if not lengths:
        raise ValueError(f"a batch needs at least one sample, got {lengths=}")
    for n in lengths:
        check_int("length", n, lo=1)
    if layout == "padded":
        longest = max(lengths)
        return len(lengths) * longest, len(lengths) * longest * longest
    return sum(lengths), sum(n * n for n in lengths)


@dataclasses.dataclass(frozen=True, slots=True)
class Measured:
    """One measured step: its batch, its seconds (forward + backward + optimizer) and peak bytes."""

    lengths: tuple[int, ...]
    layout: str
    seconds: float
    peak_bytes: int = 0

    def __post_init__(self) -> None:
        batch_terms(self.lengths, self.layout)
        if not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise ValueError(f"seconds must be a finite number > 0, got {self.seconds=}")
        check_int("peak_bytes", self.peak_bytes, lo=0)

    @property
    def terms(self) -> tuple[int, int]:
        return batch_terms(self.lengths, self.layout)


@dataclasses.dataclass(frozen=True, slots=True)
class Fit:
    """`y = overhead + linear * T + quadratic * Q` and how well it fits: `r2` (of y), `max_rel_err`
    (the largest |predicted - measured| / measured) over the `points` it was fitted to."""

    overhead: float
    linear: float
    quadratic: float
    r2: float
    max_rel_err: float
    points: int

    def predict(self, terms: tuple[int, int]) -> float:
        t, q = terms
        return self.overhead + self.linear * t + self.quadratic * q

    def q(self) -> int | None:
        """linear / quadratic: the length at which a sample's quadratic term equals its linear one
        (None without a quadratic term)."""
        if self.quadratic <= 0 or self.linear <= 0:
            return None
        return max(1, round(self.linear / self.quadratic))

    def to_json(self) -> dict[str, float | int | None]:
        return {**dataclasses.asdict(self), "q": self.q()}


def fit_terms(points: Sequence[tuple[tuple[int, int], float]]) -> Fit:
    """The non-negative least-squares fit, in relative error, of `y` over ((T, Q), y) points (module
    docstring). ValueError with fewer than 3 points or a y <= 0."""
    if len(points) < 3:
        raise ValueError(f"a fit needs at least 3 measured batches, got {len(points)=}")
    x = np.array([[1.0, float(t), float(q)] for (t, q), _ in points])
    y = np.array([float(v) for _, v in points])
    if (y <= 0).any():
        raise ValueError(f"every measured value must be > 0, got {y.min()=}")
    scale = x.max(axis=0)  # the columns on one scale: T and Q span many orders of magnitude
    scale[scale == 0] = 1.0
    xs = x / scale / y[:, None]  # relative error: each row divided by its own y
    best: tuple[float, np.ndarray] | None = None
    for k in range(1, 4):
        for cols in itertools.combinations(range(3), k):
            sol, *_ = np.linalg.lstsq(xs[:, cols], np.ones(len(y)), rcond=None)
            if (sol < 0).any():
                continue
            coef = np.zeros(3)
            coef[list(cols)] = sol
            err = float(np.sum((xs @ coef - 1.0) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, coef)
    assert best is not None  # the overhead alone is a non-negative solution
    coef = best[1] / scale
    pred = x @ coef
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - pred) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return Fit(
        overhead=float(coef[0]),
        linear=float(coef[1]),
        quadratic=float(coef[2]),
        r2=r2,
        max_rel_err=float(np.max(np.abs(pred - y) / y)),
        points=len(y),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class CostFit:
    """A layout's step-time fit and peak-memory fit (None when no peak was measured)."""

    layout: str
    time: Fit
    memory: Fit | None

    def cost_model(self, token_budget: int) -> CostModel:
        """The batchd cost model this fit supports at `token_budget`: `padded` for the padded layout (the
        planner's padded cost is T); for the packed one `attention` with q = `Fit.q` when a sample of the
        budget's length spends at least QUADRATIC_SHARE of its time in the quadratic term, else `packed`."""
        check_int("token_budget", token_budget, lo=1)
        if self.layout == "padded":
            return CostModel("padded")
        q = self.time.q()
        if q is None or token_budget / q < QUADRATIC_SHARE:
            return CostModel("packed")
        return CostModel("attention", q)

    def largest_budget(self, limit_bytes: int, margin: float) -> int | None:
        """The largest token budget whose worst batch (one sample of the budget's length: the most
        attention pairs for its tokens, under either layout) keeps the fitted peak within
        (1 - margin) x `limit_bytes`, rounded down to BUDGET_QUANTUM; None without a memory fit or when
        not even BUDGET_QUANTUM tokens fit."""
        check_int("limit_bytes", limit_bytes, lo=1)
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin=}")
        if self.memory is None:
            return None
        room = (1 - margin) * limit_bytes - self.memory.overhead
        a, b = self.memory.quadratic, self.memory.linear  # a L^2 + b L <= room
        if room <= 0:
            return None
        if a > 0:
            top = (-b + math.sqrt(b * b + 4 * a * room)) / (2 * a)
        elif b > 0:
            top = room / b
        else:
            raise ValueError("the memory fit grows with no term: measure larger batches")
        budget = int(top) // BUDGET_QUANTUM * BUDGET_QUANTUM
        return budget if budget >= BUDGET_QUANTUM else None


def fit_layout(measured: Sequence[Measured], layout: str) -> CostFit:
    """Fits the steps of `measured` in `layout` (time, and memory when every one has a peak)."""
    check_choice("layout", layout, LAYOUTS)
    mine = [m for m in measured if m.layout == layout]
    time = fit_terms([(m.terms, m.seconds) for m in mine])
    memory = (
        fit_terms([(m.terms, float(m.peak_bytes)) for m in mine]) if all(m.peak_bytes for m in mine) else None
    )
    return CostFit(layout, time, memory)
