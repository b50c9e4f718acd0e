"""Alignment round latency with node agents (one `Coordinator.Node` stream per host), at 64, 512 and
1,024 ranks, and whether alignment stays off the trainers' critical path.

Setup (all on one machine, loopback TCP):

- the coordinator is the real gRPC server (`batchd.service.create_server`, grpc.aio) in its own process
  (multiprocessing, spawn). The benchmark wraps `CoordinatorServicer.Node` there (an async generator, or
  a sync one for an older revision) to timestamp each message as the handler takes it and as it hands
  the reply back to gRPC (a few list appends per message), and reads the process's CPU time when the
  warm-up's last totals and the last measured totals leave;
- `--before REV` also runs revision REV's coordinator (exported with `git archive` to a temporary tree
  put first on the coordinator process's sys.path; the agents stay this tree's), config by config just
  before this tree's, for a before/after table from one run;
- **simulated agents are light clients**: an agent is one thread holding its K `batchd.core.RankState`s
  (policy local, window 64, depth 8, L=8192, padded cost, join mode, as `align_latency.py`) that speaks
  the Node stream itself: one `stub.Node` call per agent (its own channel, with a local subchannel pool,
  so its own TCP connection), the request iterator fed from a queue; a hello with its ranks, then per
  round one NodeAlign with its K reports, `apply` of each rank, one NodeCommit with K commits,
  `finalize` of each rank. One heartbeat thread per client process sends every agent's node heartbeat
  (`HeartbeatRequest.ranks`) every 2 s. The agents are spread over `--client-procs` processes (default
  2), so on the 2-core machine the coordinator and the client processes share the cores. Samples are
  pre-built before the clock (a per-rank ring of lengths drawn with `random.Random(1000 + rank)` from
  odb-synthetic, ids unique per rank; a ring entry still in the window is skipped) and `gc.freeze()`d.

Measured per round, after `--warmup` rounds, over `--rounds` rounds:

- coord: `CoordinatorState.latencies_ms` (first Align received -> round totals decided);
- coord-own: what the coordinator itself adds to a round once the last message is in: last NodeAlign
  taken by its handler -> last decision reply handed to gRPC, plus the same for the commit (the rest of
  `coord` is the agents' skew: the slowest agent's finalize/fill/report/apply on a shared box);
- client: per agent, NodeAlign sent -> totals received, max over agents; span: first NodeAlign sent ->
  last totals received;
- coordinator CPU per round: process CPU (user+sys, `os.times`) over the measured rounds / rounds.

Optionally (`--unary`, on by default) one `align_latency.py` run at 64 ranks (one unary Align and
Commit per rank per barrier, same clients) in the same script, for the ratio.

"Off the critical path" (`--trainer-s`, default 20 s): 64 ranks as 8 agents x 8 using the real agent
link (`batchd.service.NodeLink` + `LocalRankClient`). Each rank has a round loop like the
daemon's `RankServiceCore._round` (fill, wait until capacity = depth - ready > 0, report(capacity),
align, apply, commit, finalize, append the steps to its ready queue) and a trainer thread that takes one
batch from that queue every 50 ms, in lockstep with the others (step k at t0 + k x 50 ms on the clock
the processes share, as DDP keeps trainers together). Measured after a warm-up: the share
of trainer time spent waiting for a batch (queue empty), plus the fewest batches a trainer found ready.

The result goes to benchmarks/results/node-latency.json (template: templates/node-latency.md.j2). The
coordinator process lives in _node_coordinator.py, the simulated agents and trainers in _node_sim.py.

Usage: python benchmarks/node_latency.py [--configs 8x8,64x8,128x8] [--rounds 300,150,80]
       [--warmup 20] [--client-procs 2] [--trainer-s 20] [--no-unary] [--profile] [--before REV]
       [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import queue
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import join_or_terminate  # noqa: E402
from _node_coordinator import baseline_tree, coordinator_main  # noqa: E402
from _node_sim import (  # noqa: E402
    BUDGET,
    DEPTH,
    HEARTBEAT_S,
    STEP_S,
    WINDOW,
    ClientGroup,
    agents_main,
    trainers_main,
)
from _report import (  # noqa: E402
    DEFAULT_WORKLOADS,
    REPO,
    add_common_args,
    command_line,
    finish,
    idle_share,
    machine,
)

SECTION = "node-latency"
MEASURES = (
    "benchmarks/node_latency.py",
    "benchmarks/_node_coordinator.py",
    "benchmarks/_node_sim.py",
    "core",
    "proto",
    "service",
)
TARGET_64_MS, TARGET_512_MS = 5.0, 25.0


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def _groups(agents: int, k: int, client_procs: int) -> list[list[tuple[str, list[int]]]]:
    """`agents` nodes of `k` ranks each, dealt round-robin over min(client_procs, agents) processes."""
    specs = [(f"node-{a}", list(range(a * k, (a + 1) * k))) for a in range(agents)]
    nproc = min(client_procs, agents)
    return [specs[i::nproc] for i in range(nproc)]


def _round_times(
    coord_out: dict[str, Any], results: dict[str, list], warmup: int, total: int
) -> dict[str, list]:
    """Per measured round: coord-own (last message taken -> last reply handed back, align + commit, from the
    Node wrapper's timestamps), client (max over agents), span and the slowest agent's compute, in ms."""
    by_round: dict[tuple[str, int], list[tuple[float, float]]] = collections.defaultdict(list)
    for kind, rnd, t_in, t_out in coord_out["events"]:
        by_round[(kind, rnd)].append((t_in, t_out))
    own_ms = []
    for rnd in range(warmup, total):
        a, c = by_round.get(("align", rnd)), by_round.get(("commit", rnd))
        if not a or not c:
            continue
        a_own = max(t for _, t in a) - max(t for t, _ in a)
        c_own = max(t for _, t in c) - max(t for t, _ in c)
        own_ms.append(1000 * (a_own + c_own))
    client_ms, span_ms, compute_ms = [], [], []
    for rnd in range(warmup, total):
        rows = [results[name][rnd] for name in results]
        client_ms.append(1000 * max(row[3] - row[0] for row in rows))
        span_ms.append(1000 * (max(row[3] for row in rows) - min(row[0] for row in rows)))
        compute_ms.append(1000 * max(row[4] for row in rows))
    return {"own_ms": own_ms, "client_ms": client_ms, "span_ms": span_ms, "compute_ms": compute_ms}


def _collect(out_q, n: int, procs: list) -> list[dict[str, Any]]:
    """The `n` client processes' outputs, failing fast when one of them exits non-zero."""
    outs: list[dict[str, Any]] = []
    while len(outs) < n:
        try:
            outs.append(out_q.get(timeout=0.5))
        except queue.Empty:
            for p in procs:
                if p.exitcode not in (None, 0):
                    raise RuntimeError(f"client process exited with {p.exitcode}") from None
    return outs


def run_nodes(
    agents: int,
    k: int,
    pool: list[int],
    rounds: int,
    warmup: int,
    client_procs: int,
    profile: bool = False,
    base: str | None = None,
) -> dict[str, Any]:
    world = agents * k
    total = warmup + rounds
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    coord = ctx.Process(
        target=coordinator_main, args=(child, world, warmup, total, profile, base), daemon=True
    )
    coord.start()
    procs = []
    groups = _groups(agents, k, client_procs)
    try:
        if not parent.poll(60):
            raise RuntimeError("coordinator did not start")
        address = f"127.0.0.1:{parent.recv()}"
        barrier = ctx.Barrier(len(groups) + 1)
        out_q = ctx.Queue()
        for g in groups:
            group = ClientGroup(g, world, address, pool)
            p = ctx.Process(target=agents_main, daemon=True, args=(group, total, warmup, barrier, out_q))
            p.start()
            procs.append(p)
        barrier.wait(timeout=300)
        outs = _collect(out_q, len(groups), procs)
        parent.send("stop")
        coord_out = parent.recv()
    finally:
        join_or_terminate(procs, coord)
    errors = [e for o in outs for e in o["errors"]]
    if errors:
        raise RuntimeError(f"{len(errors)} error(s) during the benchmark, first: {errors[0]}")
    results: dict[str, list] = {}
    for o in outs:
        results.update(o["results"])
    lat = coord_out["latencies_ms"]
    coord_ms = lat[-rounds:] if len(lat) >= rounds else lat[-min(len(lat), rounds) :]
    times = _round_times(coord_out, results, warmup, total)
    marks = coord_out["cpu_marks"]
    coord_cpu = (marks["end"][0] - marks["start"][0]) if "start" in marks and "end" in marks else float("nan")
    t_meas = max(results[a][-1][3] for a in results) - min(results[a][warmup][0] for a in results)
    out = {
        "agents": agents,
        "k": k,
        "N": world,
        "rounds": rounds,
        "warmup": warmup,
        "procs": [sum(len(r) for _, r in g) for g in groups],
        "agents_per_proc": [len(g) for g in groups],
        "coord_ms": coord_ms,
        **times,
        "rounds_per_s": rounds / t_meas,
        "coord_cpu_per_round_ms": 1000 * coord_cpu / rounds,
        "client_cpu_per_round_ms": [1000 * o["cpu_s"] / rounds for o in outs],
        "coord_threads": coord_out["threads"],
    }
    if profile:
        out["profile"] = coord_out.get("profile", "")
        out["profiled_threads"] = coord_out.get("profiled_threads", 0)
    return out


def run_trainers(
    agents: int, k: int, pool: list[int], seconds: float, warmup_s: float, client_procs: int
) -> dict[str, Any]:
    world = agents * k
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    coord = ctx.Process(target=coordinator_main, args=(child, world, 0, 0, False), daemon=True)
    coord.start()
    procs = []
    groups = _groups(agents, k, client_procs)
    try:
        if not parent.poll(60):
            raise RuntimeError("coordinator did not start")
        address = f"127.0.0.1:{parent.recv()}"
        barrier = ctx.Barrier(len(groups) + 1)
        go_at = ctx.Value("d", 0.0)
        out_q = ctx.Queue()
        for g in groups:
            group = ClientGroup(g, world, address, pool)
            p = ctx.Process(
                target=trainers_main, daemon=True, args=(group, seconds, warmup_s, barrier, go_at, out_q)
            )
            p.start()
            procs.append(p)
        go_at.value = time.perf_counter() + 0.5  # the trainers' shared step clock (CLOCK_MONOTONIC)
        barrier.wait(timeout=300)
        time.sleep(warmup_s)
        parent.send("status")
        st0 = parent.recv()
        time.sleep(seconds)
        parent.send("status")
        st1 = parent.recv()
        outs = [out_q.get(timeout=120) for _ in groups]
        parent.send("stop")
        parent.recv()
    finally:
        join_or_terminate(procs, coord)
    errors = [e for o in outs for e in o["errors"]]
    if errors:
        raise RuntimeError(f"{len(errors)} error(s) in the trainer experiment, first: {errors[0]}")
    rounds = st1["round"] - st0["round"]
    lat = st1["latencies_ms"][-rounds:] if rounds > 0 else []
    return {
        "agents": agents,
        "k": k,
        "N": world,
        "seconds": seconds,
        "warmup_s": warmup_s,
        "procs": [sum(len(r) for _, r in g) for g in groups],
        "waited_s": sum(o["waited_s"] for o in outs),
        "trainer_s": sum(o["trainer_s"] for o in outs),
        "steps": sum(o["steps"] for o in outs),
        "min_found": min(o["min_found"] for o in outs),
        "found_p50": min(o["found_p50"] for o in outs),
        "rounds": rounds,
        "rounds_per_s": rounds / (st1["t"] - st0["t"]),
        "coord_ms": lat,
        "coord_cpu_share": (st1["cpu_s"] - st0["cpu_s"]) / (st1["t"] - st0["t"]),
        "client_cpu_share": [o["cpu_s"] / seconds for o in outs],
    }


# -- driver ----------------------------------------------------------------------------------------
PCT_KEYS = ("coord_ms", "own_ms", "client_ms", "span_ms", "compute_ms")
HEADERS = ["agents x ranks", "N", "ranks per client proc", "rounds", "coord p50 ms", "coord p99 ms"]
HEADERS += ["coord max ms", "coord-own p50 ms", "coord-own p99 ms", "client p99 ms", "span p50 ms"]
HEADERS += ["slowest agent CPU p50 ms", "rounds/s", "coord CPU ms/round", "client CPU ms/round"]


def summary(res: dict[str, Any] | None) -> dict[str, Any] | None:
    """A run without its per-round lists: `<name>_p50`, `_p99`, `_max` for each (`coord_ms` -> coord_p50)."""
    if res is None:
        return None
    out = {k: v for k, v in res.items() if k not in PCT_KEYS and k != "profile"}
    for key in PCT_KEYS:
        if res.get(key):
            name = key[: -len("_ms")]
            out[f"{name}_p50"], out[f"{name}_p99"] = pct(res[key], 50), pct(res[key], 99)
            out[f"{name}_max"] = max(res[key])
    return out


def node_row(s: dict[str, Any], label: str | None) -> list[object]:
    return [f"{s['agents']} x {s['k']}", *([label] if label else []), s["N"]] + [
        " + ".join(map(str, s["procs"])),
        s["rounds"],
        f"{s['coord_p50']:.1f}",
        f"{s['coord_p99']:.1f}",
        f"{s['coord_max']:.1f}",
        f"{s['own_p50']:.2f}",
        f"{s['own_p99']:.2f}",
        f"{s['client_p99']:.1f}",
        f"{s['span_p50']:.1f}",
        f"{s['compute_p50']:.1f}",
        f"{s['rounds_per_s']:.0f}",
        f"{s['coord_cpu_per_round_ms']:.2f}",
        " + ".join(f"{x:.1f}" for x in s["client_cpu_per_round_ms"]),
    ]


def _say(label: str, res: dict[str, Any]) -> None:
    s = summary(res) or {}
    print(
        f"{label}: coord p50 {s['coord_p50']:.2f} p99 {s['coord_p99']:.2f} own p50 {s['own_p50']:.2f} "
        f"cpu/round {res['coord_cpu_per_round_ms']:.2f} ms",
        flush=True,
    )


def measure(args: argparse.Namespace, pool: list[int]) -> dict[str, Any]:
    """Every run of the section: the configs (and `--before`'s), the unary run, the profile, trainers."""
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    rounds = [int(x) for x in args.rounds.split(",")]
    rounds = (rounds * len(configs))[: len(configs)] if len(rounds) == 1 else rounds
    runs, before = [], []
    base = baseline_tree(args.before) if args.before else None
    for (agents, k), n_rounds in zip(configs, rounds, strict=False):
        if base is not None:
            before.append(run_nodes(agents, k, pool, n_rounds, args.warmup, args.client_procs, base=base))
            _say(f"before ({args.before}) {agents}x{k}", before[-1])
        runs.append(run_nodes(agents, k, pool, n_rounds, args.warmup, args.client_procs))
        _say(f"{agents}x{k}", runs[-1])
    unary = None
    if not args.no_unary:
        import align_latency

        unary = align_latency.run_once(64, pool, 150, 20, 2)
    prof = None
    if args.profile:
        a, k = configs[0]
        prof = run_nodes(a, k, pool, rounds[0], args.warmup, args.client_procs, profile=True)
        print(prof["profile"], flush=True)
    trainer = None
    if args.trainer_s > 0:
        trainer = run_trainers(8, 8, pool, args.trainer_s, args.trainer_warmup_s, args.client_procs)
        print(f"trainers: waited {trainer['waited_s']:.3f} s, min ready {trainer['min_found']}", flush=True)
    out = {"runs": [summary(r) for r in runs], "before": [summary(r) for r in before]}
    out.update(unary=summary(unary), trainer=summary(trainer), profile=None)
    if prof is not None:
        site = str(Path(sys.prefix)) + "/lib/python3.11/site-packages/"
        lines = [
            ln.replace(str(REPO) + "/", "").replace(site, "").rstrip() for ln in prof["profile"].splitlines()
        ]
        out["profile"] = {**(summary(prof) or {}), "lines": [ln for ln in lines if ln.strip()]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="8x8,64x8,128x8", help="comma-separated AGENTSxRANKS_PER_AGENT")
    ap.add_argument(
        "--rounds", default="300,150,80", help="measured rounds per config (one value or one each)"
    )
    ap.add_argument("--warmup", type=int, default=20, help="rounds discarded first")
    ap.add_argument(
        "--client-procs", type=int, default=2, help="processes the simulated agents are spread over"
    )
    ap.add_argument(
        "--trainer-s",
        type=float,
        default=20.0,
        help="measured seconds of the trainer experiment (0 skips it)",
    )
    ap.add_argument("--trainer-warmup-s", type=float, default=5.0)
    ap.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    ap.add_argument("--no-unary", action="store_true", help="skip the per-rank unary run at 64 ranks")
    ap.add_argument(
        "--profile", action="store_true", help="also cProfile the coordinator at the first config"
    )
    ap.add_argument(
        "--before",
        metavar="REV",
        help="also run the coordinator of revision REV (e.g. the last "
        "sync-gRPC one), interleaved with this tree's config by config, for a before/after table",
    )
    add_common_args(ap)
    args = ap.parse_args(argv)
    from batchd import read_lengths

    pool = read_lengths(str(args.workloads / "odb-synthetic.txt"))
    idle0 = idle_share()
    t_all = time.perf_counter()
    data = measure(args, pool)
    import grpc

    data.update(wall_s=time.perf_counter() - t_all, idle_before=idle0, idle_after=idle_share())
    data["grpcio"] = grpc.__version__
    data["machine"] = machine("the coordinator and the client processes")
    label = f"before: sync ({args.before})"
    pairs = list(zip(data["before"], data["runs"], strict=False))
    ordered = [(r, lab) for b, a in pairs for r, lab in ((b, label), (a, "after: grpc.aio"))]
    data["headers"] = HEADERS[:1] + ["coordinator"] + HEADERS[1:] if pairs else HEADERS
    data["rows"] = (
        [node_row(r, lab) for r, lab in ordered] if pairs else [node_row(r, None) for r in data["runs"]]
    )
    config = {"command": command_line(__file__, argv), "configs": args.configs, "rounds": args.rounds}
    config.update(warmup=args.warmup, client_procs=args.client_procs, trainer_s=args.trainer_s)
    config.update(before=args.before, budget=BUDGET, window=WINDOW, depth=DEPTH, heartbeat_s=HEARTBEAT_S)
    config.update(step_ms=1000 * STEP_S, target_64_ms=TARGET_64_MS, target_512_ms=TARGET_512_MS)
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
