"""`batchd calibrate`: the fit recovers known costs, the budget fits the memory, the fragment loads.

The fit's arithmetic (`batchd.core.fit_layout`) is checked on exact synthetic points (property tests:
any non-negative coefficients come back); the measuring loop on a timed stand-in model whose step sleeps
known linear and quadratic terms (tests/_standin.py) and on the tiny reference model with a memory limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import _standin
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from batchd.core import CostModel, Measured, fit_layout
from batchd.testing import batch_terms

REPO = Path(__file__).resolve().parents[1]


def _points(layout, overhead, linear, quadratic, peak=(0.0, 0.0, 0.0)):
    out = []
    for lengths in [(32,), (32,) * 8, (64,) * 3, (128,), (256,) * 2, (512,), (1024,), (100, 300, 50)]:
        t, q = batch_terms(lengths, layout)
        mem = peak[0] + peak[1] * t + peak[2] * q
        out.append(Measured(lengths, layout, overhead + linear * t + quadratic * q, int(mem)))
    return out


@given(
    st.sampled_from(["padded", "packed"]),
    st.one_of(st.just(0.0), st.floats(1e-4, 0.1)),  # zero, or a term that shows in the data
    st.floats(1e-7, 1e-4),
    st.one_of(st.just(0.0), st.floats(1e-10, 1e-7)),
)
def test_the_fit_recovers_exact_non_negative_coefficients(layout, overhead, linear, quadratic):
    fit = fit_layout(_points(layout, overhead, linear, quadratic), layout).time
    assert fit.linear == pytest.approx(linear, rel=1e-6)
    assert fit.quadratic == pytest.approx(quadratic, rel=1e-6, abs=1e-15)
    assert fit.overhead == pytest.approx(overhead, rel=1e-6, abs=1e-12)
    assert fit.r2 == pytest.approx(1.0) and fit.max_rel_err < 1e-6


def test_coefficients_are_never_negative_and_the_errors_are_reported():
    # a step time that falls with tokens: no non-negative fit explains it; the fit keeps >= 0 terms
    pts = [Measured((n,), "packed", 1.0 / n) for n in (32, 64, 128, 256, 512)]
    fit = fit_layout(pts, "packed").time
    assert min(fit.overhead, fit.linear, fit.quadratic) >= 0
    assert fit.max_rel_err > 0.5 and fit.r2 < 0.9
    with pytest.raises(ValueError, match="at least 3 measured batches"):
        fit_layout(pts[:2], "packed")
    with pytest.raises(ValueError, match="seconds must be a finite number > 0"):
        Measured((32,), "packed", 0.0)
    with pytest.raises(ValueError, match="layout"):
        batch_terms((32,), "ragged")


def test_the_cost_model_follows_the_fit():
    packed = fit_layout(_points("packed", 0.01, 1e-5, 1e-5 / 2048), "packed")
    assert packed.time.q() == 2048
    assert packed.cost_model(8192) == CostModel("attention", 2048)
    assert packed.cost_model(64) == CostModel("packed")  # attention is < 5% of a 64-token sample's time
    assert fit_layout(_points("packed", 0.01, 1e-5, 0.0), "packed").cost_model(8192) == CostModel("packed")
    assert fit_layout(_points("padded", 0.01, 1e-5, 1e-9), "padded").cost_model(8192) == CostModel("padded")


def test_the_largest_budget_keeps_the_worst_batch_within_the_limit():
    mib = 2**20
    cf = fit_layout(_points("packed", 0.01, 1e-5, 0.0, peak=(100 * mib, 4096.0, 8.0)), "packed")
    limit = 1024 * mib
    budget = cf.largest_budget(limit, 0.1)
    assert budget is not None and budget % 64 == 0
    worst = cf.memory.predict((budget, budget * budget))
    assert worst <= 0.9 * limit < cf.memory.predict((budget + 64, (budget + 64) ** 2))
    assert cf.largest_budget(50 * mib, 0.1) is None  # the parameters alone do not fit


def test_calibrate_recovers_a_timed_stand_ins_costs_within_ten_percent(monkeypatch):
    """The stand-in's step waits 40 ms + 40 us x tokens + 40 us / 512 x attention pairs on top of what
    its own tiny step costs (measured by the same calibration of the stand-in waiting 1 ms only): each
    layout's fit minus that baseline finds every coefficient within 10% (the overhead: 39 ms) and q =
    linear / quadratic within 10% of 512; the recommended model is attention."""
    from batchd.calibrate import CalibrateOptions, calibrate

    opts = CalibrateOptions(
        entry="_standin:make", min_length=32, max_tokens=1024, repeats=5, memory_limit=2**30
    )
    threads = torch.get_num_threads()
    # one thread: torch's idle OpenMP workers spin after each op, and on 2 cores they delay the wake-up
    # of the stand-in's sleep by up to 10 ms, noise of the stand-in's making, not the measurement's
    torch.set_num_threads(1)
    try:
        monkeypatch.setattr(_standin, "SLEEP", False)
        base = calibrate(opts)
        monkeypatch.setattr(_standin, "SLEEP", True)
        cal = calibrate(opts)
    finally:
        torch.set_num_threads(threads)
    for layout, cf in cal.fits.items():
        t, b = cf.time, base.fits[layout].time
        overhead = _standin.OVERHEAD - _standin.FLOOR
        assert t.overhead - b.overhead == pytest.approx(overhead, rel=0.1), (layout, t, b)
        assert t.linear - b.linear == pytest.approx(_standin.LINEAR, rel=0.1), (layout, t, b)
        assert t.quadratic - b.quadratic == pytest.approx(_standin.QUADRATIC, rel=0.1), (layout, t, b)
        assert t.r2 > 0.98, (layout, t)
        assert (t.linear - b.linear) / (t.quadratic - b.quadratic) == pytest.approx(_standin.Q, rel=0.1)
    assert cal.cost.name == "attention"  # q: the stand-in's own linear cost adds to its terms'


def test_the_cli_writes_a_fragment_that_loads_and_a_budget_within_the_memory_limit(tmp_path):
    """`batchd calibrate` on the tiny reference model with a 64 MiB limit: the budget's worst batch was
    measured within 90% of it; calibration.toml loads with `batchd config`; json and svg are written."""
    import json

    limit = 64 * 2**20
    run = subprocess.run(
        [sys.executable, "-m", "batchd", "calibrate", "--max-tokens", "256", "--repeats", "1",
         "--memory-limit", "64MiB", "--out", str(tmp_path / "cal"), "--quiet"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    cal = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert cal["token_budget"] is not None and cal["token_budget"] <= 2 * 256
    assert cal["worst"]["peak_bytes"] <= 0.9 * limit and cal["worst"]["lengths"] == [cal["token_budget"]]
    assert len(cal["measured"]) == 2 * 9  # padded and packed: lengths 32-256, 3 + 3 + 2 + 1 batches
    assert (tmp_path / "cal" / "calibration.svg").read_text().startswith("<svg")
    assert "token_budget" in run.stdout and "R^2" in run.stdout
    check = subprocess.run(
        [sys.executable, "-m", "batchd", "config", str(tmp_path / "cal" / "calibration.toml")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr
    assert f"L_max {cal['token_budget']}" in check.stdout


def test_a_limit_below_the_model_itself_gives_no_budget_and_says_so(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "batchd", "calibrate", "--max-tokens", "128", "--repeats", "1",
         "--memory-limit", "1KiB", "--out", str(tmp_path), "--quiet", "--layouts", "packed"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "# token_budget: not even 64 tokens fit the memory limit" in run.stdout


def test_the_documented_command_runs_as_written(tmp_path):
    """docs/operations.md's `batchd calibrate --model tiny --max-tokens 512 --out calibration`, as written:
    it exits 0, prints the fit of both layouts and the fragment, writes the three files, and the fragment
    loads with `batchd config`."""
    line = "batchd calibrate --model tiny --max-tokens 512 --out calibration"
    assert line in (REPO / "docs" / "operations.md").read_text()
    bindir = Path(sys.executable).parent
    run = subprocess.run(line.split(), cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert [ln.split()[0] for ln in run.stdout.splitlines()[1:3]] == ["padded", "packed"], run.stdout
    assert "[job]" in run.stdout and "token_budget = " in run.stdout, run.stdout
    out = tmp_path / "calibration"
    assert sorted(p.name for p in out.iterdir()) == [
        "calibration.json",
        "calibration.svg",
        "calibration.toml",
    ]
    check = subprocess.run(
        [sys.executable, "-m", "batchd", "config", str(out / "calibration.toml")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr


def test_a_stock_hugging_face_model_calibrates_with_its_image_markers_kept_out(tmp_path):
    """`--hf-model` (the tiny stock Qwen2-VL, adapted as batchd.train adapts it): the designed text batches
    never hold its image or other marker tokens (which would ask for image grids), and the fit is made."""
    import json

    bindir = Path(sys.executable).parent
    made = subprocess.run(
        [str(bindir / "batchd"), "tiny-vlm", str(tmp_path / "vlm")], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-m", "batchd", "calibrate", "--hf-model", str(tmp_path / "vlm"),
         "--max-tokens", "128", "--repeats", "1", "--layouts", "packed", "--out", str(tmp_path / "cal"),
         "--quiet"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    cal = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert cal["model"].startswith("Hugging Face model") and cal["fits"]["packed"]["time"]["points"] >= 3
