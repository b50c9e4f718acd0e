"""Two-phase (OrchMLLM) balancing: per-phase imbalance, single-phase vs two-phase, at 8 and 64 ranks.

For each multimodal workload of `benchmarks/workloads/` (docs/workloads.md) and N in (8, 64) ranks,
8 per node (`local_ranks=8`), `balanced`, L = 8,192, runs `batchd.core.simulate` twice with the same
spec but `phases` 1 and 2 (the LLM plan is the same; phases=2 adds the vision exchange), and reports:

- vision-phase imbalance, mean over steps of max / mean rank encoder cost (`VisionCost`), single-phase
  (each rank encodes its own LLM samples' images) and two-phase (`plan_vision`), beside two per-step
  lower bounds no plan can beat: max(C / N, max c) / (C / N), and `vision_bound` / (C / N), which also
  counts that images are whole (of the kN + 1 costliest, some rank encodes k + 1);
- the same for the planner as first committed (6f10cec: keep-first greedy only, first fitting slack cap,
  no bisection; replayed with `core._phases` internals on the same rows), with its exchanged images;
- LLM-phase imbalance (max / mean of the job's `CostModel` per rank) of both runs;
- embeddings the two-phase plan exchanges per step, intra- and cross-node (images and rows);
- planning time of `plan_vision` per step (mean and p99, re-timed on every step's row, the least of
  `TIMING_REPEATS` runs) and of
  `plan_vision_round` per round (timed inside the simulator).

The workload is repeated (ids stay distinct) so that 64 ranks get as many steps as 8. Targets (the
issue's): two-phase <= 1.05 in both phases, and the LLM phase no worse than single-phase by > 0.01.
Results go to docs/benchmarks.md between `<!-- phase-balance:begin -->` and `<!-- phase-balance:end -->`.

Usage: python benchmarks/phase_balance.py [--workloads DIR] [--docs FILE] [--no-write] [--ranks 8 64]
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _mdsection import DOCS, publish, revision, table

from batchd import read_workload
from batchd.core import JobSpec, Sample, _phases, imbalance, plan_vision, simulate
from batchd.core._phases import ACCEPT

SECTION = "phase-balance"
WORKLOADS_DIR = Path(__file__).resolve().parent / "workloads"
WORKLOADS = ("llava-like", "sharegpt4o-like", "bimodal")
RANKS = (8, 64)
LOCAL_RANKS = 8
CONFIG = {
    "token_budget": 8192,
    "window": 64,
    "depth": 4,
    "cost": "padded",
    "mode": "join",
    "policy": "balanced",
    "shuffle": False,
}
TARGET, LLM_TOLERANCE = 1.05, 0.01
TIMING_REPEATS = 3  # plan times: the least of this many runs per step

HEADERS = [
    "workload",
    "N",
    "steps",
    "img/step",
    "vision 1-phase",
    "vision 2-phase",
    "bound max(C/N,c)",
    "bound whole",
    "LLM 1-phase",
    "LLM 2-phase",
    "intra img/step",
    "cross img/step",
    "intra rows/step",
    "cross rows/step",
    "plan ms/step",
    "p99 ms/step",
]


def repeat(samples: Sequence[Sample], times: int) -> list[Sample]:
    """`times` copies of the workload, ids renumbered 0, 1, ... (the simulator's sample ids)."""
    n = len(samples)
    return [s.replace(id=k * n + s.id) for k in range(times) for s in samples]


def before(row: Sequence[Sequence[Sample]], spec: JobSpec, nodes: list[int]) -> tuple[list[float], list[int]]:
    """Rank loads and [intra, cross]-node exchanged images of the planner as first committed (keep-first
    greedy, first fitting cap max(C / N, max c) x (1 + slack), LPT fallback) on one step's row."""
    images = _phases._images(row)
    cost = spec.vision_cost()
    costs = [cost.image(im.patches) for im in images]
    order = sorted(range(len(images)), key=lambda i: -costs[i])
    where = None
    if images:
        floor = max(sum(costs) / len(row), max(costs))
        for slack in _phases.SLACKS:
            where = _phases._greedy(images, costs, nodes, floor * (1.0 + slack), order, True)
            if where is not None:
                break
        else:
            where = _phases._lpt(images, costs, nodes)
    loads = [0.0] * len(row)
    moved = [0, 0]
    for im, r, c in zip(images, where or [], costs, strict=True):
        loads[r] += c
        if r != im.owner:
            moved[nodes[r] != nodes[im.owner]] += 1
    return loads, moved


def step_plans(samples: Sequence[Sample], spec: JobSpec) -> tuple[list[float], dict]:
    """Wall seconds of `plan_vision` on every step's row of the two-phase run (the coordinator's input:
    each rank's group at that step, the node topology), and the first-committed planner's mean vision
    imbalance and exchanged images per step on the same rows (`before`)."""
    nodes = [r // LOCAL_RANKS for r in range(spec.world_size)]
    cost = spec.vision_cost()
    rows: list[list[tuple[Sample, ...]]] = []
    simulate(
        samples, spec, on_step=lambda step: rows.append([s.samples for s in step]), local_ranks=LOCAL_RANKS
    )
    times, plain, moved, old_s = [], [], [0, 0], 0.0
    for row in rows:
        best = math.inf
        for _ in range(TIMING_REPEATS):  # the least of a few runs: the machine may be shared
            t0 = time.perf_counter()
            plan_vision(row, cost, nodes)
            best = min(best, time.perf_counter() - t0)
        times.append(best)
        best = math.inf
        for _ in range(TIMING_REPEATS):
            t0 = time.perf_counter()
            loads, m = before(row, spec, nodes)
            best = min(best, time.perf_counter() - t0)
        old_s += best
        if (value := imbalance(loads)) is not None:
            plain.append(value)
        moved = [moved[0] + m[0], moved[1] + m[1]]
    steps = max(len(rows), 1)
    return times, {
        "vision": statistics.fmean(plain) if plain else None,
        "intra": moved[0] / steps,
        "cross": moved[1] / steps,
        "plan_ms": old_s / steps * 1e3,
    }


def measure(name: str, samples: Sequence[Sample], n: int) -> dict:
    times = max(1, n // 8)
    data = repeat(samples, times)
    spec = JobSpec(world_size=n, **CONFIG)
    one = simulate(data, spec, local_ranks=LOCAL_RANKS)
    two = simulate(data, spec.replace(phases=2), local_ranks=LOCAL_RANKS)
    assert one["steps"] == two["steps"] and one["missing"] == two["missing"] == 0, (one, two)
    plan, old = step_plans(data, spec.replace(phases=2))
    plan_ms = sorted(t * 1e3 for t in plan)
    p99 = plan_ms[min(len(plan_ms) - 1, int(0.99 * len(plan_ms)))]
    return {
        "workload": name,
        "N": n,
        "repeat": times,
        "steps": two["steps"],
        "img_per_step": two["images"] / max(two["vision_steps"], 1),
        "vision_single": one["vision_imbalance_single"],
        "vision_two": two["vision_imbalance_two"],
        "vision_bound": two["vision_bound"],
        "vision_whole": two["vision_bound_pigeonhole"],
        "old": old,
        "llm_single": one["llm_imbalance"],
        "llm_two": two["llm_imbalance"],
        "intra_images": two["exchanged_intra_node_images_per_step"],
        "cross_images": two["exchanged_cross_node_images_per_step"],
        "intra_rows": two["exchanged_intra_node_rows_per_step"],
        "cross_rows": two["exchanged_cross_node_rows_per_step"],
        "plan_ms": statistics.fmean(plan_ms),
        "plan_p99_ms": p99,
        "plan_round_ms": two["vision_plan_per_round_s"] * 1e3,
    }


def verdict(r: dict) -> str:
    vision = "met" if r["vision_two"] <= TARGET else "missed"
    llm_ok = r["llm_two"] <= r["llm_single"] + LLM_TOLERANCE
    return (
        f"vision <= {TARGET}: {vision} ({r['vision_two']:.3f}; bound {r['vision_whole']:.3f}); "
        f"LLM <= {TARGET}: {'met' if r['llm_two'] <= TARGET else 'missed'} ({r['llm_two']:.3f}); "
        f"LLM no worse than 1-phase + {LLM_TOLERANCE}: {'met' if llm_ok else 'missed'}"
    )


def render(results: Sequence[dict], seconds: float) -> list[str]:
    rows = [
        [
            r["workload"],
            r["N"],
            r["steps"],
            f"{r['img_per_step']:.0f}",
            r["vision_single"],
            r["vision_two"],
            r["vision_bound"],
            r["vision_whole"],
            r["llm_single"],
            r["llm_two"],
            f"{r['intra_images']:.1f}",
            f"{r['cross_images']:.1f}",
            f"{r['intra_rows']:.0f}",
            f"{r['cross_rows']:.0f}",
            f"{r['plan_ms']:.2f}",
            f"{r['plan_p99_ms']:.2f}",
        ]
        for r in results
    ]
    old = [
        [
            r["workload"],
            r["N"],
            r["old"]["vision"],
            r["vision_two"],
            r["vision_whole"],
            f"{r['old']['intra']:.1f}",
            f"{r['intra_images']:.1f}",
            f"{r['old']['cross']:.1f}",
            f"{r['cross_images']:.1f}",
            f"{r['old']['plan_ms']:.2f}",
            f"{r['plan_ms']:.2f}",
        ]
        for r in results
    ]
    cfg = ", ".join(f"{k}={v}" for k, v in CONFIG.items())
    lines = [
        "## Two-phase balancing (vision encoder + LLM)",
        "",
        (
            f"`python benchmarks/phase_balance.py` ({revision()}, {platform.python_implementation()} "
            f"{platform.python_version()}, {seconds:.0f} s). Workloads: `benchmarks/workloads/*.csv` "
            f"(docs/workloads.md), repeated N / 8 times; {LOCAL_RANKS} ranks per node; {cfg}; vision cost "
            f"patches + patches^2 / {JobSpec(world_size=1, token_budget=1).vision_quadratic} per image."
        ),
        "",
        (
            "Imbalance = mean over steps of max / mean rank cost (1.0 = every rank equally loaded); the vision "
            "means skip steps without images. Bounds (means over steps of a per-step lower bound / (C / N); no "
            "plan can beat them): **max(C/N,c)** = max(C / N, max c); **whole** = `vision_bound`, which adds "
            "that an image is encoded whole on one rank (of the kN + 1 costliest images some rank encodes "
            "k + 1). The LLM plan is the same in "
            "both runs, so its two columns must agree. Exchanged: images (and embedding rows = image tokens) "
            "encoded on another rank than their LLM sample's, per step. plan ms/step: `plan_vision` on each "
            f"step's row (the least of {TIMING_REPEATS} runs), mean and p99."
        ),
        "",
        table(HEADERS, rows),
        "",
        (
            "The planner before and after this section's change (`core/_phases.py`), on the same steps: "
            "**before** = as first committed (keep-first greedy, first fitting `SLACKS` cap); **after** = "
            "bisection of the cap between the last failing and first fitting slack, and a one-pass greedy "
            "(LPT order, own rank first) searched the same way unless keep-first is already within `ACCEPT` "
            f"({ACCEPT:.0%}) of the bound, the plan of lower peak kept (ties: keep-first)."
        ),
        "",
        table(
            [
                "workload",
                "N",
                "vision before",
                "vision after",
                "bound whole",
                "intra img before",
                "intra img after",
                "cross img before",
                "cross img after",
                "plan ms before",
                "plan ms after",
            ],
            old,
        ),
        "",
        f"Targets (two-phase <= {TARGET} in both phases; LLM no worse than single-phase by > {LLM_TOLERANCE}):",
        "",
    ]
    lines += [f"- {r['workload']}, N={r['N']}: {verdict(r)}" for r in results]
    lines += ["", "Findings:", ""]
    for r in results:
        if r["vision_two"] > TARGET and r["vision_whole"] > TARGET:
            lines.append(
                f"- {r['workload']}, N={r['N']}: the vision target is out of reach, not missed by the "
                f"planner: the mean lower bound is already {r['vision_whole']:.3f} > {TARGET} (whole "
                f"images: {r['img_per_step']:.0f} images per step on {r['N']} ranks, so some rank "
                f"encodes one more image than the mean), and the plan is at "
                f"{r['vision_two'] - r['vision_whole']:+.3f} from it."
            )
        elif r["vision_two"] > TARGET:
            lines.append(
                f"- {r['workload']}, N={r['N']}: vision missed with the bound at {r['vision_whole']:.3f}: "
                f"the planner leaves {r['vision_two'] - r['vision_whole']:.3f} on the table."
            )
    llm_missed = [
        f"{r['workload']} N={r['N']} ({r['llm_two']:.3f})" for r in results if r["llm_two"] > TARGET
    ]
    same = all(r["llm_two"] == r["llm_single"] for r in results)
    if llm_missed:
        lines.append(
            f"- LLM phase above {TARGET}: {', '.join(llm_missed)}. Two-phase balancing does not change "
            f"the LLM plan ({'identical' if same else 'NOT identical'} columns): this is the `balanced` "
            "plan's own per-step spread under the padded cost model (whole samples, a round's "
            "groups dealt to ranks), the same with phases=1; it is outside the vision planner's reach."
        )
    lines.append(
        "- The after planner exchanges more images than the before one where it matters (sharegpt4o-like: "
        "the one-pass greedy wins most steps and moves about twice as many, cross-node too) and plans "
        "slower (two greedy searches and the bisection). Without `ACCEPT` it also took the one-pass plan "
        "on bimodal for 1.016 -> 1.008 at 2.3x the cross-node images and 4x the plan time; with it, a "
        "keep-first plan within 2% of the bound stands. Plan ms columns: `plan_vision` per step, before "
        "replayed from `core._phases` internals, with today's heap-based greedy, so faster than the code "
        "as first committed."
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workloads",
        type=Path,
        default=WORKLOADS_DIR,
        help=f"folder of the *.csv workloads (default {WORKLOADS_DIR})",
    )
    ap.add_argument("--docs", type=Path, default=DOCS, help=f"Markdown file to update (default {DOCS})")
    ap.add_argument(
        "--ranks", type=int, nargs="+", default=list(RANKS), help=f"world sizes (default {RANKS})"
    )
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = []
    for name in WORKLOADS:
        samples = read_workload(args.workloads / f"{name}.csv")
        for n in args.ranks:
            r = measure(name, samples, n)
            print(
                f"{name} N={n}: {verdict(r)}; plan {r['plan_ms']:.2f} ms/step (p99 {r['plan_p99_ms']:.2f})",
                file=sys.stderr,
            )
            results.append(r)
    publish(SECTION, render(results, time.perf_counter() - t0), args.no_write, args.docs, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
