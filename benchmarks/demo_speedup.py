"""`batchd demo --json` end to end, repeated: batchd vs fixed batching on the demo's tiny causal LM.

Runs `python -m batchd demo --json` (world size 2, the demo's default samples and settings) `--runs`
times (default 2), each as a subprocess, and, when the CLI has `--synthetic`, as many runs of
`python -m batchd demo --json --synthetic` (synthetic long-tail lengths without Ray). Records per run:
the batchd epoch's wall time, the fixed-batching baseline's, the speedup (baseline / batchd), steps,
padded tokens per rank-step, padding efficiency, the data-stall fraction, first/last loss; the median
speedup per variant is the headline (with 2 runs: their mean).

It also splits each run's time into a per-step and a per-token part: with both paths' busy time
(wall x (1 - stall fraction)) modelled as steps x (a + b x padded tokens per rank-step), the two
paths of one run give two equations for a (ms per step: all-reduce, optimizer, Python, small-matmul
inefficiency) and b (ms per padded token).

Result: benchmarks/results/demo.json (template benchmarks/templates/demo.md.j2).

Usage: python benchmarks/demo_speedup.py [--runs 2] [--no-synthetic] [--demo-args "--num-samples 128"]
       [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli_runs import cli_json, command, machine  # noqa: E402
from _report import REPO, add_common_args, finish, idle_share  # noqa: E402

SECTION = "demo"
MEASURES = [
    "batchd/demo.py",
    "batchd/_demo_ray.py",
    "batchd/_demo_run.py",
    "batchd/_model.py",
    "client",
    "core",
    "service",
]
SUMMARY_KEYS = (
    "wall_s",
    "speedup",
    "steps_per_rank",
    "padding_efficiency",
    "loss_first",
    "loss_last",
    "emitted",
    "missing",
    "duplicates",
    "idle",
    "stall_fraction",
)


def has_synthetic() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "batchd", "demo", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return "--synthetic" in out


def derived(s: dict[str, Any]) -> dict[str, float]:
    """Per-rank-step tokens, padded-token ratio and the a + b x tokens split of one run."""
    b = s["baseline"]
    n = len(s["steps_per_rank"])
    steps_b, steps_f = s["steps_per_rank"][0], b["steps"]
    pad_b = s["padded_tokens"] / n
    pad_f = s["real_tokens"] / b["padding_efficiency"] / n  # same samples; baseline repeats ignored
    tok_b, tok_f = pad_b / steps_b, pad_f / steps_f
    stall_b, stall_f = s.get("stall_fraction", 0.0), b.get("stall_fraction", 0.0)
    busy_b, busy_f = s["wall_s"] * (1 - stall_b), b["wall_s"] * (1 - stall_f)
    per_b, per_f = busy_b / steps_b, busy_f / steps_f  # seconds per step
    slope = (per_b - per_f) / (tok_b - tok_f) if tok_b != tok_f else float("nan")
    a = per_f - slope * tok_f
    return {
        "tok_b": tok_b,
        "tok_f": tok_f,
        "padded_ratio": pad_f / pad_b,
        "stall_b": stall_b,
        "stall_f": stall_f,
        "ms_step_b": 1000 * per_b,
        "ms_step_f": 1000 * per_f,
        "a_ms": 1000 * a,
        "b_us": 1e6 * slope,
        "overhead_share_b": a / per_b,
        "overhead_share_f": a / per_f,
        "step_ratio": steps_f / steps_b,
    }


def one_run(variant: str, i: int, extra: list[str], timeout: float) -> dict[str, Any]:
    """One demo run's record: the summary's figures, the baseline's and the derived split."""
    s, outer = cli_json(["demo", *extra], timeout)
    b = s["baseline"]
    run = {
        "variant": variant,
        "run": i,
        "batchd": {k: s.get(k) for k in SUMMARY_KEYS},
        "fixed": {k: b.get(k) for k in ("wall_s", "steps", "batch_size", "padding_efficiency", "loss_last")},
        "derived": derived(s),
        "outer_s": outer,
    }
    print(variant, i, run["batchd"]["wall_s"], run["fixed"]["wall_s"], run["derived"], flush=True)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="runs per variant")
    ap.add_argument("--no-synthetic", action="store_true", help="skip the `--synthetic` variant")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per demo run")
    ap.add_argument("--demo-args", default="", help="extra `batchd demo` arguments (one string)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    raw = argv if argv is not None else sys.argv[1:]
    t_all = time.perf_counter()
    idle0 = idle_share()
    variants = [("default", [])]
    if not args.no_synthetic and has_synthetic():
        variants.append(("--synthetic", ["--synthetic"]))
    extra = args.demo_args.split()
    runs = [
        one_run(name, i + 1, flags + extra, args.timeout)
        for name, flags in variants
        for i in range(args.runs)
    ]
    data = {
        "runs": runs,
        "variants": [name for name, _ in variants],
        "median_speedup": {
            name: statistics.median(r["batchd"]["speedup"] for r in runs if r["variant"] == name)
            for name, _ in variants
        },
        "idle_before": idle0,
        "idle_after": idle_share(),
        "wall_s": time.perf_counter() - t_all,
        "machine": machine(),
    }
    config = {
        "command": command("demo_speedup.py", raw),
        "runs": args.runs,
        "no_synthetic": args.no_synthetic,
        "demo_args": args.demo_args,
        "timeout": args.timeout,
    }
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
