"""Pipeline microbatches: how evenly M microbatches of one pipeline step cost, three ways.

Runs `batchd.core.Simulator` over odb-synthetic (8 ranks, balanced policy, packed layout, attention-aware
cost q=4096, window 512) and reports, per rank and pipeline step, the imbalance max/mean - 1 of its M
microbatches' costs (attention cost sum of len + len^2/q; an empty microbatch costs 0), for M = 2, 4, 8:

- `steps`: each microbatch is one batchd step of budget L (`batchd.client.pipeline_steps`: M consecutive
  steps make one pipeline step; the balanced policy makes every step cost about L on every rank);
- `split`: one batchd step of budget M x L split by `batchd.core.balanced_split`
  (`batchd.client.microbatches`);
- `chunks`: that step split by count, as a pipeline schedule does by default (`torch.chunk` of the rows
  in the step's order: `batchd.testing.chunk_split`).

For `steps`, each rank's last pipeline step of the epoch, when the epoch's step count is not a multiple of
M, holds fewer than M batchd steps (`pipeline_steps` fills it with zero-weight IDLE steps): one per rank
per epoch, left out of the figures. The table gives the mean, the 95th percentile and the share of
pipeline steps within 5%.

Usage: python benchmarks/microbatch_balance.py [--workloads DIR] [--limit N] [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import DEFAULT_WORKLOADS, add_common_args, command_line, finish  # noqa: E402

from batchd.core import CostModel, JobSpec, PolicySpec, Simulator, balanced_split  # noqa: E402
from batchd.testing import chunk_split  # noqa: E402

SECTION = "microbatch"
MEASURES = ("benchmarks/microbatch_balance.py", "core", "client")

MICRO_BUDGET = 8192  # L: one microbatch's budget
MICRO = (2, 4, 8)
COST = CostModel("attention", 4096)


def imbalance(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean - 1 if mean else 0.0


def _spec(budget: int) -> JobSpec:
    return JobSpec(
        world_size=8,
        token_budget=budget,
        seed=0,
        policy=PolicySpec(name="balanced", window=512, depth=8, collate="packed"),
        cost=CostModel(name="attention"),
    )


def _stats(xs: list[float]) -> list[str]:
    xs = sorted(xs)
    return [
        f"{100 * sum(xs) / len(xs):.2f}%",
        f"{100 * xs[int(0.95 * (len(xs) - 1))]:.2f}%",
        f"{100 * sum(x <= 0.05 for x in xs) / len(xs):.1f}%",
    ]


def run(lengths: list[int]) -> list[list[str]]:
    rows = []
    per_rank: list[list[float]] = [[] for _ in range(8)]
    for steps in Simulator(lengths, _spec(MICRO_BUDGET)):
        for r, step in enumerate(steps):
            per_rank[r].append(COST.cost([s.length for s in step.samples]) if step.samples else 0.0)
    for m in MICRO:
        windows = [c[i : i + m] for c in per_rank for i in range(0, len(c) - m + 1, m)]  # full ones
        rows.append(
            ["steps", str(MICRO_BUDGET), str(m), str(len(windows)), *_stats([imbalance(w) for w in windows])]
        )
        print(" | ".join(rows[-1]), flush=True)
        steps = [
            [COST.item(s.length) for s in step.samples]
            for per in Simulator(lengths, _spec(m * MICRO_BUDGET))
            for step in per
        ]
        for name, split in (("split", balanced_split), ("chunks", lambda c, m: chunk_split(len(c), m))):
            got = [imbalance([sum(c[i] for i in p) for p in split(c, m)]) for c in steps]
            rows.append([name, str(m * MICRO_BUDGET), str(m), str(len(steps)), *_stats(got)])
            print(" | ".join(rows[-1]), flush=True)
    return rows


HEADERS = ["microbatches", "batchd step budget", "M", "pipeline steps (x ranks)", "imbalance: mean"]
HEADERS += ["p95", "<= 5%"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    ap.add_argument("--limit", type=int, default=None, help="use only the first N lengths (smoke runs)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in (args.workloads / "odb-synthetic.txt").read_text().split()][: args.limit]
    t0 = time.perf_counter()
    data = {"headers": HEADERS, "rows": run(lengths), "samples": len(lengths)}
    data["wall_s"] = time.perf_counter() - t0
    config = {"workloads": str(args.workloads), "limit": args.limit, "world_size": 8, "window": 512}
    config.update(micro_budget=MICRO_BUDGET, micro=MICRO, cost=COST.name, attention_q=COST.quadratic)
    config["command"] = command_line(__file__, argv)
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
