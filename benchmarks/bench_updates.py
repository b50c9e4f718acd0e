"""`batchd bench` at equal update semantics, over seeds: section "bench-updates".

The one-epoch bench (section "bench") steps the optimizer once per step, so the token-budget batchers
make far fewer, larger updates than fixed batching and end the epoch at a higher held-out loss. Here
every system keeps one recipe's updates: fixed batching and ODB 0.1.2 accumulate K steps per update
(`batchd bench --accumulate K`, the update's gradient its per-token mean), the batchd systems update
once per G global loss tokens with G = fixed batching's mean per update (`--tokens-per-update auto`).
Each seed is one whole bench (all systems, one after another); the seeds give each system's
seed-to-seed spread of the held-out loss, the yardstick of "within noise".

Result: benchmarks/results/bench-updates.json (template benchmarks/templates/bench-updates.md.j2),
plots of seed 0 under docs/img/bench_updates_*.png.

Every update steps at the recipe's learning rate (`--lr-scaling none`, the default here: "the same
learning-rate schedule per update"). The bench's default sqrt rule scales each update's lr by the
square root of its tokens over the mean; its sum over an epoch's updates is largest when they are
even (Jensen), so it charges batchd, whose updates are quantized to whole steps of L x N tokens, a
smaller total learning rate for the same tokens.

Usage: python benchmarks/bench_updates.py [--seeds 3] [--num-samples 1024] [--accumulate 16]
       [--systems fixed,odb-0.1.2,batchd-balanced,batchd-packed] [--lr-scaling none|sqrt|linear]
       [--out PATH] [--print] [--no-plots]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli_runs import machine  # noqa: E402
from _report import REPO, add_common_args, finish, idle_share  # noqa: E402

SECTION = "bench-updates"
MEASURES = ["batchd/bench.py", "batchd/_train", "client", "core", "service"]
SYSTEMS = "fixed,odb-0.1.2,batchd-balanced,batchd-packed"
KEEP = (
    "wall_s",
    "steps",
    "updates",
    "update_tokens_min",
    "update_tokens_mean",
    "update_tokens_max",
    "update_length_cv",
    "samples",
    "missing",
    "duplicates",
    "padding_efficiency",
    "heldout_loss",
    "final_loss",
    "speedup_vs_fixed",
    "speedup_vs_odb-0.1.2",
)


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system over the seeds: the held-out loss (each seed, mean, spread), the update count and its
    ratio to fixed's, and the wall-time ratios, each taken within one seed's run (the systems of a
    run share the machine's state)."""
    names = [n for n in runs[0]["systems"] if "wall_s" in runs[0]["systems"][n]]
    out: dict[str, Any] = {}
    for name in names:
        per = [r["systems"][name] for r in runs]
        held = [p["heldout_loss"] for p in per]
        out[name] = {
            "seeds": [{k: p.get(k) for k in KEEP} for p in per],
            "heldout_mean": statistics.fmean(held),
            "heldout_min": min(held),
            "heldout_max": max(held),
            "updates": [p["updates"] for p in per],
            "updates_vs_fixed": [
                p["updates"] / r["systems"]["fixed"]["updates"] for p, r in zip(per, runs, strict=True)
            ],
            "speedup_vs_fixed": [p.get("speedup_vs_fixed") for p in per],
            "speedup_vs_odb": [p.get("speedup_vs_odb-0.1.2") for p in per],
            "wall_median": statistics.median(p["wall_s"] for p in per),
        }
    fixed = out["fixed"]
    for v in out.values():
        v["within_fixed_spread"] = fixed["heldout_min"] <= v["heldout_mean"] <= fixed["heldout_max"]
        below = v["heldout_mean"] < fixed["heldout_min"]
        v["vs_fixed_spread"] = "within" if v["within_fixed_spread"] else "below" if below else "above"
        v["gap_to_fixed"] = v["heldout_mean"] - fixed["heldout_mean"]
    return {"systems": out, "order": names}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--num-samples", type=int, default=1024)
    ap.add_argument("--accumulate", type=int, default=16)
    ap.add_argument("--systems", default=SYSTEMS)
    ap.add_argument(
        "--lr-scaling",
        default="none",
        help="the bench's lr rule per update; none (default): the recipe's lr for every update, as "
        "equal update semantics ask; sqrt scales it by each update's tokens, which favours even updates",
    )
    ap.add_argument("--no-plots", action="store_true", help="no PNGs under docs/img")
    add_common_args(ap)
    args = ap.parse_args(argv)
    from batchd.bench import parse_systems, run_bench, write_plots

    t0, idle0 = time.perf_counter(), idle_share()
    runs = []
    for seed in range(args.seeds):
        s = run_bench(
            num_samples=args.num_samples,
            systems=parse_systems(args.systems),
            seed=seed,
            depth=8,  # as recorded (the spec's default is 4)
            accumulate=args.accumulate,
            tokens_per_update="auto",
            lr_scaling=args.lr_scaling,
            plots=False,
            progress=lambda m: print(m, file=sys.stderr, flush=True),
        )
        runs.append(s)
        if seed == 0 and not args.no_plots:
            title = (
                f"{Path(s['workload']).stem}, {s['num_samples']} samples, N={s['world_size']}, "
                f"K={args.accumulate}, G={s['tokens_per_update']}, seed 0"
            )
            write_plots(s["systems"], REPO / "docs" / "img", title, prefix="bench_updates_")
    setup = ("num_samples", "heldout", "world_size", "token_budget", "model", "lr", "lr_scaling")
    first = runs[0]
    data = {
        **aggregate(runs),
        "setup": {
            **{k: first[k] for k in setup},
            "workload": Path(first["workload"]).name,
            "fixed_batch_size": first["fixed_batch_size"],
            "accumulate": args.accumulate,
            "tokens_per_update": [r["tokens_per_update"] for r in runs],
        },
        "seeds": args.seeds,
        "wall_s": time.perf_counter() - t0,
        "idle": (idle0, idle_share()),
        "machine": machine(),
        "plots": not args.no_plots,
    }
    config = {
        "command": f"python benchmarks/bench_updates.py --seeds {args.seeds} --num-samples "
        f"{args.num_samples} --accumulate {args.accumulate} --systems {args.systems} --lr-scaling "
        f"{args.lr_scaling}",
        "seeds": args.seeds,
        "num_samples": args.num_samples,
        "accumulate": args.accumulate,
        "systems": args.systems,
        "lr_scaling": args.lr_scaling,
    }
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
