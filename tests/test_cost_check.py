"""`batchd.core.cost_check`: how well the cost model predicted the ranks' measured compute.

Checked against the same figures computed with numpy from the whole matrix, by hand, and on its
errors.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchd.core import cost_check


def _direct(costs, seconds):
    if not costs:
        return {"steps": 0}
    c, s = np.array(costs, dtype=float), np.array(seconds, dtype=float)
    keep = (c > 0).all(axis=1) & (s > 0).all(axis=1)
    c, s = c[keep], s[keep]
    out = {"steps": int(keep.sum())}
    if not out["steps"]:
        return out
    out["planned_imbalance"] = float((c.max(axis=1) / c.mean(axis=1)).mean())
    out["measured_imbalance"] = float((s.max(axis=1) / s.mean(axis=1)).mean())
    x, y = c.ravel(), s.ravel()
    if len(x) >= 3 and np.ptp(x) > 0:
        slope, intercept = np.polyfit(x, y, 1)
        pred = intercept + slope * x
        # constant times: the flat line fits them exactly (R^2 1, as cost_check says), where numpy's
        # residuals of its fit divide rounding noise by zero
        out["r2"] = float(1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum()) if np.ptp(y) > 0 else 1.0
        out["slope_s"] = float(slope)
    return out


matrices = st.integers(1, 4).flatmap(
    lambda world: st.lists(
        st.tuples(
            st.lists(st.integers(0, 4000), min_size=world, max_size=world),
            st.lists(st.floats(0.01, 5.0), min_size=world, max_size=world),
        ),
        max_size=12,
    )
)


@given(matrices)
def test_the_figures_match_numpys(rows):
    costs = [[float(v) for v in c] for c, _ in rows]
    seconds = [list(s) for _, s in rows]
    got, want = cost_check(costs, seconds), _direct(costs, seconds)
    assert got["steps"] == want["steps"]
    for key in ("planned_imbalance", "measured_imbalance"):
        if key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-9)
    if "r2" in want:
        assert got["r2"] is not None
        assert got["r2"] == pytest.approx(want["r2"], rel=1e-6, abs=1e-6)
        assert got["slope_s"] == pytest.approx(want["slope_s"], rel=1e-6, abs=1e-9)


def test_a_right_cost_model_and_a_wrong_one_by_hand():
    # time = 1 ms per cost unit: perfectly predicted, the measured imbalance is the planned one
    costs = [[100, 200], [300, 300], [50, 150]]
    right = cost_check(costs, [[c / 1000 for c in row] for row in costs])
    assert right["steps"] == 3 and right["r2"] == pytest.approx(1.0)
    assert right["measured_imbalance"] == pytest.approx(right["planned_imbalance"])
    # planned level, measured not: the cost model balanced the wrong thing
    wrong = cost_check([[100, 100]] * 3, [[0.1, 0.3], [0.3, 0.1], [0.2, 0.2]])
    assert wrong["planned_imbalance"] == 1.0 and wrong["measured_imbalance"] > 1.3
    assert wrong["r2"] is None  # no spread in the planned cost: no line to fit
    # a step with an IDLE rank is left out
    assert cost_check([[0, 10], [10, 10]], [[0.0, 1.0], [1.0, 1.0]])["steps"] == 1


def test_bad_shapes_and_values_are_named():
    with pytest.raises(ValueError, match="same steps"):
        cost_check([[1.0]], [])
    with pytest.raises(ValueError, match="one cost and one time per rank"):
        cost_check([[1.0, 2.0], [1.0]], [[1.0, 1.0], [1.0]])
    with pytest.raises(ValueError, match="finite and >= 0"):
        cost_check([[1.0]], [[float("nan")]])
