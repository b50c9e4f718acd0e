"""How well each cost model predicts a model's measured step time: section "calibrate".

`batchd calibrate` (the library, `batchd.calibrate`) trains each reference model on its designed padded
and packed batches and times forward + backward + optimizer step (the fastest of `--repeats`). Each of
batchd's cost models then predicts those steps as an affine function of its cost (the best line
a + b x cost by least squares: a per-step overhead is common to every rank of a step, so only the slope
matters to balance): `padded` (rows x longest), `packed` (the token sum), `attention` with the default
q = 4096 and with the calibrated q, and the calibration's own three-term fit (overhead + linear x
tokens + quadratic x attention pairs). Per model and layout: R^2 and the largest relative error.

Usage: python benchmarks/calibrate_fit.py [--models tiny:2048,llama-100m:512] [--repeats 3]
(MODEL:T: the largest batch measured, T tokens; on CPU llama-100m takes seconds per step)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import add_common_args, command_line, finish  # noqa: E402

SECTION = "calibrate"
MEASURES = ("benchmarks/calibrate_fit.py", "batchd/_calibrate.py", "core/_calibrate.py", "core/_cost.py")
COST_MODELS = (("padded", None), ("packed", None), ("attention", 4096), ("attention", "fitted"))


def affine_fit(costs: list[float], seconds: list[float]) -> dict[str, float]:
    """R^2 and the largest relative error of the least-squares line seconds = a + b x cost: the line of
    `batchd.core.cost_check`, the check the trainers and the bench run, over one rank's steps."""
    from batchd.core import cost_check

    got = cost_check([[c] for c in costs], [[s] for s in seconds])
    a, b = got["intercept_s"], got["slope_s"]
    assert a is not None and b is not None and got["r2"] is not None, f"no line through {costs=}"
    worst = max(abs(a + b * c - s) / s for c, s in zip(costs, seconds, strict=True))
    return {"r2": float(got["r2"]), "max_rel_err": float(worst)}


def fit_model(model: str, max_tokens: int, repeats: int) -> dict:
    from batchd.calibrate import CalibrateOptions, calibrate
    from batchd.core import CostModel

    t0 = time.perf_counter()
    cal = calibrate(CalibrateOptions(model=model, max_tokens=max_tokens, repeats=repeats))
    rows = []
    for layout, fit in cal.fits.items():
        mine = [m for m in cal.measured if m.layout == layout]
        q = fit.time.q()
        for name, quad in COST_MODELS:
            if quad == "fitted" and q is None:
                continue
            cm = CostModel(name, q if quad == "fitted" else (quad or 4096))
            label = name if quad is None else f"attention q={cm.quadratic}"
            label += " (fitted)" if quad == "fitted" else ""
            got = affine_fit([cm.cost(m.lengths) for m in mine], [m.seconds for m in mine])
            rows.append({"layout": layout, "cost": label, **got, "points": len(mine)})
        t = fit.time
        rows.append(
            {
                "layout": layout,
                "cost": "calibrated: overhead + linear + quadratic",
                "r2": t.r2,
                "max_rel_err": t.max_rel_err,
                "points": t.points,
            }
        )
    return {
        "model": model,
        "rows": rows,
        "recommended": {
            "cost": cal.cost.name,
            "quadratic": cal.cost.quadratic,
            "token_budget": cal.token_budget,
        },
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny:2048,llama-100m:512")
    ap.add_argument("--repeats", type=int, default=3)
    add_common_args(ap)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # one core per trainer, as the bench runs its ranks
    models = [(m.split(":")[0], int(m.split(":")[1]) if ":" in m else 2048) for m in args.models.split(",")]
    fits = [fit_model(m, tokens, args.repeats) | {"max_tokens": tokens} for m, tokens in models]
    for f in fits:
        for r in f["rows"]:
            err = f"R^2 {r['r2']:.3f} max err {r['max_rel_err']:.1%}"
            print(f"{f['model']:>10} {r['layout']:>6} {r['cost']:<44} {err}")
    data = {"fits": fits, "recommended": {f["model"]: f["recommended"] for f in fits}}
    config = {"models": args.models, "repeats": args.repeats, "threads": 1}
    config["command"] = command_line(__file__, argv)
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
