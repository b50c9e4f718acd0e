"""The simulated side of benchmarks/node_latency.py: node agents as light clients speaking the Node stream
(`agents_main`, one client process's agents as threads) and ranks whose trainers step every 50 ms over the
real agent link (`trainers_main`). Each runs in a spawned process; `ClientGroup` names what it simulates.
batchd is imported inside the functions (a `--before` coordinator process imports another revision's)."""

from __future__ import annotations

import collections
import dataclasses
import gc
import os
import queue
import random
import threading
import time
from typing import Any

BUDGET, WINDOW, DEPTH = 8192, 64, 8
RING = 512  # pre-built samples per rank, used as a ring
HEARTBEAT_S = 2.0
STEP_S = 0.050  # the simulated trainer's step time


def job_spec(world_size: int):
    from batchd.core import JobSpec, PolicySpec

    return JobSpec(
        world_size=world_size,
        token_budget=BUDGET,
        seed=0,
        policy=PolicySpec(name="local", window=WINDOW, depth=DEPTH),
    )


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@dataclasses.dataclass(frozen=True)
class ClientGroup:
    """What one client process simulates: its `agents` (node name, ranks) of a `world_size`-rank job whose
    coordinator listens at `address`, the ranks' samples drawn from the lengths `pool`."""

    agents: list[tuple[str, list[int]]]
    world_size: int
    address: str
    pool: list[int]

    def __post_init__(self) -> None:
        if not self.agents or self.world_size < 1 or not self.pool:
            raise ValueError(
                f"a client group needs agents, ranks and lengths: {self.agents=} {self.world_size=}"
            )


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


class _Swarm:
    """One client process's agents as threads, each holding its ranks' `RankState`s and one Node stream;
    the rows of each agent's rounds (t_sent_align, t_decision, t_sent_commit, t_totals, own compute s)."""

    def __init__(self, group: ClientGroup, total: int, warmup: int) -> None:
        from batchd.proto import wire

        self.group, self.total, self.warmup = group, total, warmup
        self.spec = job_spec(group.world_size)
        self.spec_pb = wire.spec_to_pb(self.spec)
        self.data = rings([r for _, ranks in group.agents for r in ranks], group.world_size, group.pool)
        self.go, self.stop = threading.Event(), threading.Event()
        self.results: dict[str, list] = {}
        self.errors: list[str] = []
        self.cpu: dict[str, float] = {}
        self.stubs: dict[str, Any] = {}
        self.channels: list = []
        self.ready = threading.Barrier(len(group.agents) + 1)

    def _connect(self, name: str, ranks: list[int]) -> tuple[queue.SimpleQueue, Any]:
        """Opens the agent's Node stream and registers its ranks: (request queue, reply iterator)."""
        from batchd.proto import batchd_pb2 as pb
        from batchd.proto import batchd_pb2_grpc as pb_grpc

        ch = _channel(self.group.address)
        self.channels.append(ch)
        stub = pb_grpc.CoordinatorStub(ch)
        self.stubs[name] = (stub, ranks)
        q: queue.SimpleQueue = queue.SimpleQueue()
        replies = stub.Node(iter(q.get, None))
        hello = pb.NodeHello(
            protocol=pb.NODE_PROTOCOL_V1, node=name, ranks=ranks, spec=self.spec_pb, address=f"bench-{name}"
        )
        q.put(pb.NodeRequest(hello=hello))
        reg = next(replies)
        assert reg.WhichOneof("kind") == "registered", reg
        return q, replies

    def _rounds(self, name: str, states: list, q: queue.SimpleQueue, replies: Any) -> list[tuple]:
        from batchd.proto import batchd_pb2 as pb
        from batchd.proto import wire

        feeders = [Feeder(self.data[st.rank]) for st in states]
        rows: list[tuple] = []
        try:
            for rnd in range(self.total):
                c0 = time.perf_counter()
                for st, fd in zip(states, feeders, strict=False):
                    fd.fill(st)
                reports = [wire.report_to_pb(st.report(DEPTH), 0) for st in states]
                req = pb.NodeRequest(align=pb.NodeAlign(epoch=0, round=rnd, reports=reports))
                t0 = time.perf_counter()
                q.put(req)
                decision = wire.decision_from_pb(next(replies).decision)
                t1 = time.perf_counter()
                commits = [wire.commit_to_pb(st.apply(decision), 0) for st in states]
                req = pb.NodeRequest(commit=pb.NodeCommit(epoch=0, round=rnd, commits=commits))
                t2 = time.perf_counter()
                q.put(req)
                totals = wire.totals_from_pb(next(replies).totals)
                t3 = time.perf_counter()
                for st in states:
                    st.finalize(totals)
                t4 = time.perf_counter()
                rows.append((t0, t1, t2, t3, (t0 - c0) + (t2 - t1) + (t4 - t3)))
                if rnd == self.warmup - 1 and name == self.group.agents[0][0]:
                    self.cpu["start"] = cpu_s()
        except Exception as exc:  # noqa: BLE001
            self.errors.append(f"agent {name} round {len(rows)}: {exc!r}")
        return rows

    def agent(self, name: str, ranks: list[int]) -> None:
        from batchd.core import RankState

        try:
            q, replies = self._connect(name, ranks)
            states = [RankState(self.spec, r) for r in ranks]
        except Exception as exc:  # noqa: BLE001
            self.errors.append(f"agent {name}: {exc!r}")
            self.ready.abort()
            return
        self.ready.wait()
        self.go.wait()
        rows = self._rounds(name, states, q, replies)
        q.put(None)
        self.results[name] = rows

    def beat(self) -> None:
        from batchd.proto import batchd_pb2 as pb

        while not self.stop.wait(HEARTBEAT_S):
            for stub, ranks in list(self.stubs.values()):
                try:
                    stub.Heartbeat(pb.HeartbeatRequest(rank=ranks[0], ranks=ranks), timeout=10)
                except Exception as exc:  # noqa: BLE001
                    if not self.stop.is_set():
                        self.errors.append(f"heartbeat: {exc!r}")


def agents_main(group: ClientGroup, total: int, warmup: int, barrier, out_q) -> None:
    """Runs the group's agents as threads speaking the Node stream; puts their per-round rows."""
    swarm = _Swarm(group, total, warmup)
    gc.collect()
    gc.freeze()
    threads = [threading.Thread(target=swarm.agent, args=a, daemon=True) for a in group.agents]
    for t in threads:
        t.start()
    hb = threading.Thread(target=swarm.beat, daemon=True)
    hb.start()
    try:
        swarm.ready.wait(timeout=300)
    except threading.BrokenBarrierError:
        pass
    barrier.wait()
    swarm.go.set()
    for t in threads:
        t.join()
    cpu = swarm.cpu
    cpu["end"] = cpu_s()
    swarm.stop.set()
    for ch in swarm.channels:
        ch.close()
    out_q.put(
        {"results": swarm.results, "cpu_s": cpu["end"] - cpu.get("start", cpu["end"]), "errors": swarm.errors}
    )


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


def trainers_main(group: ClientGroup, seconds: float, warmup_s: float, barrier, go_at, out_q) -> None:
    """The group's ranks over the real agent link (`NodeLink`), each with a trainer stepping every STEP_S
    in lockstep from `go_at`; puts the trainers' waits over `seconds` after `warmup_s`, then exits."""
    from batchd.service import NodeLink

    spec = job_spec(group.world_size)
    data = rings([r for _, ranks in group.agents for r in ranks], group.world_size, group.pool)
    gc.collect()
    gc.freeze()
    stop = threading.Event()
    links, ranks_all = [], []
    errors: list[str] = []
    for name, ranks in group.agents:
        link = NodeLink(group.address, name, ranks, spec, f"bench-{name}", startup_timeout_s=60)
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
