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

The result goes to benchmarks/results/node-latency.json (template: templates/node-latency.md.j2).

Usage: python benchmarks/node_latency.py [--configs 8x8,64x8,128x8] [--rounds 300,150,80]
       [--warmup 20] [--client-procs 2] [--trainer-s 20] [--no-unary] [--profile] [--before REV]
       [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import collections
import gc
import inspect
import multiprocessing as mp
import os
import queue
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import (  # noqa: E402
    DEFAULT_WORKLOADS,
    REPO,
    add_common_args,
    command_line,
    finish,
    format_profile,
    idle_share,
    machine,
    merged_stats,
)

SECTION = "node-latency"
MEASURES = ("benchmarks/node_latency.py", "core", "proto", "service")
BUDGET, WINDOW, DEPTH = 8192, 64, 8
RING = 512  # pre-built samples per rank, used as a ring
HEARTBEAT_S = 2.0
STEP_S = 0.050  # the simulated trainer's step time
TARGET_64_MS, TARGET_512_MS = 5.0, 25.0


def job_spec(world_size: int):
    from batchd.core import JobSpec, PolicySpec

    return JobSpec(
        world_size=world_size,
        token_budget=BUDGET,
        seed=0,
        policy=PolicySpec(name="local", window=WINDOW, depth=DEPTH),
    )


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# -- coordinator process ---------------------------------------------------------------------------
def coordinator_main(
    conn, world_size: int, warmup: int, total: int, profile: bool, base: str | None = None
) -> None:
    """Runs the coordinator server until told to stop; records per-message times on the Node streams.
    `base`: a directory holding another revision's `batchd` package (`baseline_tree`) to run instead."""
    if base is not None:  # before anything imports batchd: this tree wins over the editable install
        sys.path.insert(0, base)
    import batchd.service as co
    from batchd.service import create_server

    profiles: list = []
    if profile:
        import cProfile

        def install(frame, event, arg):  # first event of a new thread: hand over to a C profiler
            prof = cProfile.Profile(time.thread_time)
            profiles.append(prof)
            prof.enable()

        threading.setprofile(install)
    events: list[tuple] = []  # (kind, round, t_taken, t_replied)
    cpu_marks: dict[str, tuple[float, float]] = {}
    orig_node = co.CoordinatorServicer.Node

    def record(kind, rnd, t_in):
        t_out = time.perf_counter()
        events.append((kind, rnd, t_in, t_out))
        if kind == "commit":
            mark = "start" if rnd == warmup - 1 else "end" if rnd == total - 1 else None
            if mark is not None and mark not in cpu_marks:
                cpu_marks[mark] = (cpu_s(), t_out)

    def taken_at(req):
        kind = req.WhichOneof("kind")
        rnd = req.align.round if kind == "align" else req.commit.round if kind == "commit" else -1
        return (kind, rnd, time.perf_counter())

    if inspect.isasyncgenfunction(orig_node):  # grpc.aio coordinator

        async def node(self, request_iterator, context):
            taken: list = [None]

            async def requests():
                async for req in request_iterator:
                    taken[0] = taken_at(req)
                    yield req

            async for reply in orig_node(self, requests(), context):
                record(*taken[0])
                yield reply
    else:  # sync gRPC coordinator (an older revision, for before/after runs)

        def node(self, request_iterator, context):
            taken: list = [None]

            def requests():
                for req in request_iterator:
                    taken[0] = taken_at(req)
                    yield req

            for reply in orig_node(self, requests(), context):
                record(*taken[0])
                yield reply

    co.CoordinatorServicer.Node = node
    server, port, state = create_server(
        "127.0.0.1:0", job_spec(world_size), lease_s=120.0, startup_timeout_s=600.0
    )
    server.start()
    conn.send(port)
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        if msg == "status":
            conn.send(
                {
                    "round": state.core.round,
                    "cpu_s": cpu_s(),
                    "t": time.perf_counter(),
                    "latencies_ms": list(state.latencies_ms),
                }
            )
    result: dict[str, Any] = {
        "latencies_ms": list(state.latencies_ms),
        "events": events,
        "cpu_marks": cpu_marks,
        "threads": threading.active_count(),
    }
    if profiles:
        threading.setprofile(None)
        stats = merged_stats(profiles)
        result["profile"] = format_profile(stats, 16) if stats is not None else ""
        result["profiled_threads"] = len(profiles)
    conn.send(result)
    state.close()
    server.stop(0)


# -- simulated agents (light clients) --------------------------------------------------------------
def rings(ranks: list[int], world_size: int, pool: list[int]) -> dict[int, list]:
    from batchd.core import Sample

    out = {}
    for r in ranks:
        lengths = random.Random(1000 + r).choices(pool, k=RING)
        out[r] = [Sample(r + world_size * i, n, n - 1, r) for i, n in enumerate(lengths)]
    return out


class Feeder:
    """Fills a rank's window from its ring of pre-built samples (skipping one still in the window)."""

    __slots__ = ("i", "ring")

    def __init__(self, ring: list) -> None:
        self.ring, self.i = ring, 0

    def fill(self, state) -> None:
        ring, n = self.ring, len(self.ring)
        while state.room > 0:
            s = ring[self.i % n]
            self.i += 1
            if not state.holds(s.id):
                state.push(s)


def _channel(address: str):
    from batchd.proto import CHANNEL_OPTIONS, channel

    # Own subchannel pool: each simulated agent gets its own TCP connection, as on its own host.
    return channel(address, None, [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])


def agents_main(
    agents: list[tuple[str, list[int]]],
    world_size: int,
    address: str,
    pool: list[int],
    total: int,
    warmup: int,
    barrier,
    out_q,
) -> None:
    """Runs `agents` (name, ranks) as threads speaking the Node stream; puts their per-round rows."""
    from batchd.core import RankState
    from batchd.proto import batchd_pb2 as pb
    from batchd.proto import batchd_pb2_grpc as pb_grpc
    from batchd.proto import wire

    spec = job_spec(world_size)
    spec_pb = wire.spec_to_pb(spec)
    data = rings([r for _, ranks in agents for r in ranks], world_size, pool)
    gc.collect()
    gc.freeze()
    go = threading.Event()
    stop = threading.Event()
    results: dict[str, list] = {}
    errors: list[str] = []
    cpu: dict[str, float] = {}
    stubs: dict[str, Any] = {}
    channels = []
    ready = threading.Barrier(len(agents) + 1)

    def agent(name: str, ranks: list[int]) -> None:
        try:
            ch = _channel(address)
            channels.append(ch)
            stub = pb_grpc.CoordinatorStub(ch)
            stubs[name] = (stub, ranks)
            states = [RankState(spec, r) for r in ranks]
            feeders = [Feeder(data[r]) for r in ranks]
            q: queue.SimpleQueue = queue.SimpleQueue()
            replies = stub.Node(iter(q.get, None))
            q.put(
                pb.NodeRequest(
                    hello=pb.NodeHello(
                        protocol=pb.NODE_PROTOCOL_V1,
                        node=name,
                        ranks=ranks,
                        spec=spec_pb,
                        address=f"bench-{name}",
                    )
                )
            )
            reg = next(replies)
            assert reg.WhichOneof("kind") == "registered", reg
        except Exception as exc:  # noqa: BLE001
            errors.append(f"agent {name}: {exc!r}")
            ready.abort()
            return
        ready.wait()
        go.wait()
        rows = []
        try:
            for rnd in range(total):
                c0 = time.perf_counter()
                for st, fd in zip(states, feeders, strict=False):
                    fd.fill(st)
                req = pb.NodeRequest(
                    align=pb.NodeAlign(
                        epoch=0, round=rnd, reports=[wire.report_to_pb(st.report(DEPTH), 0) for st in states]
                    )
                )
                t0 = time.perf_counter()
                q.put(req)
                decision = wire.decision_from_pb(next(replies).decision)
                t1 = time.perf_counter()
                req = pb.NodeRequest(
                    commit=pb.NodeCommit(
                        epoch=0,
                        round=rnd,
                        commits=[wire.commit_to_pb(st.apply(decision), 0) for st in states],
                    )
                )
                t2 = time.perf_counter()
                q.put(req)
                totals = wire.totals_from_pb(next(replies).totals)
                t3 = time.perf_counter()
                for st in states:
                    st.finalize(totals)
                t4 = time.perf_counter()
                rows.append((t0, t1, t2, t3, (t0 - c0) + (t2 - t1) + (t4 - t3)))
                if rnd == warmup - 1 and name == agents[0][0]:
                    cpu["start"] = cpu_s()
        except Exception as exc:  # noqa: BLE001
            errors.append(f"agent {name} round {len(rows)}: {exc!r}")
        q.put(None)
        results[name] = rows

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            for stub, ranks in list(stubs.values()):
                try:
                    stub.Heartbeat(pb.HeartbeatRequest(rank=ranks[0], ranks=ranks), timeout=10)
                except Exception as exc:  # noqa: BLE001
                    if not stop.is_set():
                        errors.append(f"heartbeat: {exc!r}")

    threads = [threading.Thread(target=agent, args=a, daemon=True) for a in agents]
    for t in threads:
        t.start()
    hb = threading.Thread(target=beat, daemon=True)
    hb.start()
    try:
        ready.wait(timeout=300)
    except threading.BrokenBarrierError:
        pass
    barrier.wait()
    go.set()
    for t in threads:
        t.join()
    cpu["end"] = cpu_s()
    stop.set()
    for ch in channels:
        ch.close()
    out_q.put({"results": results, "cpu_s": cpu["end"] - cpu.get("start", cpu["end"]), "errors": errors})


def baseline_tree(rev: str) -> str:
    """Exports revision `rev` of this repository to a temporary directory laid out as the installed
    package (`batchd`, with `core`, `service`, `proto`, `client` inside); returns the directory to put
    first on sys.path (the coordinator process of `run_nodes(..., base=)`). Removed at exit."""
    import atexit
    import shutil
    import subprocess
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="node-latency-base-"))
    atexit.register(shutil.rmtree, root, True)
    src = root / "src"
    src.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True, timeout=60)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True, timeout=60)
    pkg = root / "pkg" / "batchd"
    shutil.copytree(src / "batchd", pkg)
    for sub in ("core", "service", "proto", "client"):
        (pkg / sub).symlink_to(src / sub, target_is_directory=True)
    return str(root / "pkg")


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
    try:
        if not parent.poll(60):
            raise RuntimeError("coordinator did not start")
        address = f"127.0.0.1:{parent.recv()}"
        specs = [(f"node-{a}", list(range(a * k, (a + 1) * k))) for a in range(agents)]
        nproc = min(client_procs, agents)
        groups = [specs[i::nproc] for i in range(nproc)]
        barrier = ctx.Barrier(nproc + 1)
        out_q = ctx.Queue()
        for g in groups:
            p = ctx.Process(
                target=agents_main, daemon=True, args=(g, world, address, pool, total, warmup, barrier, out_q)
            )
            p.start()
            procs.append(p)
        barrier.wait(timeout=300)
        outs = []
        while len(outs) < len(groups):
            try:
                outs.append(out_q.get(timeout=0.5))
            except queue.Empty:
                for p in procs:
                    if p.exitcode not in (None, 0):
                        raise RuntimeError(f"client process exited with {p.exitcode}") from None
        parent.send("stop")
        coord_out = parent.recv()
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        coord.join(10)
        if coord.is_alive():
            coord.terminate()
    errors = [e for o in outs for e in o["errors"]]
    if errors:
        raise RuntimeError(f"{len(errors)} error(s) during the benchmark, first: {errors[0]}")
    results: dict[str, list] = {}
    for o in outs:
        results.update(o["results"])
    lat = coord_out["latencies_ms"]
    coord_ms = lat[-rounds:] if len(lat) >= rounds else lat[-min(len(lat), rounds) :]
    # coordinator-own time per round, from the Node wrapper's timestamps
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
        "own_ms": own_ms,
        "client_ms": client_ms,
        "span_ms": span_ms,
        "compute_ms": compute_ms,
        "rounds_per_s": rounds / t_meas,
        "coord_cpu_per_round_ms": 1000 * coord_cpu / rounds,
        "client_cpu_per_round_ms": [1000 * o["cpu_s"] / rounds for o in outs],
        "coord_threads": coord_out["threads"],
    }
    if profile:
        out["profile"] = coord_out.get("profile", "")
        out["profiled_threads"] = coord_out.get("profiled_threads", 0)
    return out


# -- off the critical path: trainers stepping every 50 ms -------------------------------------------
class SimRank:
    """A rank's round loop as in `RankServiceCore._round` (capacity = depth - ready) plus its trainer."""

    def __init__(self, spec, rank: int, client, ring: list, stop: threading.Event) -> None:
        from batchd.core import RankState

        self.state, self.client, self.feeder, self.stop = RankState(spec, rank), client, Feeder(ring), stop
        self.cond = threading.Condition()
        self.ready: collections.deque = collections.deque()
        self.waits: list[tuple[float, float, int]] = []  # (t_want, t_got, ready count found)
        self.rounds = 0
        self.error: str | None = None

    def loop(self) -> None:
        try:
            while not self.stop.is_set():
                self.feeder.fill(self.state)
                with self.cond:
                    while DEPTH - len(self.ready) <= 0 and not self.stop.is_set():
                        self.cond.wait(0.5)
                    capacity = DEPTH - len(self.ready)
                if self.stop.is_set():
                    return
                decision = self.client.align(0, self.state.report(capacity))
                totals = self.client.commit(0, self.state.apply(decision))
                steps = self.state.finalize(totals)
                with self.cond:
                    self.ready.extend(steps)
                    self.rounds += 1
                    self.cond.notify_all()
        except Exception as exc:  # noqa: BLE001
            if not self.stop.is_set():
                self.error = repr(exc)

    def trainer(self, t_go: float) -> None:
        # Lockstep, as DDP trainers are (their all-reduce): step k starts at t_go + k * STEP_S on the clock
        # all processes share; free-running trainers would drift apart by more than a queue's depth.
        k = 0
        while not self.stop.is_set():
            delay = t_go + k * STEP_S - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            k += 1
            t0 = time.perf_counter()
            with self.cond:
                found = len(self.ready)
                while not self.ready and not self.stop.is_set():
                    self.cond.wait(0.5)
                if self.stop.is_set():
                    return
                self.ready.popleft()
                self.cond.notify_all()
            t1 = time.perf_counter()
            self.waits.append((t0, t1, found))


def trainers_main(
    agents: list[tuple[str, list[int]]],
    world_size: int,
    address: str,
    pool: list[int],
    seconds: float,
    warmup_s: float,
    barrier,
    go_at,
    out_q,
) -> None:
    from batchd.service import NodeLink

    spec = job_spec(world_size)
    data = rings([r for _, ranks in agents for r in ranks], world_size, pool)
    gc.collect()
    gc.freeze()
    stop = threading.Event()
    links, ranks_all = [], []
    errors: list[str] = []
    for name, ranks in agents:
        link = NodeLink(address, name, ranks, spec, f"bench-{name}", startup_timeout_s=60)
        link.hello()
        link.start_heartbeats(errors.append)
        links.append(link)
        ranks_all += [SimRank(spec, r, link.client(r), data[r], stop) for r in ranks]
    barrier.wait()
    t_start = time.perf_counter()
    t_go = go_at.value
    threads = [threading.Thread(target=sr.loop, daemon=True) for sr in ranks_all]
    threads += [threading.Thread(target=sr.trainer, args=(t_go,), daemon=True) for sr in ranks_all]
    for t in threads:
        t.start()
    cpu0 = None
    time.sleep(warmup_s)
    cpu0, t0 = cpu_s(), time.perf_counter()
    time.sleep(seconds)
    cpu1, t1 = cpu_s(), time.perf_counter()
    stop.set()
    for sr in ranks_all:
        with sr.cond:
            sr.cond.notify_all()
    for link in links:
        link.close()
    # waiting = the queue was empty when the trainer came for its batch (not the lock hand-off)
    waited = sum(max(0.0, min(b, t1) - max(a, t0)) for sr in ranks_all for a, b, f in sr.waits if f == 0)
    found = [f for sr in ranks_all for a, _, f in sr.waits if t0 <= a <= t1]
    steps = sum(1 for sr in ranks_all for a, _, _ in sr.waits if t0 <= a <= t1)
    errors += [f"rank {sr.state.rank}: {sr.error}" for sr in ranks_all if sr.error]
    out_q.put(
        {
            "waited_s": waited,
            "trainer_s": len(ranks_all) * (t1 - t0),
            "steps": steps,
            "min_found": min(found) if found else -1,
            "found_p50": sorted(found)[len(found) // 2] if found else -1,
            "window": (t0, t1),
            "cpu_s": cpu1 - cpu0,
            "rounds": [sr.rounds for sr in ranks_all],
            "errors": errors,
            "t_start": t_start,
        }
    )
    out_q.close()
    out_q.join_thread()
    os._exit(0)  # the links' threads may still block on the closed stream


def run_trainers(
    agents: int, k: int, pool: list[int], seconds: float, warmup_s: float, client_procs: int
) -> dict[str, Any]:
    world = agents * k
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    coord = ctx.Process(target=coordinator_main, args=(child, world, 0, 0, False), daemon=True)
    coord.start()
    procs = []
    try:
        if not parent.poll(60):
            raise RuntimeError("coordinator did not start")
        address = f"127.0.0.1:{parent.recv()}"
        specs = [(f"node-{a}", list(range(a * k, (a + 1) * k))) for a in range(agents)]
        nproc = min(client_procs, agents)
        groups = [specs[i::nproc] for i in range(nproc)]
        barrier = ctx.Barrier(nproc + 1)
        go_at = ctx.Value("d", 0.0)
        out_q = ctx.Queue()
        for g in groups:
            p = ctx.Process(
                target=trainers_main,
                daemon=True,
                args=(g, world, address, pool, seconds, warmup_s, barrier, go_at, out_q),
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
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        coord.join(10)
        if coord.is_alive():
            coord.terminate()
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
