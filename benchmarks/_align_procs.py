"""The processes of benchmarks/align_latency.py: the coordinator (the real gRPC server, its calls timed and
optionally profiled per thread) and the client processes (ranks as threads on `CoordinatorClient`s).
batchd is imported inside the functions: each runs in a spawned process."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from typing import Any

from _report import format_profile, merged_stats

BUDGET, WINDOW, DEPTH = 8192, 64, 8


def job_spec(world_size: int):
    from batchd.core import JobSpec, PolicySpec

    return JobSpec(
        world_size=world_size,
        token_budget=BUDGET,
        seed=0,
        policy=PolicySpec(name="local", window=WINDOW, depth=DEPTH),
    )


PROFILE_GROUPS = (
    ("gRPC Python server/channel code", lambda f, fn: "/grpc/" in f),
    ("asyncio event loop (the grpc.aio server's)", lambda f, fn: "/asyncio/" in f or "_contextvars" in fn),
    (
        "locks, conditions, queues (thread hand-offs)",
        lambda f, fn: (
            f.endswith("threading.py")
            or f.endswith("queue.py")
            or any(x in fn for x in ("_thread.lock", "_thread.RLock", "SimpleQueue"))
        ),
    ),
    ("batchd.proto.wire (protobuf <-> core dataclasses)", lambda f, fn: f.endswith("proto/wire.py")),
    (
        "coordinator state + core (decide/commit)",
        lambda f, fn: "/core/" in f or "/service/coordinator/" in f,
    ),
)


def profile_groups(stats) -> list[tuple[str, float]]:
    """Own (tottime) CPU seconds per group of functions; builtins called from batchd code land in "other"."""
    totals = {name: 0.0 for name, _ in PROFILE_GROUPS}
    other = 0.0
    for (filename, _line, func), row in stats.stats.items():
        for name, match in PROFILE_GROUPS:
            if match(filename, func):
                totals[name] += row[2]
                break
        else:
            other += row[2]
    return [*totals.items(), ("other (builtins, protobuf, dataclasses, ...)", other)]


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# -- coordinator process ---------------------------------------------------------------------------
def coordinator_main(conn, world_size: int, mode: str) -> None:
    """Runs the coordinator server until told to stop; `mode` is "plain", "phases" or "profile"."""
    from batchd.service import create_server

    profiles: list = []
    if mode == "profile":
        import cProfile

        def install(frame, event, arg):  # first event of a new thread: hand over to a C profiler
            prof = cProfile.Profile(time.thread_time)  # CPU time of this thread only
            profiles.append(prof)
            prof.enable()

        threading.setprofile(install)
    server, port, state = create_server(
        "127.0.0.1:0", job_spec(world_size), lease_s=120.0, startup_timeout_s=600.0
    )
    events: list[tuple] = []
    if mode == "phases":
        # The server hands every Align/Commit to `submit_align/submit_commit` (non-blocking; a barrier's
        # waiters then await it): their entry is when the message reached the coordinator's logic.
        orig_align, orig_commit = state.submit_align, state.submit_commit
        core = state.core
        orig_decide, orig_core_commit = core.decide, core.commit

        def align(epoch, reports):
            for report in reports:
                events.append(("align_in", report.round, report.rank, time.perf_counter()))
            return orig_align(epoch, reports)

        def commit(epoch, commits, *rest):
            for c in commits:
                events.append(("commit_in", c.round, c.rank, time.perf_counter()))
            return orig_commit(epoch, commits, *rest)

        def decide(reports):
            t = time.perf_counter()
            out = orig_decide(reports)
            events.append(("decide", out.round, -1, t, time.perf_counter()))
            return out

        def core_commit(commits, *rest):
            t = time.perf_counter()
            out = orig_core_commit(commits, *rest)
            events.append(("core_commit", out.round, -1, t, time.perf_counter()))
            return out

        state.submit_align, state.submit_commit = align, commit
        core.decide, core.commit = decide, core_commit
    server.start()
    conn.send(port)
    cpu0 = None
    while True:
        msg = conn.recv()
        if msg == "mark":  # start of the measured rounds
            cpu0 = cpu_s()
            conn.send(None)
        elif msg == "stop":
            break
    result: dict[str, Any] = {
        "latencies_ms": list(state.latencies_ms),
        "cpu_s": cpu_s() - (cpu0 or 0.0),
        "events": events,
        "threads": threading.active_count(),
    }
    if profiles:
        threading.setprofile(None)
        stats = merged_stats(profiles)
        result["profile"] = format_profile(stats, 14) if stats is not None else ""
        result["profile_groups"] = profile_groups(stats) if stats is not None else []
        result["profiled_threads"] = len(profiles)
    conn.send(result)
    state.close()
    server.stop(0)


# -- client processes ------------------------------------------------------------------------------
def client_main(
    ranks: list[int],
    world_size: int,
    address: str,
    pool: list[int],
    total_rounds: int,
    warmup: int,
    barrier,
    out_q,
) -> None:
    """Runs ranks `ranks` as threads; puts
    {rank: [(t_send, t_decision, t_commit_send, t_totals, compute)]}."""
    from batchd.core import RankState, Sample
    from batchd.service import CoordinatorClient

    spec = job_spec(world_size)
    per_rank = WINDOW * (total_rounds + 2)  # a round can emit at most a whole window
    data = {}
    for r in ranks:
        lengths = random.Random(1000 + r).choices(pool, k=per_rank)
        data[r] = [Sample(r + world_size * i, n, n - 1, r) for i, n in enumerate(lengths)]
    # The pre-built samples (up to ~600k objects per process) would make every full cyclic-GC pass scan
    # them, stalling all rank threads of the process for ~100 ms; a rank service holds one window.
    gc.collect()
    gc.freeze()
    clients = {r: CoordinatorClient(address, r, spec) for r in ranks}
    failures: list[str] = []
    for r in ranks:
        clients[r].register(f"bench-rank-{r}")
        clients[r].start_heartbeats(failures.append)
    go = threading.Event()
    results: dict[int, list[tuple[float, ...]]] = {}
    cpu: dict[str, float] = {}

    def run(r: int) -> None:
        state = RankState(spec, r)
        coord = clients[r]
        it = iter(data[r])
        rows = []
        go.wait()
        for rnd in range(total_rounds):
            c0 = time.perf_counter()
            while state.room > 0:
                state.push(next(it))
            report = state.report(DEPTH)
            t0 = time.perf_counter()
            decision = coord.align(0, report)
            t1 = time.perf_counter()
            c = state.apply(decision)
            t2 = time.perf_counter()
            totals = coord.commit(0, c)
            t3 = time.perf_counter()
            state.finalize(totals)
            t4 = time.perf_counter()
            rows.append((t0, t1, t2, t3, (t0 - c0) + (t2 - t1) + (t4 - t3)))
            if rnd == warmup - 1 and r == ranks[0]:
                cpu["start"] = cpu_s()
                out_q.put("warm")
        results[r] = rows

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    barrier.wait()
    go.set()
    for t in threads:
        t.join()
    cpu["end"] = cpu_s()
    for c in clients.values():
        c.close()
    out_q.put({"results": results, "cpu_s": cpu["end"] - cpu.get("start", cpu["end"]), "failures": failures})
