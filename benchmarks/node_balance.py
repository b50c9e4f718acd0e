"""Node-aware balancing at scale: `balanced` node-blind vs node-aware on 1,024 ranks, 8 per node.

Runs `batchd.core.simulate` twice per workload with the same topology (`local_ranks=8`: rank r on node
r // 8, 128 nodes): once node-blind (`node_aware=False`, today's plan, its moves counted under the
topology) and once node-aware, and writes the table into docs/benchmarks.md between
`<!-- node-balance:begin -->` and `<!-- node-balance:end -->` (printing it too).

Workloads: odb-synthetic and sharegpt4o-like from the workloads folder. Each holds 4,096 lengths, i.e.
4 samples per rank at 1,024 ranks, so the file is repeated `--repeat` times (ids stay distinct) to give
every rank a few windows. Targets (the issue's): compute_vs_limit within 0.02 of node-blind, and >= 5x
fewer cross-node moved samples.

Usage: python benchmarks/node_balance.py [--workloads DIR] [--docs FILE] [--no-write] [--repeat R]
       [--window W]

`--window W` (other than 32) writes its own section, `node-balance-w<W>`, so the default run's stays.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _mdsection import DEFAULT_WORKLOADS, DOCS, publish, revision, table

from batchd import read_lengths
from batchd.core import CostModel, Entry, JobSpec, Sample, form_groups, simulate

SECTION = "node-balance"
WORKLOADS = ("odb-synthetic", "sharegpt4o-like")
LOCAL_RANKS = 8
CONFIG = {
    "world_size": 1024,
    "token_budget": 8192,
    "window": 32,
    "depth": 4,
    "cost": "padded",
    "mode": "join",
    "policy": "balanced",
    "shuffle": False,
}
REPEAT = 16
CVL_TOLERANCE = 0.02
CROSS_RATIO = 5.0

HEADERS = [
    "workload",
    "plan",
    "steps",
    "rounds",
    "cvl",
    "moved",
    "intra-node",
    "cross-node",
    "cross MB",
    "intra MB",
    "swaps",
    "fallback",
    "plan s/round",
]


def padding(lengths: Sequence[int]) -> tuple[float, float]:
    """Padding efficiency (real / padded tokens) of the first window (`window` samples per rank, file
    order) grouped under L pooled, and grouped per node (node-pure groups)."""
    n, k, w = CONFIG["world_size"], LOCAL_RANKS, CONFIG["window"]
    cost = CostModel(CONFIG["cost"])
    entries = [Entry(Sample(i, lengths[i], -1, i % n), 0) for i in range(min(len(lengths), n * w))]
    per_node: dict[int, list[Entry]] = {}
    for e in entries:
        per_node.setdefault(e.sample.home_rank // k, []).append(e)

    def efficiency(groups: list) -> float:
        real = sum(e.sample.length for g in groups for e in g)
        return real / sum(cost.cost([e.sample.length for e in g]) for g in groups)

    budget = CONFIG["token_budget"]
    return (
        efficiency(form_groups(entries, budget, cost)),
        efficiency([g for x in per_node.values() for g in form_groups(x, budget, cost)]),
    )


def run(lengths: Sequence[int], aware: bool) -> dict:
    return simulate(lengths, JobSpec(**CONFIG), local_ranks=LOCAL_RANKS, node_aware=aware)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workloads",
        type=Path,
        default=DEFAULT_WORKLOADS,
        help=f"folder of *.txt length files (default {DEFAULT_WORKLOADS})",
    )
    ap.add_argument("--docs", type=Path, default=DOCS, help=f"Markdown file to update (default {DOCS})")
    ap.add_argument("--repeat", type=int, default=REPEAT, help=f"copies of each workload (default {REPEAT})")
    ap.add_argument(
        "--window",
        type=int,
        default=CONFIG["window"],
        help=f"samples a rank buffers (default {CONFIG['window']}; another value writes section "
        f"{SECTION}-w<W>)",
    )
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    CONFIG["window"] = args.window
    section = SECTION if args.window == 32 else f"{SECTION}-w{args.window}"
    cmd = (
        "python benchmarks/node_balance.py"
        + ("" if args.repeat == REPEAT else f" --repeat {args.repeat}")
        + ("" if section == SECTION else f" --window {args.window}")
    )
    t0 = time.perf_counter()
    rev = revision()
    rows, verdicts = [], []
    for name in WORKLOADS:
        path = args.workloads / f"{name}.txt"
        if not path.exists():
            print(f"missing workload {path}", file=sys.stderr)
            return 2
        lengths = read_lengths(str(path)) * args.repeat
        blind, aware = run(lengths, False), run(lengths, True)
        for label, m in (("node-blind", blind), ("node-aware", aware)):
            assert m["missing"] == 0 and m["duplicates"] == 0, (name, label, m["missing"], m["duplicates"])
            rows.append(
                [
                    name,
                    label,
                    m["steps"],
                    m["rounds"],
                    m["compute_vs_limit"],
                    m["moved"],
                    m["intra_node_moved"],
                    m["cross_node_moved"],
                    m["cross_node_bytes"] / 1e6,
                    m["intra_node_bytes"] / 1e6,
                    m["node_swaps"],
                    m["node_fallback_rounds"],
                    m["plan_per_round_s"],
                ]
            )
        d_cvl = aware["compute_vs_limit"] - blind["compute_vs_limit"]
        ratio = (
            blind["cross_node_moved"] / aware["cross_node_moved"]
            if aware["cross_node_moved"]
            else float("inf")
        )
        bytes_ratio = (
            blind["cross_node_bytes"] / aware["cross_node_bytes"]
            if aware["cross_node_bytes"]
            else float("inf")
        )
        verdicts.append((name, d_cvl, ratio, bytes_ratio, len(lengths), padding(lengths)))
    wall = time.perf_counter() - t0
    machine = (
        f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPU(s), "
        f"{platform.machine()}"
    )
    c = CONFIG
    body = [
        "## Node-aware balancing (1,024 ranks, 8 per node"
        + ("" if section == SECTION else f", window {args.window}")
        + ")",
        "",
        (
            f"Generated by `{cmd}` ({wall:.0f} s in all; {rev}; {machine}; planning "
            "times are single-threaded Python on a shared machine, compare within one run). "
            f"N={c['world_size']} ranks, {LOCAL_RANKS} per node ({c['world_size'] // LOCAL_RANKS} nodes), "
            f"policy {c['policy']}, L={c['token_budget']}, window {c['window']}, depth {c['depth']}, {c['cost']} "
            f"cost, {c['mode']} mode, file order. Each workload file (4,096 lengths) is repeated {args.repeat}x "
            f"({4096 * args.repeat:,} samples, {4096 * args.repeat // c['world_size']} per rank) so ranks see "
            "more than one window; both plans run on the same data and topology, node-blind's moves counted "
            "under it."
        ),
        "",
        table(HEADERS, rows),
        "",
        (
            "- **cvl**: compute_vs_limit (the straggler-bound compute; Metrics above). **moved**: samples "
            "trained off their home rank; **intra-node** / **cross-node**: of those, the ones that stay in / "
            "leave their node (bytes: 8 x length, int32 input_ids + labels). **swaps**: group pairs swapped "
            "across nodes so every step costs its level; **fallback**: rounds planned node-blind. "
            "**plan s/round**: the coordinator's decide per round."
        ),
        "",
        (
            "Node-aware plan (`core/_balance.py`): each node groups, ranks and chooses its own K_n x T groups "
            "(its ranks' quotas, so the progress bound holds per node), deficit nodes receive other nodes' "
            "unchosen groups (fewest bytes first), padding outliers are pooled across nodes and the rest "
            "regrouped per node under the smallest common capacity that fits, and a global cost sort sets "
            "each step's level, kept by cross-node swaps (fewest samples first)."
        ),
        "",
        "Targets (cvl within 0.02 of node-blind; >= 5x fewer cross-node samples):",
        "",
    ]
    for name, d_cvl, ratio, bytes_ratio, n, pad in verdicts:
        ok_cvl = abs(d_cvl) <= CVL_TOLERANCE or d_cvl < 0
        ok_ratio = ratio >= CROSS_RATIO
        body.append(
            f"- {name}: cvl node-aware - node-blind = {d_cvl:+.3f} ({'met' if ok_cvl else 'MISSED'}); "
            f"cross-node samples node-blind / node-aware = {ratio:.2f}x "
            f"({'met' if ok_ratio else 'MISSED'}); cross-node bytes {bytes_ratio:.2f}x; padding "
            f"efficiency of the first window grouped pooled vs per node: {pad[0]:.1%} vs {pad[1]:.1%}."
        )
    body += [
        "",
        (
            f"Why cvl misses: padded cost. A node's window holds 1/{c['world_size'] // LOCAL_RANKS} of the pooled "
            f"one, so a node-pure group of n samples spans n/{LOCAL_RANKS * c['window']:,} of the node's length "
            f"distribution instead of n/{c['world_size'] * c['window']:,}: it pads more (efficiency above), a "
            "round's K_n x T node-pure groups carry fewer tokens than node-blind's, more samples are left for "
            "the tail, and the tail rounds cost the most per token. Pooling padding outliers across nodes "
            "recovers part of it; closing the gap fully takes pooling most short samples, which moves more "
            "than node-blind / 5. The level swaps buy cvl with cross-node moves (measured while building it "
            "at window 32: sharegpt4o-like without them 8.4x fewer cross-node samples but cvl +0.13). An earlier "
            "cut (node-blind's chosen samples, regrouped per node) measured cvl +0.023 / +0.165 with 1.18x / "
            "1.33x fewer cross-node samples. Under an additive cost (packed) node-pure groups waste nothing, "
            "so the gap should be smaller there (not measured). Hence `node_aware` is off by default: a job "
            "turns it on where cross-node bytes cost more than a few percent of step time."
        ),
    ]
    publish(section, body, args.no_write, args.docs, echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
