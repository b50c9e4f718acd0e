"""Throughput of batchd's core: per-rank grouping + alignment rate, and a 1M-sample `simulate`.

(a) Grouping + alignment per rank. `RankState`s and a `Coordinator` are driven in one process through
    the daemon's round: push* -> report -> decide -> apply -> commit -> finalize, over `--samples`
    (default 1,000,000) lengths drawn with a fixed seed from the odb-synthetic workload (window 512,
    depth 8, L=8192, padded cost, join mode; the trainer is assumed to drain every step before the next
    round, so each round offers capacity `depth`). Each call is timed with `time.perf_counter`:

        per-rank samples/s = samples rank r emitted / (time in rank r's calls + coordinator time / N)

    "rank r's calls" are its pushes (including building the `Sample` from (id, length), as the daemon
    does on receipt), `report`, `apply` and `finalize`; the coordinator's are `decide` and `commit`. With
    N=1 this is one rank and its coordinator; with N=8 all ranks run in this process and each gets
    1/N of the coordinator's time (the coordinator serves N ranks). The figure is the median of
    `--runs` runs (default 3); for N=8, each run contributes the median rank (the slowest is shown too).
    Target: >= 200,000 samples/s per rank.
(b) End-to-end `batchd.core.simulate` of `--samples` lengths (same draw) at N=64, window 512, L=8192,
    policies local and balanced: wall time of one run each (target: < 60 s).

The result goes to benchmarks/results/throughput.json (template: benchmarks/templates/throughput.md.j2).

Usage: python benchmarks/throughput.py [--samples N] [--runs R] [--profile] [--skip-e2e]
       [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import DEFAULT_WORKLOADS, REPO, add_common_args, command_line, finish, machine  # noqa: E402

from batchd import read_lengths
from batchd.core import (  # noqa: E402
    Coordinator,
    JobSpec,
    PolicySpec,
    RankState,
    Sample,
    simulate,
)

SECTION = "throughput"
MEASURES = ("benchmarks/throughput.py", "core")
BUDGET, WINDOW, DEPTH = 8192, 512, 8
TARGET_RATE = 200_000
TARGET_E2E_S = 60.0
PHASES = ("build", "push", "report", "apply", "finalize")


def draw_lengths(workloads: Path, n: int, seed: int) -> list[int]:
    """`n` lengths drawn with replacement from odb-synthetic with a fixed seed."""
    pool = read_lengths(str(workloads / "odb-synthetic.txt"))
    return random.Random(seed).choices(pool, k=n)


def _fill(ranks: list[RankState], lengths: Sequence[int], position: list[int], rank_t: list[dict]) -> None:
    """Fills each rank's window from its view (ids r, r+N, ...; `position` its next id), marking a rank
    exhausted at the view's end; adds the time to build the samples and to push them to `rank_t`."""
    pc, world_size, n = time.perf_counter, len(ranks), len(lengths)
    for r, rank in enumerate(ranks):
        t0 = pc()
        i = position[r]
        stop = min(i + rank.room * world_size, n)
        batch = [Sample(j, lengths[j], -1, r) for j in range(i, stop, world_size)]
        t1 = pc()
        for sample in batch:
            rank.push(sample)
        position[r] = i = stop
        if i >= n and not rank.exhausted:
            rank.mark_exhausted()
        t2 = pc()
        rank_t[r]["build"] += t1 - t0
        rank_t[r]["push"] += t2 - t1


def drive(lengths: Sequence[int], world_size: int, policy: str, seed: int = 0) -> dict[str, Any]:
    """Runs one epoch of `lengths` through N ranks and a coordinator, timing every call."""
    pc = time.perf_counter
    cfg = JobSpec(
        shuffle=False,
        world_size=world_size,
        token_budget=BUDGET,
        seed=seed,
        policy=PolicySpec(name=policy, window=WINDOW, depth=DEPTH),
    )
    ranks = [RankState(cfg, r) for r in range(world_size)]
    coord = Coordinator(cfg)
    n = len(lengths)
    position = list(range(world_size))  # rank r's view: ids r, r+N, r+2N, ...
    rank_t = [dict.fromkeys(PHASES, 0.0) for _ in range(world_size)]
    coord_t = {"decide": 0.0, "commit": 0.0}
    emitted = [0] * world_size
    rounds = steps = 0
    while True:
        _fill(ranks, lengths, position, rank_t)
        reports = []
        for r, rank in enumerate(ranks):
            t0 = pc()
            reports.append(rank.report(DEPTH))
            rank_t[r]["report"] += pc() - t0
        t0 = pc()
        decision = coord.decide(reports)
        coord_t["decide"] += pc() - t0
        commits = []
        for r, rank in enumerate(ranks):
            t0 = pc()
            commits.append(rank.apply(decision))
            rank_t[r]["apply"] += pc() - t0
        t0 = pc()
        totals = coord.commit(commits)
        coord_t["commit"] += pc() - t0
        for r, rank in enumerate(ranks):
            t0 = pc()
            out = rank.finalize(totals)
            rank_t[r]["finalize"] += pc() - t0
            emitted[r] += sum(len(s.samples) for s in out)
        rounds += 1
        steps += totals.steps
        if totals.done:
            break
        if rounds > 4 * n + 100:
            raise RuntimeError(f"{policy} N={world_size}: no end after {rounds} rounds")
    if sum(emitted) != n:
        raise RuntimeError(f"{policy} N={world_size}: emitted {sum(emitted)} of {n} samples")
    coord_total = sum(coord_t.values())
    rates = [emitted[r] / (sum(rank_t[r].values()) + coord_total / world_size) for r in range(world_size)]
    no_build = [
        emitted[r] / (sum(rank_t[r].values()) - rank_t[r]["build"] + coord_total / world_size)
        for r in range(world_size)
    ]
    med_rank = sorted(range(world_size), key=lambda r: rates[r])[world_size // 2]
    return {
        "rates": rates,
        "median_rate": statistics.median(rates),
        "min_rate": min(rates),
        "median_no_build": statistics.median(no_build),
        "rounds": rounds,
        "steps": steps,
        "emitted": emitted,
        "phases": {**rank_t[med_rank], **{k: v / world_size for k, v in coord_t.items()}},
        "per_rank_s": sum(rank_t[med_rank].values()) + coord_total / world_size,
    }


def bench_rank(lengths: Sequence[int], world_size: int, policy: str, runs: int) -> dict[str, Any]:
    results = [drive(lengths, world_size, policy) for _ in range(runs)]
    results.sort(key=lambda x: x["median_rate"])
    mid = results[len(results) // 2]
    return {**mid, "all_runs": [x["median_rate"] for x in results]}


def bench_e2e(lengths: Sequence[int], policy: str) -> dict[str, Any]:
    cfg = JobSpec(
        shuffle=False,
        world_size=64,
        token_budget=BUDGET,
        policy=PolicySpec(name=policy, window=WINDOW, depth=DEPTH),
    )
    t0 = time.perf_counter()
    m = simulate(lengths, cfg)
    m["outer_wall_s"] = time.perf_counter() - t0
    return m


def profile_rank(lengths: Sequence[int], policy: str, top: int = 10) -> str:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(drive, lengths, 1, policy)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


HEADERS_A = [
    "policy",
    "N",
    "samples/s per rank",
    "slowest rank",
    "each run",
    "excl. Sample()",
    "rounds",
    "steps/rank",
    "build",
    "push",
    "report",
    "apply",
    "finalize",
    "coord/N",
    "target",
]
HEADERS_B = ["policy", "N", "wall s", "steps", "rounds", "padding_eff", "cvl", "missing", "dup", "target"]


def rows_rank(lengths: Sequence[int], policies: Sequence[str], runs: int) -> list[list[object]]:
    """Table (a): one row per policy and N in (1, 8)."""
    rows: list[list[object]] = []
    for policy in policies:
        for world_size in (1, 8):
            res = bench_rank(lengths, world_size, policy, runs)
            ph = res["phases"]
            tot = sum(ph.values())
            share = {k: f"{100 * v / tot:.0f}%" for k, v in ph.items()}
            rows.append(
                [policy, world_size, f"{res['median_rate']:,.0f}", f"{res['min_rate']:,.0f}"]
                + [" / ".join(f"{x / 1000:.0f}k" for x in res["all_runs"]), f"{res['median_no_build']:,.0f}"]
                + [res["rounds"], res["steps"], *(share[k] for k in PHASES)]
                + [f"{100 * (ph['decide'] + ph['commit']) / tot:.0f}%"]
                + ["PASS" if res["median_rate"] >= TARGET_RATE else "FAIL"]
            )
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def rows_e2e(lengths: Sequence[int], policies: Sequence[str]) -> list[list[object]]:
    """Table (b): one `simulate` run per policy at N=64."""
    rows: list[list[object]] = []
    for policy in policies:
        m = bench_e2e(lengths, policy)
        rows.append(
            [policy, 64, f"{m['outer_wall_s']:.1f}", m["steps"], m["rounds"], m["padding_efficiency"]]
            + [m["compute_vs_limit"], m["missing"], m["duplicates"]]
            + ["PASS" if m["outer_wall_s"] < TARGET_E2E_S else "FAIL"]
        )
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workloads", type=Path, default=DEFAULT_WORKLOADS, help="folder holding odb-synthetic.txt"
    )
    ap.add_argument("--samples", type=int, default=1_000_000, help="samples per run (default 1,000,000)")
    ap.add_argument("--runs", type=int, default=3, help="runs of (a) per configuration (median reported)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the length draw")
    ap.add_argument("--policies", default="local,odb", help="policies of (a) (default local,odb)")
    ap.add_argument(
        "--e2e-policies", default="local,balanced", help="policies of (b) (default local,balanced)"
    )
    ap.add_argument("--skip-e2e", action="store_true", help="skip (b)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile (a) at N=1 and list the top 10 functions by tottime",
    )
    add_common_args(ap)
    args = ap.parse_args(argv)

    t_all = time.perf_counter()
    lengths = draw_lengths(args.workloads, args.samples, args.seed)
    policies = args.policies.split(",")
    data: dict[str, Any] = {"headers_a": HEADERS_A, "headers_b": HEADERS_B}
    data["rows_a"] = rows_rank(lengths, policies, args.runs)
    data["rows_b"] = [] if args.skip_e2e else rows_e2e(lengths, args.e2e_policies.split(","))
    prof_text = profile_rank(lengths, policies[0]) if args.profile else ""
    data["profile"] = [ln.replace(str(REPO) + "/", "") for ln in prof_text.strip().splitlines() if ln.strip()]
    data["wall_s"] = time.perf_counter() - t_all
    data["machine"] = machine()
    config = {k: v for k, v in vars(args).items() if k not in ("out", "print")}
    config.update(budget=BUDGET, window=WINDOW, depth=DEPTH, target_rate=TARGET_RATE)
    config.update(target_e2e_s=TARGET_E2E_S, workloads=str(args.workloads))
    config["command"] = command_line(__file__, argv)
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
