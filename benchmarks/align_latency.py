"""Alignment round latency of the gRPC coordinator on loopback, at 8, 32 and 64 ranks.

Setup (all on one machine, loopback TCP):

- the coordinator is the real gRPC server (`batchd.service.create_server`, grpc.aio: one event loop) in
  its own process (multiprocessing, spawn);
- N rank clients run the real round protocol, each with its own `batchd.core.RankState` (policy
  local, window 64, depth 8, L=8192, padded cost, join mode) and its own `CoordinatorClient` (own
  channel object; gRPC Python may share one TCP connection between channels of a process), registered
  with the job spec and sending heartbeats. Per round: fill the window -> `report(capacity=8)` ->
  `CoordinatorClient.align` -> `apply` -> `CoordinatorClient.commit` -> `finalize`. The trainer is
  assumed to drain every step at once, so every round offers capacity 8. The ranks' samples are
  built before the clock starts (lengths drawn with `random.Random(seed + rank).choices` from
  odb-synthetic; ids rank + N*i), so the window fill is just `RankState.push`; they are then
  `gc.freeze()`d, so the cyclic GC does not rescan them (a rank service only holds one window);
- the N clients are threads spread over `--client-procs` processes (default 2: ranks 0..N/2-1 in
  one, the rest in the other), so a rank's Python work shares a GIL with N/2 - 1 others; the machine
  the published numbers come from has 2 cores, shared by the coordinator and both client processes.

Measured per round, after `--warmup` rounds (default 30), over `--rounds` rounds (default 250):

- coordinator view: `CoordinatorState.latencies_ms` (first Align received -> round totals decided),
  i.e. what `Status().round_latency_ms` returns (Status only returns the last 100 rounds, so the
  coordinator process hands back its whole deque; the script checks the two agree on the last 100);
- client view: for each rank, Align sent -> Commit returned; the round's figure is the max over ranks.
  (`span` = first Align sent anywhere -> last Commit returned anywhere: one clock, CLOCK_MONOTONIC is
  shared by the processes.)

Diagnostics at the largest N (`--diagnose`, on by default): a second run with per-phase timestamps
(client send/receive times plus wrappers around `CoordinatorState.submit_align/submit_commit` and the core's
`decide/commit` in the coordinator process) to split a round into its phases, and a third with
cProfile on every thread of the coordinator process (per-thread profilers installed through
`threading.setprofile`, merged), plus the CPU seconds each process burned per round.

The result goes to benchmarks/results/align-latency.json (template: templates/align-latency.md.j2).

Usage: python benchmarks/align_latency.py [--ranks 8,32,64] [--rounds 250] [--warmup 30]
       [--client-procs 2] [--no-diagnose] [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _align_procs import BUDGET, DEPTH, WINDOW, client_main, coordinator_main  # noqa: E402
from _harness import join_or_terminate  # noqa: E402
from _report import (  # noqa: E402
    DEFAULT_WORKLOADS,
    REPO,
    add_common_args,
    command_line,
    finish,
    idle_share,
    machine,
)

SECTION = "align-latency"
MEASURES = ("benchmarks/align_latency.py", "benchmarks/_align_procs.py", "core", "proto", "service")
TARGET_P99_MS, TARGET_N = 5.0, 64


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


# -- driver ----------------------------------------------------------------------------------------
def _collect(out_q, n: int, procs: list, parent) -> list[dict[str, Any]]:
    """The `n` client processes' outputs, failing fast when one exits non-zero; on the first "warm"
    (a client through its warm-up) starts the coordinator's CPU clock (`mark` on `parent`)."""
    outs: list[dict[str, Any]] = []
    marked = False
    while len(outs) < n:
        try:
            msg = out_q.get(timeout=0.5)
        except Exception:  # noqa: BLE001 - queue.Empty
            for p in procs:
                if p.exitcode not in (None, 0):
                    raise RuntimeError(f"client process exited with {p.exitcode}") from None
            continue
        if msg == "warm":  # the first client is through its warm-up: start the coordinator's CPU clock
            if not marked:
                parent.send("mark")
                parent.recv()
                marked = True
            continue
        outs.append(msg)
    return outs


def _client_times(results: dict[int, list], world_size: int, warmup: int, total: int) -> dict[str, list]:
    """Per measured round, in ms: client (Align sent -> totals, max over ranks), span (first Align sent ->
    last totals) and the slowest rank's own compute."""
    client_ms, span_ms, compute_ms = [], [], []
    for rnd in range(warmup, total):
        rows = [results[r][rnd] for r in range(world_size)]
        client_ms.append(1000 * max(row[3] - row[0] for row in rows))
        span_ms.append(1000 * (max(row[3] for row in rows) - min(row[0] for row in rows)))
        compute_ms.append(1000 * max(row[4] for row in rows))
    return {"client_ms": client_ms, "span_ms": span_ms, "compute_ms": compute_ms}


def run_once(
    world_size: int, pool: list[int], rounds: int, warmup: int, client_procs: int, mode: str = "plain"
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    coord = ctx.Process(target=coordinator_main, args=(child, world_size, mode), daemon=True)
    coord.start()
    procs = []
    try:
        if not parent.poll(60):
            raise RuntimeError("coordinator did not start")
        port = parent.recv()
        address = f"127.0.0.1:{port}"
        total = warmup + rounds
        nproc = min(client_procs, world_size)
        size = -(-world_size // nproc)
        groups = [list(range(i, min(i + size, world_size))) for i in range(0, world_size, size)]
        barrier = ctx.Barrier(len(groups) + 1)
        out_q = ctx.Queue()
        for g in groups:
            p = ctx.Process(
                target=client_main,
                daemon=True,
                args=(g, world_size, address, pool, total, warmup, barrier, out_q),
            )
            p.start()
            procs.append(p)
        barrier.wait(timeout=300)
        t_start = time.perf_counter()
        outs = _collect(out_q, len(groups), procs, parent)
        wall = time.perf_counter() - t_start
        status = _status(address)
        parent.send("stop")
        coord_out = parent.recv()
    finally:
        join_or_terminate(procs, coord)
    failures = [f for o in outs for f in o["failures"]]
    if failures:
        raise RuntimeError(f"job failed during the benchmark: {failures[0]}")
    results: dict[int, list] = {}
    for o in outs:
        results.update(o["results"])
    lat = coord_out["latencies_ms"]
    if len(lat) < total:
        raise RuntimeError(f"coordinator recorded {len(lat)} rounds, expected {total}")
    coord_ms = lat[-rounds:]
    if list(status.round_latency_ms) != lat[-100:]:
        raise RuntimeError("Status().round_latency_ms disagrees with the coordinator's own record")
    t_meas = max(results[r][-1][3] for r in results) - min(results[r][warmup][0] for r in results)
    out = {
        "N": world_size,
        "rounds": rounds,
        "warmup": warmup,
        "groups": [len(g) for g in groups],
        "coord_ms": coord_ms,
        **_client_times(results, world_size, warmup, total),
        "wall_s": wall,
        "rounds_per_s": rounds / t_meas,
        "coord_cpu_per_round_ms": 1000 * coord_out["cpu_s"] / rounds,
        "client_cpu_per_round_ms": [1000 * o["cpu_s"] / rounds for o in outs],
        "coord_threads": coord_out["threads"],
    }
    if mode == "phases":
        out["phases"] = phases(coord_out["events"], results, warmup, total, world_size)
    if mode == "profile":
        out["profile"] = coord_out.get("profile", "")
        out["profiled_threads"] = coord_out.get("profiled_threads", 0)
        out["profile_groups"] = coord_out.get("profile_groups", [])
    return out


def _status(address: str):
    import grpc

    from batchd.proto import batchd_pb2 as pb
    from batchd.proto import batchd_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        return pb_grpc.CoordinatorStub(ch).Status(pb.StatusRequest(), timeout=10)


def rpc_floor(calls: int = 3000) -> dict[str, float]:
    """Coordinator-process CPU per trivial unary RPC (`Status`), sent back to back from this process."""
    import grpc

    from batchd.proto import batchd_pb2 as pb
    from batchd.proto import batchd_pb2_grpc as pb_grpc

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    coord = ctx.Process(target=coordinator_main, args=(child, TARGET_N, "plain"), daemon=True)
    coord.start()
    try:
        port = parent.recv()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            for _ in range(200):
                stub.Status(pb.StatusRequest(), timeout=10)
            parent.send("mark")
            parent.recv()
            t0 = time.perf_counter()
            for _ in range(calls):
                stub.Status(pb.StatusRequest(), timeout=10)
            wall = time.perf_counter() - t0
        parent.send("stop")
        out = parent.recv()
    finally:
        coord.join(10)
        if coord.is_alive():
            coord.terminate()
    return {"server_cpu_us": 1e6 * out["cpu_s"] / calls, "rtt_us": 1e6 * wall / calls}


PHASES = [
    ("send skew", "first Align sent -> last Align sent (ranks start the round at different times)"),
    (
        "Align in flight",
        "last Align sent -> it enters CoordinatorState.submit_align (client serialization, "
        "loopback, gRPC dispatch to the server's event loop)",
    ),
    ("decide", "core.decide under the lock"),
    (
        "decision fan-out",
        "decision made -> the last rank holds it (the barrier's N waiting handlers resume on "
        "the event loop, each serializes its response; transport; client deserializes)",
    ),
    (
        "apply + Commit in flight",
        "-> last Commit enters CoordinatorState.submit_commit (slowest apply, serialization, "
        "transport, dispatch)",
    ),
    ("commit", "core.commit under the lock"),
    ("totals fan-out", "totals made -> the last rank holds them"),
]


def phases(events: list[tuple], results: dict[int, list], warmup: int, total: int, n: int) -> list[list]:
    """Per-round phase durations (ms), medians and p99 over the measured rounds."""
    by_round: dict[int, dict[str, Any]] = {}
    for ev in events:
        kind, rnd = ev[0], ev[1]
        d = by_round.setdefault(rnd, {"align_in": [], "commit_in": []})
        if kind in ("align_in", "commit_in"):
            d[kind].append(ev[3])
        elif kind in ("decide", "core_commit"):
            d[kind] = (ev[3], ev[4])
    cols: dict[str, list[float]] = {name: [] for name, _ in PHASES}
    for rnd in range(warmup, total):
        d = by_round.get(rnd)
        if not d or "decide" not in d or "core_commit" not in d:
            continue
        rows = [results[r][rnd] for r in range(n)]
        first_sent, last_sent = min(r[0] for r in rows), max(r[0] for r in rows)
        last_in = max(d["align_in"])
        dec0, dec1 = d["decide"]
        got_dec = max(r[1] for r in rows)
        last_cin = max(d["commit_in"])
        com0, com1 = d["core_commit"]
        got_tot = max(r[3] for r in rows)
        vals = [
            last_sent - first_sent,
            max(last_in - last_sent, 0.0),
            dec1 - dec0,
            got_dec - dec1,
            last_cin - got_dec,
            com1 - com0,
            got_tot - com1,
        ]
        for (name, _), v in zip(PHASES, vals, strict=False):
            cols[name].append(1000 * v)
    return [
        [name, f"{statistics.median(cols[name]):.2f}", f"{pct(cols[name], 99):.2f}", what]
        for name, what in PHASES
        if cols[name]
    ]


HEADERS = ["N", "ranks per client proc", "rounds", "coord p50 ms", "coord p99 ms", "client p50 ms"]
HEADERS += ["client p99 ms", "span p50 ms", "client CPU p50 ms", "rounds/s", "coord CPU ms/round"]
HEADERS += ["coord CPU us/RPC", "client CPU ms/round", "target (p99 <= 5 ms @ 64)"]
PCTS = (("coord_ms", 50), ("coord_ms", 99), ("client_ms", 50), ("client_ms", 99), ("span_ms", 50))
PCTS += (("compute_ms", 50),)


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """A run's figures without its per-round lists: percentiles as `<key>_p<q>`."""
    per_round = {k for k, _ in PCTS} | {"profile"}
    out = {k: v for k, v in res.items() if k not in per_round}
    for k, q in PCTS + (("client_ms", 50), ("coord_ms", 50)):
        out[f"{k}_p{q}"] = pct(res[k], q)
    return out


def table_row(res: dict[str, Any]) -> list[object]:
    n = res["N"]
    met = ""
    if n == TARGET_N:
        ok = pct(res["client_ms"], 99) <= TARGET_P99_MS and pct(res["coord_ms"], 99) <= TARGET_P99_MS
        met = "PASS" if ok else "FAIL"
    return [
        n,
        " + ".join(map(str, res["groups"])),
        res["rounds"],
        *(f"{pct(res[k], q):.1f}" for k, q in PCTS),
        f"{res['rounds_per_s']:.0f}",
        f"{res['coord_cpu_per_round_ms']:.1f}",
        f"{1000 * res['coord_cpu_per_round_ms'] / (2 * n):.0f}",
        " + ".join(f"{x:.1f}" for x in res["client_cpu_per_round_ms"]),
        met,
    ]


def _profile_lines(text: str) -> list[str]:
    site = str(Path(sys.prefix)) + "/lib/python3.11/site-packages/"
    lines = (ln.replace(str(REPO) + "/", "").replace(site, "").rstrip() for ln in text.strip().splitlines())
    return [ln for ln in lines if ln.strip()]


def diagnose(n: int, pool: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """The phase-timestamp run, the cProfile run and the trivial-RPC floor at N=`n`."""
    phase = run_once(n, pool, args.rounds, args.warmup, args.client_procs, mode="phases")
    for r in phase["phases"]:
        print(" | ".join(r[:3]), flush=True)
    prof = run_once(n, pool, min(args.rounds, 120), 10, args.client_procs, mode="profile")
    print(prof["profile"], flush=True)
    floor = rpc_floor()
    print(floor, flush=True)
    groups = prof.get("profile_groups") or []
    total = sum(v for _, v in groups) or 1.0
    phases_ms = {r[0]: float(r[1]) for r in phase["phases"]}
    return {
        "phase": summary(phase),
        "core_ms": phases_ms.get("decide", 0.0) + phases_ms.get("commit", 0.0),
        "prof": {**summary(prof), "profile_lines": _profile_lines(prof["profile"])},
        "prof_groups": [[g, f"{v:.2f}", f"{v / total:.0%}"] for g, v in groups],
        "floor": floor,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="8,32,64", help="comma-separated world sizes")
    ap.add_argument("--rounds", type=int, default=250, help="measured rounds per N")
    ap.add_argument("--warmup", type=int, default=30, help="rounds discarded first")
    ap.add_argument("--client-procs", type=int, default=2, help="processes the rank threads are spread over")
    ap.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    ap.add_argument("--no-diagnose", action="store_true", help="skip the phase and cProfile runs")
    add_common_args(ap)
    args = ap.parse_args(argv)
    from batchd import read_lengths

    pool = read_lengths(str(args.workloads / "odb-synthetic.txt"))
    t_all = time.perf_counter()
    ranks = [int(x) for x in args.ranks.split(",")]
    runs, rows = [], []
    for n in ranks:
        res = run_once(n, pool, args.rounds, args.warmup, args.client_procs)
        runs.append(summary(res))
        rows.append(table_row(res))
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    idle0 = idle_share()
    diag = None if args.no_diagnose else diagnose(max(ranks), pool, args)
    import grpc

    data = {"headers": HEADERS, "rows": rows, "runs": runs, "diag": diag, "grpcio": grpc.__version__}
    data.update(wall_s=time.perf_counter() - t_all, idle_before=idle0, idle_after=idle_share())
    data["target"] = next((r for r in runs if r["N"] == TARGET_N), None)
    data["machine"] = machine("the coordinator and the client processes")
    config = {"command": command_line(__file__, argv), "ranks": ranks, "rounds": args.rounds}
    config.update(warmup=args.warmup, client_procs=args.client_procs, budget=BUDGET, window=WINDOW)
    config.update(depth=DEPTH, target_p99_ms=TARGET_P99_MS, target_n=TARGET_N)
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
