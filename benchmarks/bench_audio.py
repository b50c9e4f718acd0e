"""`batchd bench` with vision and audio on the tiny MLLM: one phase against every encoder phase balanced.

On the first `--num-samples` samples of `benchmarks/workloads/audio-visual.csv` (images and audio clips,
docs/workloads.md), `batchd.bench.run_bench` trains `batchd-balanced` (one phase: each rank encodes its own
LLM samples' images and clips) and `batchd-2phase` (the vision and the audio phase each balanced per step,
one all-to-all per encoder) on 2 gloo ranks, `--repeats` interleaved runs each (the median-wall run is
reported, every run's wall time beside it). Both train the same steps (the LLM plan is the same), so the
losses must agree; the rows compare wall time, rank 0's vision-tower and audio-encoder shares of its time
(`batchd._train.models.VisionTimer` on each encoder), and the vision phase's per-step imbalance.

Result: benchmarks/results/bench-audio.json (template benchmarks/templates/bench-audio.md.j2).

Usage: python benchmarks/bench_audio.py [--num-samples 256] [--repeats 2] [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import add_common_args, command_line, finish  # noqa: E402

from batchd.bench import run_bench  # noqa: E402

SECTION = "bench-audio"
MEASURES = ("benchmarks/bench_audio.py", "batchd", "client", "core", "service")
WORKLOAD = Path(__file__).resolve().parent / "workloads" / "audio-visual.csv"
SYSTEMS = ("batchd-balanced", "batchd-2phase")
HEADERS = [
    "system",
    "wall s (median)",
    "runs (s)",
    "steps",
    "final loss",
    "vision tower share",
    "audio encoder share",
    "vision imbalance",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-samples", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    add_common_args(ap)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    summary = run_bench(
        workload=WORKLOAD,
        num_samples=args.num_samples,
        systems=list(SYSTEMS),
        depth=8,  # as recorded (the spec's default is 4)
        heldout=0,
        repeats=args.repeats,
        plots=False,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    rows, systems = [], summary["systems"]
    for name in SYSTEMS:
        r = systems[name]
        walls = ", ".join(f"{w:.1f}" for w in r.get("wall_s_runs", [r["wall_s"]]))
        rows.append(
            [
                name, r["wall_s"], walls, r["steps"], r["final_loss"], r.get("vision_share"),
                r.get("audio_share"), r.get("vision_imbalance"),
            ]
        )  # fmt: skip
    one, every = systems["batchd-balanced"], systems["batchd-2phase"]
    data = {
        "python": platform.python_version(),
        "wall_s": time.perf_counter() - t0,
        "headers": HEADERS,
        "rows": rows,
        "speedup": one["wall_s"] / every["wall_s"],
        "loss_gap": abs(one["final_loss"] - every["final_loss"]),
        "same_steps": one["steps"] == every["steps"],
        "samples": args.num_samples,
        "world_size": summary["world_size"],
        "token_budget": summary["token_budget"],
    }
    config = {"command": command_line("benchmarks/bench_audio.py", argv), "repeats": args.repeats}
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
