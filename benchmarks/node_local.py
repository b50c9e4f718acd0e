"""Node-local rounds: `balanced` node-blind vs node-local (the default) under packed and attention cost.

Runs `batchd.core.simulate` with the same topology (`local_ranks=8`: rank r on node r // 8) twice per
workload and configuration: node-blind (`nodes="blind"`, its moves counted under the topology) and
node-local (`nodes="local"`, the default: each round planned per node where that costs as node-blind,
docs/design/balancing.md "Node-local rounds"). Records benchmarks/results/node-local.json (template:
benchmarks/templates/node-local.md.j2).

Configurations (packed cost, 8 ranks per node, L=8192, depth 4, join mode):
- 64 ranks, window 64, each workload file (4,096 lengths) repeated 16x: 1,024 samples per rank, 16
  windows; in file order and shuffled.
- 1,024 ranks, file order (odb-synthetic and sharegpt4o-like): window 32 (a node's window holds 256
  samples) with the file repeated 64x (2 windows per rank) and, odb-synthetic only, 128x (4 windows);
  window 64 (512 samples per node) repeated 256x (4 windows per rank).

- Attention cost, 64 ranks, window 64, file order, x16, over `ATTENTION_SEEDS` seeds: one run moves by
  an outlier step from seed to seed, so the mean is judged (node-blind's own spread is reported).

Targets (issue 25): >= 5x fewer cross-node samples than node-blind at no more than +0.01
compute_vs_limit.

Usage: python benchmarks/node_local.py [--workloads DIR] [--quick] [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import DEFAULT_WORKLOADS, add_common_args, command_line, finish, machine  # noqa: E402

from batchd import read_lengths  # noqa: E402
from batchd.core import JobSpec, simulate  # noqa: E402

SECTION = "node-local"
MEASURES = ("benchmarks/node_local.py", "core")
LOCAL_RANKS = 8
BASE = {"token_budget": 8192, "depth": 4, "mode": "join", "policy": "balanced"}
ALL = ("odb-synthetic", "sharegpt4o-like", "llava-like", "ultrachat-like")
LARGE = ("odb-synthetic", "sharegpt4o-like")
# (world size, window, repeat, cost, shuffle, workloads)
CONFIGS = (
    (64, 64, 16, "packed", False, ALL),
    (64, 64, 16, "packed", True, ALL),
    (1024, 32, 64, "packed", False, LARGE),
    (1024, 32, 128, "packed", False, ("odb-synthetic",)),
    (1024, 64, 256, "packed", False, LARGE),
)
CVL_TOLERANCE = 0.01
CROSS_RATIO = 5.0
# attention cost: its over-budget outliers (sharegpt4o-like's 16,000 tokens cost 78,500) make one run's
# compute_vs_limit move by one outlier step from seed to seed (node-blind's own spread is shown): the
# targets are judged on the mean over these seeds, at 64 ranks, window 64, file order, file x16
ATTENTION_SEEDS = 10
ATTENTION = (64, 64, 16, "attention", False, ALL)

HEADERS = [
    "workload",
    "N",
    "window",
    "cost",
    "order",
    "plan",
    "steps",
    "rounds",
    "node-local rounds",
    "cvl",
    "cross-node",
    "cross MB",
    "plan s/round",
]


def _row(name: str, config: tuple, label: str, m: dict) -> list[object]:
    n, window, _, cost, shuffle, _ = config
    return [
        name,
        n,
        window,
        cost,
        "shuffled" if shuffle else "file",
        label,
        m["steps"],
        m["rounds"],
        m["node_local_rounds"],
        m["compute_vs_limit"],
        m["cross_node_moved"],
        m["cross_node_bytes"] / 1e6,
        m["plan_per_round_s"],
    ]


def measure(workloads: Path, configs: Sequence[tuple]) -> dict:
    """Both plans per workload and configuration: the table's rows and the targets' figures."""
    rows, verdicts = [], []
    for config in configs:
        n, window, repeat, cost, shuffle, names = config
        spec = JobSpec.from_keys(world_size=n, window=window, cost=cost, shuffle=shuffle, **BASE)
        for name in names:
            lengths = read_lengths(str(workloads / f"{name}.txt")) * repeat
            blind = simulate(lengths, spec.replace(nodes="blind"), local_ranks=LOCAL_RANKS)
            local = simulate(lengths, spec, local_ranks=LOCAL_RANKS)
            for label, m in (("node-blind", blind), ("node-local", local)):
                assert m["missing"] == m["duplicates"] == 0, (name, label, m["missing"], m["duplicates"])
                rows.append(_row(name, config, label, m))
            d_cvl = local["compute_vs_limit"] - blind["compute_vs_limit"]
            cross = local["cross_node_moved"]
            ratio = blind["cross_node_moved"] / cross if cross else None  # None: no sample crossed
            verdicts.append(
                {
                    "workload": name,
                    "config": _row(name, config, "", local)[1:5],
                    "d_cvl": d_cvl,
                    "cvl_met": d_cvl <= CVL_TOLERANCE,
                    "cross_ratio": ratio,
                    "cross_met": ratio is None or ratio >= CROSS_RATIO,
                    "local_share": local["node_local_rounds"] / max(local["rounds"], 1),
                }
            )
            print(name, config[:5], f"d_cvl {d_cvl:+.4f} cross ratio {ratio}", file=sys.stderr, flush=True)
    return {"headers": HEADERS, "rows": rows, "verdicts": verdicts}


def measure_seeds(workloads: Path, config: tuple, seeds: int) -> list[dict]:
    """Per workload, node-blind and node-local over `seeds` seeds: mean compute_vs_limit of each, the
    spread (population standard deviation) of node-blind's, and the cross-node samples summed."""
    n, window, repeat, cost, shuffle, names = config
    out = []
    for name in names:
        lengths = read_lengths(str(workloads / f"{name}.txt")) * repeat
        b_cvl, l_cvl, b_cross, l_cross, d = [], [], 0, 0, []
        for seed in range(seeds):
            spec = JobSpec.from_keys(
                world_size=n, window=window, cost=cost, shuffle=shuffle, seed=seed, **BASE
            )
            blind = simulate(lengths, spec.replace(nodes="blind"), local_ranks=LOCAL_RANKS)
            local = simulate(lengths, spec, local_ranks=LOCAL_RANKS)
            for m in (blind, local):
                assert m["missing"] == m["duplicates"] == 0, (name, seed, m["missing"], m["duplicates"])
            b_cvl.append(blind["compute_vs_limit"])
            l_cvl.append(local["compute_vs_limit"])
            d.append(local["compute_vs_limit"] - blind["compute_vs_limit"])
            b_cross += blind["cross_node_moved"]
            l_cross += local["cross_node_moved"]
        d_mean = statistics.mean(d)
        ratio = b_cross / l_cross if l_cross else None
        out.append(
            {
                "workload": name,
                "blind_cvl": statistics.mean(b_cvl),
                "blind_sd": statistics.pstdev(b_cvl),
                "local_cvl": statistics.mean(l_cvl),
                "d_cvl": d_mean,
                "d_min": min(d),
                "d_max": max(d),
                "cross_ratio": ratio,
                "cvl_met": d_mean <= CVL_TOLERANCE,
                "cross_met": ratio is None or ratio >= CROSS_RATIO,
            }
        )
        print(name, "attention", f"mean d_cvl {d_mean:+.4f} cross ratio {ratio}", file=sys.stderr, flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workloads",
        type=Path,
        default=DEFAULT_WORKLOADS,
        help=f"folder of *.txt length files (default {DEFAULT_WORKLOADS})",
    )
    ap.add_argument("--quick", action="store_true", help="the 64-rank configurations only")
    add_common_args(ap)
    args = ap.parse_args(argv)
    configs = [c for c in CONFIGS if not args.quick or c[0] == 64]
    missing = sorted({w for c in configs for w in c[5] if not (args.workloads / f"{w}.txt").exists()})
    if missing:
        print(f"missing workloads {missing} in {args.workloads}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    data = measure(args.workloads, configs)
    data["attention"] = measure_seeds(args.workloads, ATTENTION, ATTENTION_SEEDS)
    data["wall_s"] = time.perf_counter() - t0
    data["machine"] = machine()
    config = {**BASE, "local_ranks": LOCAL_RANKS, "configs": [list(c[:5]) + [list(c[5])] for c in configs]}
    config.update(cvl_tolerance=CVL_TOLERANCE, cross_ratio=CROSS_RATIO)
    config.update(attention=list(ATTENTION[:5]), attention_seeds=ATTENTION_SEEDS)
    config["command"] = command_line(__file__, argv)
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
