"""`batchd demo --json` through the Ray preprocessing pipeline: stall fraction and samples/s.

Runs `python -m batchd demo --json --num-actors K` (default K=2; the demo's other defaults: world size
2, 1024 generated records with images and bad records, L=1024, policy balanced, window 128, depth 4)
`--runs` times (default 2), each as a subprocess, and records per run: the trainers' stall fraction
(time blocked in the batch iterator's `next()` / epoch wall time; max and per rank), samples/s delivered
to training, the actors' capacity (records per second of actor busy time), actor busy fraction,
samples + quarantined = records read, epoch wall time, and the fixed baseline's wall time and stall.

Result: benchmarks/results/demo-pipeline.json (template benchmarks/templates/demo-pipeline.md.j2).

Usage: python benchmarks/demo_pipeline.py [--runs 2] [--num-actors 2] [--demo-args "..."] [--out PATH]
       [--print]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli_runs import cli_json, command, load_average, machine  # noqa: E402
from _report import add_common_args, finish  # noqa: E402

SECTION = "demo-pipeline"
MEASURES = ["batchd/demo.py", "batchd/_demo_ray.py", "batchd/_demo_run.py", "client", "core", "service"]
TARGET = 0.05
PREPROCESS_KEYS = (
    "stall_fraction",
    "stall_fraction_per_rank",
    "samples_per_s",
    "capacity_samples_per_s",
    "actor_busy_fraction",
    "samples",
    "quarantined",
    "records_read",
    "records",
    "accounting_ok",
)


def one_run(num_actors: int, timeout: float, extra: list[str]) -> dict[str, Any]:
    """One demo run's record: the pipeline's figures, the batchd epoch's and the baseline's."""
    s, outer = cli_json(["demo", "--num-actors", str(num_actors), *extra], timeout)
    b = s.get("baseline") or {}
    run = {
        "preprocess": {k: s["preprocess"].get(k) for k in PREPROCESS_KEYS},
        "wall_s": s["wall_s"],
        "steps": s["steps_per_rank"][0],
        "missing": s["missing"],
        "duplicates": s["duplicates"],
        "baseline": {k: b[k] for k in ("wall_s", "stall_fraction") if k in b} or None,
        "outer_s": outer,
        "load_after": load_average(),
    }
    print(json.dumps(run), flush=True)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--num-actors", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per demo run")
    ap.add_argument("--demo-args", default="", help="extra `batchd demo` arguments (one string)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    raw = argv if argv is not None else sys.argv[1:]
    t_all = time.perf_counter()
    load0 = load_average()
    runs = [one_run(args.num_actors, args.timeout, args.demo_args.split()) for _ in range(args.runs)]
    median = statistics.median(r["preprocess"]["stall_fraction"] for r in runs)
    data = {
        "runs": runs,
        "median_stall": median,
        "target": TARGET,
        "met": median < TARGET,
        "actors_per_service": max(1, args.num_actors // 2),
        "load_before": load0,
        "wall_s": time.perf_counter() - t_all,
        "machine": machine(),
    }
    config = {
        "command": command("demo_pipeline.py", raw),
        "runs": args.runs,
        "num_actors": args.num_actors,
        "demo_args": args.demo_args,
        "timeout": args.timeout,
    }
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
