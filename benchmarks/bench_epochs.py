"""`batchd bench --epochs E` for the docs: time to quality over several epochs, section "bench-epochs".

The one-epoch bench (section "bench") compares systems on the same samples, once each: the token-budget
batchers finish the epoch sooner but, with fewer optimizer updates, at a higher held-out loss. This run
asks the follow-up question a user has: training longer, which system first reaches the held-out loss
that fixed batching ends its first epoch at, and how long does it take? Every system trains E epochs
(epoch e: every system's view of epoch e, the same seeded permutation), with the held-out loss measured
after every epoch, the clock paused while evaluating.

Result: benchmarks/results/bench-epochs.json (template benchmarks/templates/bench-epochs.md.j2).

Usage: python benchmarks/bench_epochs.py [--epochs 3] [--num-samples 1024] [--from-json FILE]
       [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli_runs import machine  # noqa: E402
from _report import add_common_args, finish, idle_share  # noqa: E402

SECTION = "bench-epochs"
MEASURES = ["batchd/bench.py", "batchd/_train", "client", "core", "service"]


def time_to(evals: list[dict[str, Any]], target: float) -> tuple[int, float] | None:
    """(epoch, seconds) of the first epoch end whose held-out loss is <= target; None if never."""
    return next(((e["epoch"], e["t"]) for e in evals if e["loss"] <= target), None)


def best_by(evals: list[dict[str, Any]], t: float) -> dict[str, Any] | None:
    """The lowest held-out loss among the epoch ends at or before `t` seconds (None: none by then)."""
    done = [e for e in evals if e["t"] <= t]
    return min(done, key=lambda e: e["loss"]) if done else None


def summarize(s: dict[str, Any]) -> dict[str, Any]:
    """Per system: the held-out loss after each epoch, the best by fixed's epoch-1 time, the first
    epoch reaching fixed's epoch-1 loss; and the run's lowest loss by then and the near misses."""
    systems = {k: v for k, v in s["systems"].items() if "wall_s" in v}
    fixed = systems.get("fixed")
    if not fixed or not fixed.get("heldout_by_epoch"):
        raise ValueError("the run needs the fixed system and a held-out set")
    target, t_fixed = fixed["heldout_by_epoch"][0]["loss"], fixed["heldout_by_epoch"][0]["t"]
    out = {}
    for name, r in systems.items():
        evals = r["heldout_by_epoch"]
        hit = time_to(evals, target)
        out[name] = {
            **{k: r[k] for k in ("wall_s", "steps", "samples", "missing", "duplicates")},
            "evals": [{k: e[k] for k in ("epoch", "loss", "t")} for e in evals],
            "best_by_fixed": best_by(evals, t_fixed),
            "reaches": None if hit is None else {"epoch": hit[0], "t": hit[1], "vs_fixed": t_fixed / hit[1]},
        }
    ranked = sorted((b["best_by_fixed"]["loss"], n) for n, b in out.items() if b["best_by_fixed"])
    near = [
        {"system": n, **e}
        for n, b in out.items()
        for e in b["evals"]
        if e["loss"] > target and e["loss"] - target < 0.05 and e["t"] < t_fixed
    ]
    return {
        "systems": out,
        "order": list(out),  # the run's order (the JSON's keys are sorted)
        "target": target,
        "t_fixed": t_fixed,
        "lowest": {"system": ranked[0][1], "loss": ranked[0][0]},
        "near": near,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--num-samples", type=int, default=1024)
    ap.add_argument("--from-json", metavar="FILE", help="record a saved `batchd bench --json` output")
    add_common_args(ap)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    idle: tuple[float, float] | None = None
    if args.from_json:
        s = json.loads(Path(args.from_json).read_text().strip().splitlines()[-1])
        wall = s.get("total_s", 0.0)
    else:
        from batchd.bench import run_bench

        idle0 = idle_share()
        s = run_bench(
            num_samples=args.num_samples,
            epochs=args.epochs,
            depth=8,  # as recorded (the spec's default is 4)
            plots=False,
            progress=lambda m: print(m, file=sys.stderr, flush=True),
        )
        wall, idle = time.perf_counter() - t0, (idle0, idle_share())
    setup = ("workload", "num_samples", "heldout", "world_size", "token_budget", "model", "lr", "lr_scaling")
    data = {
        **summarize(s),
        "setup": {**{k: s[k] for k in setup}, "workload": Path(s["workload"]).name},
        "epochs": s["epochs"],
        "wall_s": wall,
        "idle": idle,
        "machine": machine(),
    }
    config = {
        "command": f"batchd bench --epochs {args.epochs} --num-samples {args.num_samples}",
        "epochs": args.epochs,
        "num_samples": args.num_samples,
        "from_json": args.from_json,
    }
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
