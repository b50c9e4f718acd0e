"""`batchd demo --json` end to end, repeated: batchd vs fixed batching on the demo's tiny causal LM.

Runs `python -m batchd demo --json` (world size 2, the demo's default samples and settings) `--runs`
times (default 2), each as a subprocess, and, when the CLI has `--synthetic`, as many runs of
`python -m batchd demo --json --synthetic` (synthetic long-tail lengths without Ray). Reports per run:
the batchd epoch's wall time, the fixed-batching baseline's, the speedup (baseline / batchd), steps,
padded tokens per rank-step, padding efficiency, the data-stall fraction, first/last loss; the median
speedup per variant is the headline (with 2 runs: their mean).

It also splits each run's time into a per-step and a per-token part: with both paths' busy time
(wall x (1 - stall fraction)) modelled as steps x (a + b x padded tokens per rank-step), the two
paths of one run give two equations for a (ms per step: all-reduce, optimizer, Python, small-matmul
inefficiency) and b (ms per padded token). That shows whether a step is compute-bound (b x tokens
dominates) and why the speedup differs from the ratio of padded tokens.

Results go to docs/benchmarks.md between `<!-- demo:begin -->` and `<!-- demo:end -->`.

Usage: python benchmarks/demo_speedup.py [--runs 2] [--no-synthetic] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _mdsection import REPO, idle_share, publish, revision, table  # noqa: E402

SECTION = "demo"


def run_demo(extra: list[str], timeout: float) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "batchd", "demo", "--json", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    outer = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"batchd demo {' '.join(extra)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    summary["outer_s"] = outer
    return summary


def has_synthetic() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "batchd", "demo", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return "--synthetic" in out


def derived(s: dict) -> dict:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="runs per variant")
    ap.add_argument("--no-synthetic", action="store_true", help="skip the `--synthetic` variant")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per demo run")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    raw = argv if argv is not None else sys.argv[1:]
    cmd = "python benchmarks/demo_speedup.py" + (" " + " ".join(raw) if raw else "")
    t_all = time.perf_counter()
    idle0 = idle_share()
    variants = [("default", [])]
    if not args.no_synthetic and has_synthetic():
        variants.append(("--synthetic", ["--synthetic"]))
    results: list[tuple[str, int, dict, dict]] = []
    for name, extra in variants:
        for i in range(args.runs):
            s = run_demo(extra, args.timeout)
            d = derived(s)
            results.append((name, i + 1, s, d))
            print(
                name,
                json.dumps({k: v for k, v in s.items() if k not in ("steps_per_rank", "preprocess")}),
                {k: round(v, 3) for k, v in d.items()},
                flush=True,
            )
    idle1 = idle_share()
    wall = time.perf_counter() - t_all

    rows, rows_split = [], []
    for name, i, s, d in results:
        b = s["baseline"]
        rows.append(
            [
                name,
                i,
                f"{s['wall_s']:.2f}",
                f"{b['wall_s']:.2f}",
                f"{s['speedup']:.2f}x",
                f"{s['steps_per_rank'][0]} / {b['steps']} (B={b['batch_size']})",
                f"{s['padding_efficiency']:.3f} / {b['padding_efficiency']:.3f}",
                f"{d['padded_ratio']:.2f}x",
                f"{d['stall_b']:.0%} / {d['stall_f']:.0%}",
                f"{s['loss_first']:.2f} -> {s['loss_last']:.2f}",
                f"{b['loss_last']:.2f}",
                f"{s['emitted']} / {s['missing']} / {s['duplicates']} / {s['idle']}",
                f"{s['outer_s']:.0f}",
            ]
        )
        rows_split.append(
            [
                name,
                i,
                f"{d['tok_b']:.0f} / {d['tok_f']:.0f}",
                f"{d['ms_step_b']:.1f} / {d['ms_step_f']:.1f}",
                f"{d['a_ms']:.1f}",
                f"{d['b_us']:.0f}",
                f"{d['overhead_share_b']:.0%} / {d['overhead_share_f']:.0%}",
            ]
        )
    headers = [
        "variant",
        "run",
        "batchd wall s",
        "fixed wall s",
        "speedup",
        "steps batchd / fixed",
        "padding_eff batchd / fixed",
        "padded-token ratio",
        "stall batchd / fixed",
        "loss batchd",
        "loss fixed (last)",
        "samples / missing / dup / idle",
        "whole run s",
    ]
    headers_split = [
        "variant",
        "run",
        "padded tokens per rank-step batchd / fixed",
        "busy ms per step batchd / fixed",
        "a: ms per step",
        "b: us per padded token",
        "a's share of a step batchd / fixed",
    ]
    med = {
        name: statistics.median([s["speedup"] for n, _, s, _ in results if n == name]) for name, _ in variants
    }
    machine = (
        f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPU(s), "
        f"{platform.machine()}"
    )
    first = {name: next(d for n, _, _, d in results if n == name) for name, _ in variants}
    dflt = first["default"]
    body = [
        "## `batchd demo`: end-to-end speedup over fixed batching",
        "",
        f"Generated by `{cmd}` ({wall:.0f} s in all; {revision()}; {machine}; "
        f"CPU idle {idle0:.0%} in the 3 s before, {idle1:.0%} in the 3 s after). "
        f"Each run is one `python -m batchd demo --json` (world size 2, the demo's defaults: 1024 samples, "
        "L=1024, policy balanced, window 128, depth 4; 2 gloo DDP trainer processes with 1 torch thread "
        "each); variant `default` is the command as is, `--synthetic` adds that flag (synthetic long-tail "
        "lengths, no Ray). Machine note: 2 shared cores, noisy; compare the ratios within one run.",
        "",
        "- **batchd wall s** / **fixed wall s**: the slowest trainer's epoch wall time (start of its data "
        "loop to its last step), batchd vs the same model on the same samples with fixed batching "
        "(DistributedSampler view, out-of-memory-safe batch size B = floor(L / longest)). Startup and "
        "teardown (process spawn, Ray, imports, gloo rendezvous) are excluded; **whole run s** is the "
        "whole command.",
        "- **speedup** = fixed / batchd wall time. **padded-token ratio** = tokens the baseline "
        "materialized / tokens batchd did (real tokens / padding efficiency). **stall**: share of a "
        "trainer's epoch spent waiting for its next batch (largest over ranks; the demo's "
        "`stall_fraction`).",
        "- **loss**: first -> last step's global per-token loss. Both paths see every sample once, but "
        "batchd takes fewer, larger optimizer steps, so the last-step losses are not a like-for-like "
        "quality comparison (same learning rate, no schedule).",
        "",
        table(headers, rows),
        "",
        "Median speedup: "
        + "; ".join(
            f"`{name}` **{med[name]:.2f}x** (runs: "
            + ", ".join(f"{s['speedup']:.2f}x" for n, _, s, _ in results if n == name)
            + ")"
            for name, _ in variants
        )
        + ".",
        "",
        "### Per-step vs per-token time",
        "",
        "Busy time (wall x (1 - stall)) of each path modelled as steps x (a + b x padded tokens per "
        "rank-step); the two paths of one run give a and b. `a` holds everything paid per step whatever "
        "its size: the gloo all-reduce of the gradients, AdamW, the Python loop, the batchd client, and the "
        "lower efficiency of small matmuls; `b` the compute per token (attention's T^2 term folds into both).",
        "",
        table(headers_split, rows_split),
        "",
        "### Why the tiny model is compute-bound, and where that stops",
        "",
        "The demo's model is tiny (~0.5M parameters: vocab 512, d_model 128, 2 layers, 4 heads). A step "
        "costs about 6 x 0.5M x padded tokens FLOPs, ~3 GFLOP for a full 1024-token step, i.e. ~100 ms on "
        "one CPU thread, while the per-step work that does not scale with tokens (a ~2 MB gloo all-reduce, "
        "AdamW over 0.5M parameters, Python) is small next to it. So a full step is "
        f"compute-bound: in the default variant a batchd step ({dflt['tok_b']:.0f} padded tokens) spends "
        f"~{1 - dflt['overhead_share_b']:.0%} of its time in per-token work, so batchd's wall time follows the "
        "padded tokens, which is what batching changes.",
        "",
        f"The fit puts the per-step overhead at ~{dflt['a_ms']:.0f} ms: small next to a full step, but "
        "not negligible for the baseline: its out-of-memory-safe batch "
        f"is tiny (B = floor(L / longest) samples, {dflt['tok_f']:.0f} padded tokens per step), so "
        f"`a` is ~{dflt['overhead_share_f']:.0%} of each of its steps, and it takes "
        f"{dflt['step_ratio']:.1f}x as many. The speedup is therefore larger than the padded-token ratio: "
        "batchd wins both on padding (fewer materialized tokens, visible when the baseline pads) and on "
        "step count (each fixed per-step cost is paid once per full budget instead of once per few "
        "samples). The split is a two-point fit of a simple model and moves with the machine's noise; "
        "the direction is stable.",
        "",
    ]
    publish(SECTION, body, args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
