"""N encoder phases (OrchMLLM): each encoder (vision, audio) balanced on its own per step, beside the LLM.

On each workload with audio of `benchmarks/workloads/` (docs/workloads.md: `audio-visual`), at N in
(8, 64) ranks, 8 per node, `balanced`, L = 8,192, window 64, the LLM plan's rows (`simulate`, one row per
step: each rank's group) are planned for every encoder with `plan_phases` (`VisionCost`, `AudioCost`).
Per encoder, over the steps that hold its items:

- imbalance, mean over steps of max / mean rank encoder cost: **single** (each rank encodes its own LLM
  samples' items) and **planned**, beside two per-step lower bounds over C / N: `vision_bound` (an item is
  encoded whole on one rank) and `encoder_bound` (also counting which items fit beside the big ones);
- the plan's peak over each step's bounds: mean, and worst step for `encoder_bound` (the target's);
- at N <= 8, the exact optimum (`exact_placement`, a MILP through scipy's HiGHS) on `EXACT_STEPS` steps:
  plan / exact and exact / bound;
- items encoded off their LLM rank per step, intra- and cross-node.

Also the LLM phase's imbalance (the simulator's `llm_imbalance`) and the planning time of every encoder
of a step (`plan_phases`, the least of `TIMING_REPEATS` runs), mean and p99, at N and at 8 x N ranks
(rows of 8 consecutive steps side by side). The workload is repeated N / 8 times (ids stay distinct).
The result goes to benchmarks/results/encoder-phases.json (template: templates/encoder-phases.md.j2).

Usage: python benchmarks/encoder_phases.py [--workloads DIR] [--ranks 8 64] [--limit N] [--out PATH]
       [--print]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import add_common_args, command_line, finish  # noqa: E402
from phase_balance import (  # noqa: E402  (the same jobs, bounds and solver limits as phase-balance)
    BOUND_TOL,
    CONFIG,
    EXACT_LIMIT_S,
    EXACT_MAX_RANKS,
    EXACT_STEPS,
    LOCAL_RANKS,
    RANKS,
    WORKLOADS_DIR,
    exact_stats,
    least_time,
    p99,
    repeat,
)

from batchd import read_workload  # noqa: E402
from batchd.core import (  # noqa: E402
    AudioCost,
    JobSpec,
    Sample,
    VisionCost,
    encoder_bound,
    exchanged,
    imbalance,
    plan_phases,
    simulate,
)
from batchd.testing import EncoderCost, phase_loads, single_phase, vision_bound  # noqa: E402

SECTION = "encoder-phases"
MEASURES = ("benchmarks/encoder_phases.py", "core")
WORKLOADS = ("audio-visual",)
ENCODERS: tuple[EncoderCost, ...] = (VisionCost(), AudioCost())

HEADERS = [
    "workload",
    "N",
    "encoder",
    "steps with items",
    "items/step",
    "single",
    "planned",
    "bound whole",
    "bound",
    "over whole (mean)",
    "over bound (mean)",
    "over bound (worst)",
    "intra-node moved/step",
    "cross-node moved/step",
]
HEADERS_EXACT = [
    "workload",
    "N",
    "encoder",
    "steps",
    "proved optimal",
    "plan / exact",
    "max",
    "exact / bound",
]
OPTION_NODES = 100  # the exact option's branch-and-bound node budget per solve (`phase_exact_nodes`)
HEADERS_OPTION = ["workload", "N", "encoder", "steps", "plain over bound", "with exact option over bound"]
HEADERS_OPTION += ["plain ms/step", "with exact option ms/step"]
HEADERS_TIME = ["workload", "N", "LLM imbalance", "plan ms/step (all encoders)", "p99", "8N ranks ms", "p99"]


def encoder_stats(rows: Sequence[Sequence[Sequence[Sample]]], enc: EncoderCost, nodes: list[int]) -> dict:
    """Per-step balance of one encoder's phase over the steps that hold its items (module docstring)."""
    single, planned, bound, whole, over, over_whole, items = [], [], [], [], [], [], 0
    moved = {"intra": 0, "cross": 0}
    exact_rows, with_items = [], []
    for row in rows:
        costs = [enc.item(size) for g in row for s in g for size, _ in enc.items(s)]
        if not costs:
            continue
        ex = plan_phases(row, [enc], nodes)[enc.name]
        loads = phase_loads(ex, enc)
        mean = sum(costs) / len(row)
        single.append(imbalance(phase_loads(single_phase(row, enc), enc)) or 1.0)
        planned.append(max(loads) / mean)
        floor, pigeonhole = encoder_bound(costs, len(row)), vision_bound(costs, len(row))
        bound.append(floor / mean)
        whole.append(pigeonhole / mean)
        over.append(max(loads) / floor)
        over_whole.append(max(loads) / pigeonhole)
        items += len(costs)
        ex_moved = exchanged(ex, nodes)
        moved["intra"] += ex_moved["intra_node_images"]
        moved["cross"] += ex_moved["cross_node_images"]
        exact_rows.append((costs, max(loads)))
        with_items.append(row)
    steps = len(single)
    picked = with_items[:: max(1, len(with_items) // EXACT_STEPS)][:EXACT_STEPS]
    out = {
        "encoder": enc.name,
        "steps": steps,
        "items_per_step": items / max(steps, 1),
        "single": statistics.fmean(single) if steps else None,
        "planned": statistics.fmean(planned) if steps else None,
        "bound": statistics.fmean(bound) if steps else None,
        "whole": statistics.fmean(whole) if steps else None,
        "over_bound": statistics.fmean(over) if steps else None,
        "over_bound_max": max(over, default=None),
        "over_whole": statistics.fmean(over_whole) if steps else None,
        "intra_per_step": moved["intra"] / max(len(rows), 1),
        "cross_per_step": moved["cross"] / max(len(rows), 1),
        "exact": exact_gaps(exact_rows, len(nodes)) if len(nodes) <= EXACT_MAX_RANKS else None,
        "option": option_stats(picked, enc, nodes) if len(nodes) <= EXACT_MAX_RANKS else None,
    }
    out["bound_met"] = out["over_bound"] is not None and out["over_bound"] <= 1 + BOUND_TOL
    return out


def option_stats(rows: Sequence[Sequence[Sequence[Sample]]], enc: EncoderCost, nodes: list[int]) -> dict:
    """The planner with and without its exact option (`exact_nodes=OPTION_NODES`) on these steps: each
    plan's peak over the step's `encoder_bound` (means) and the seconds per step (least of 3 runs)."""
    over: dict[int, list[float]] = {0: [], OPTION_NODES: []}
    secs: dict[int, list[float]] = {0: [], OPTION_NODES: []}
    for row in rows:
        costs = [enc.item(size) for g in row for s in g for size, _ in enc.items(s)]
        floor = encoder_bound(costs, len(row))
        for k in over:
            ex = plan_phases(row, [enc], nodes, exact_nodes=k)[enc.name]
            over[k].append(max(phase_loads(ex, enc)) / floor)
            secs[k].append(least_time(lambda row=row, k=k: plan_phases(row, [enc], nodes, exact_nodes=k)))
    return {
        "steps": len(rows),
        "nodes": OPTION_NODES,
        "over_plain": statistics.fmean(over[0]) if rows else None,
        "over_option": statistics.fmean(over[OPTION_NODES]) if rows else None,
        "s_plain": statistics.fmean(secs[0]) if rows else None,
        "s_option": statistics.fmean(secs[OPTION_NODES]) if rows else None,
    }


def exact_gaps(rows: Sequence[tuple[list[float], float]], n: int) -> dict:
    """`exact_stats` on up to `EXACT_STEPS` evenly spaced steps (its items' costs, the plan's peak)."""
    return exact_stats(list(rows[:: max(1, len(rows) // EXACT_STEPS)][:EXACT_STEPS]), n)


def plan_ms(rows: Sequence[Sequence[Sequence[Sample]]], side_by_side: int) -> list[float]:
    """`plan_phases` ms per step on rows of `side_by_side` consecutive steps' rows side by side."""
    out = []
    for k in range(0, len(rows) - side_by_side + 1, side_by_side):
        wide = [g for row in rows[k : k + side_by_side] for g in row]
        nodes = [r // LOCAL_RANKS for r in range(len(wide))]
        out.append(least_time(lambda wide=wide, nodes=nodes: plan_phases(wide, ENCODERS, nodes)) * 1e3)
    return out


def measure(name: str, samples: Sequence[Sample], n: int) -> dict:
    data = repeat(samples, max(1, n // 8))
    spec = JobSpec(world_size=n, **CONFIG)
    rows: list[list[tuple[Sample, ...]]] = []
    result = simulate(
        data, spec, on_step=lambda step: rows.append([s.samples for s in step]), local_ranks=LOCAL_RANKS
    )
    assert result["missing"] == 0 and result["duplicates"] == 0, result
    nodes = [r // LOCAL_RANKS for r in range(n)]
    per_step, wide = plan_ms(rows, 1), plan_ms(rows, 8) if n == max(RANKS) else []
    return {
        "workload": name,
        "N": n,
        "steps": len(rows),
        "llm": result["llm_imbalance"],
        "encoders": [encoder_stats(rows, enc, nodes) for enc in ENCODERS],
        "plan_ms": statistics.fmean(per_step),
        "plan_ms_p99": p99(per_step),
        "wide_ms": statistics.fmean(wide) if wide else None,
        "wide_ms_p99": p99(wide) if wide else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", type=Path, default=WORKLOADS_DIR)
    ap.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    ap.add_argument("--limit", type=int, default=None, help="first N samples of each workload (smoke runs)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = []
    for name in WORKLOADS:
        samples = read_workload(args.workloads / f"{name}.csv")[: args.limit]
        for n in args.ranks:
            results.append(measure(name, samples, n))
            print(f"{name} N={n} done", file=sys.stderr, flush=True)
    rows, rows_exact, rows_time, rows_option = [], [], [], []
    for x in results:
        for e in x["encoders"]:
            rows.append(
                [
                    x["workload"], x["N"], e["encoder"], e["steps"], e["items_per_step"], e["single"],
                    e["planned"], e["whole"], e["bound"], e["over_whole"], e["over_bound"],
                    e["over_bound_max"], e["intra_per_step"], e["cross_per_step"],
                ]
            )  # fmt: skip
            if (g := e["exact"]) is not None:
                rows_exact.append(
                    [
                        x["workload"], x["N"], e["encoder"], g["steps"], g["proved"], g["plan_over_exact"],
                        g["plan_over_exact_max"], g["exact_over_bound"],
                    ]
                )  # fmt: skip
            if (o := e["option"]) is not None:
                rows_option.append(
                    [x["workload"], x["N"], e["encoder"], o["steps"], o["over_plain"], o["over_option"]]
                    + [o["s_plain"] * 1e3, o["s_option"] * 1e3]
                )
        rows_time.append(
            [x["workload"], x["N"], x["llm"], x["plan_ms"], x["plan_ms_p99"], x["wide_ms"], x["wide_ms_p99"]]
        )
    data = {
        "python": platform.python_version(),
        "wall_s": time.perf_counter() - t0,
        "headers": HEADERS,
        "rows": rows,
        "headers_exact": HEADERS_EXACT,
        "rows_exact": rows_exact,
        "headers_option": HEADERS_OPTION,
        "rows_option": rows_option,
        "headers_time": HEADERS_TIME,
        "rows_time": rows_time,
        "results": results,
    }
    config = {
        "command": command_line("benchmarks/encoder_phases.py", argv),
        "spec": sorted(CONFIG.items()),
        "local_ranks": LOCAL_RANKS,
        "encoders": [repr(e) for e in ENCODERS],
        "bound_tol": BOUND_TOL,
        "exact_steps": EXACT_STEPS,
        "exact_limit_s": EXACT_LIMIT_S,
        "option_nodes": OPTION_NODES,
    }
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
