"""Node agents in one process: a real gRPC coordinator and `NodeAgent`s (several ranks each) on loopback.

What a node agent must keep from one-rank services: equal steps, every id once, exact resume after an
abrupt restart; what it adds: one coordinator stream per node, moves between its ranks in process, a
failure that names the agent, refusals of a peer of another protocol version or of a rank claimed twice.
Every wait is a deadline on an event.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from _jobs import drain_clients
from _procs import wait_until

from batchd.client import BatchClient, ClientOptions
from batchd.core import JobSpec, PolicySpec, RankState, RoundDecision, Sample
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc
from batchd.proto import wire
from batchd.service import (
    CoordinatorMetrics,
    CoordinatorState,
    Endpoint,
    Limits,
    NodeAgent,
    NodeLink,
    create_server,
    node_ranks,
)
from batchd.service.preprocess import SyntheticData, SyntheticSource

HOST = "127.0.0.1"


def _lengths(n=360, seed=5):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.2, 0.9, n), 2, 1000).astype(int).tolist()


class NodeJob:
    """A coordinator and `nodes` node agents of `spec.world_size // nodes` ranks each, in this process."""

    def __init__(
        self, spec: JobSpec, lengths, nodes: int, state_dir=None, lease_s: float = 10.0, **source_kwargs
    ) -> None:
        """`source_kwargs` go to every `SyntheticSource`'s `SyntheticData` (e.g. images=, patch_dim=,
        vocab_size=)."""
        self.spec, self.lengths, self.state_dir, self.lease_s = spec, lengths, state_dir, lease_s
        self.source_kwargs = source_kwargs
        self.k = spec.world_size // nodes
        self.metrics = CoordinatorMetrics(spec.world_size, spec.cost_model())
        self.coordinator_dir = None if state_dir is None else state_dir / "coordinator"
        self.server, self.port, self.state = create_server(
            f"{HOST}:0", spec, lease_s, 60.0, metrics=self.metrics, state_dir=self.coordinator_dir
        )
        self.server.start()
        self.agents: list[NodeAgent] = []
        try:
            for g in range(nodes):
                self.agents.append(self._agent(g, 0))
        except BaseException:
            self.stop()
            raise

    def _agent(self, g: int, port: int) -> NodeAgent:
        spec = self.spec
        sources = {
            r: SyntheticSource(
                SyntheticData(self.lengths, **self.source_kwargs),
                r,
                spec.world_size,
                spec.seed,
                0,
                spec.shuffle,
            )
            for r in range(g * self.k, (g + 1) * self.k)
        }
        agent = NodeAgent(
            spec,
            f"{HOST}:{self.port}",
            f"node-{g}",
            sources,
            Endpoint(HOST, port),
            Limits(startup_timeout_s=30.0),
            state_dir=None if self.state_dir is None else self.state_dir / f"node-{g}",
        )
        agent.start()
        return agent

    def restart(self, g: int) -> NodeAgent:
        """Stops agent `g` abruptly (its loops and server stop; nothing is written beyond its journals) and
        starts a new one on the same port from its journals."""
        old = self.agents[g]
        old.stop(grace=0)  # returns once its ranks' loops ended
        self.agents[g] = self._agent(g, old.port)
        return self.agents[g]

    def restart_coordinator(self) -> None:
        """Kills the coordinator abruptly and starts a new one on the same port from its journal."""
        self.server.stop(0)
        self.state.close()
        self.server, port, self.state = create_server(
            f"{HOST}:{self.port}", self.spec, self.lease_s, 60.0, state_dir=self.coordinator_dir
        )
        assert port == self.port
        self.server.start()

    def address(self, rank: int) -> str:
        return f"{HOST}:{self.agents[rank // self.k].port}"

    def stop(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(Exception):
                agent.stop(grace=0)
        self.server.stop(0)
        self.state.close()


@pytest.fixture
def node_job():
    jobs = []

    def make(*args, **kwargs):
        jobs.append(NodeJob(*args, **kwargs))
        return jobs[-1]

    yield make
    for job in jobs:
        job.stop()


def _drain(job: NodeJob, on_step=None, limit_s: float = 90.0) -> list[list[tuple[list[int], object]]]:
    """Every rank's steps (sample ids, StepInfo), one BatchClient thread per rank."""
    world = job.spec.world_size
    return [
        epochs[0]
        for epochs in drain_clients(
            lambda r: BatchClient(job.address(r), r, world, options=ClientOptions(reconnect_timeout_s=30)),
            world,
            1,
            limit_s,
            lambda batch, info: (batch["sample_ids"].tolist(), info),
            on_step,
        )
    ]


def _check_exactly_once(results, n: int) -> None:
    steps = [len(r) for r in results]
    assert len(set(steps)) == 1 and steps[0] > 0, steps
    ids = sorted(i for r in results for ids, _ in r for i in ids)
    assert ids == list(range(n)), f"{len(ids)} ids, {len(set(ids))} distinct, expected {n}"


@pytest.mark.parametrize(
    "plan",
    [{"nodes": "blind"}, {"cost": "packed"}, {"nodes": "aware"}],
    ids=["node-blind", "node-local", "node-aware"],
)
def test_node_agents_run_a_balanced_job_moving_samples_between_their_ranks_in_process(node_job, plan):
    lengths = _lengths()
    spec = JobSpec.from_keys(
        world_size=4, token_budget=1024, policy="balanced", window=24, depth=3, seed=11, **plan
    )
    job = node_job(spec, lengths, nodes=2)
    results = _drain(job)
    _check_exactly_once(results, len(lengths))
    assert job.state.node_of == {0: "node-0", 1: "node-0", 2: "node-1", 3: "node-1"}
    assert job.state.topology() == [0, 0, 1, 1]
    assert job.state.core.nodes == (None if plan == {"nodes": "blind"} else [0, 0, 1, 1])
    home = {i: r for a in job.agents for r, c in a.cores.items() for i in c.source.view._view}
    moved = [sum(1 for ids, _ in res for i in ids if home[i] != r) for r, res in enumerate(results)]
    local = {r: c.fetched["local"] for a in job.agents for r, c in a.cores.items()}
    remote = {r: c.fetched["remote"] for a in job.agents for r, c in a.cores.items()}
    # Every sample placed off its home rank was taken in process (same node) or fetched (other node).
    assert [local[r] + remote[r] for r in range(4)] == moved, (local, remote, moved)
    assert sum(local.values()) > 0, "no move between the ranks of one agent: the in-process path is untested"
    scraped = {
        (m.name, s.labels.get("scope")): s.value
        for m in job.metrics.registry.collect()
        for s in m.samples
        if m.name.startswith("batchd_job_moved") and s.name.endswith("_total")
    }
    assert scraped[("batchd_job_moved_samples", "intra_node")] == sum(local.values()), scraped
    assert scraped[("batchd_job_moved_samples", "cross_node")] == sum(remote.values()), scraped
    assert scraped[("batchd_job_moved_bytes", "cross_node")] > 0, scraped
    for r in range(4):
        same_node = sum(1 for ids, _ in results[r] for i in ids if home[i] != r and home[i] // 2 == r // 2)
        assert local[r] == same_node, (r, local[r], same_node)
    if "cost" in plan:  # node-local rounds cross no node: only the epoch's node-blind tail fetches
        assert job.state.core.plan_stats.get("node_local", 0) >= 3, job.state.core.plan_stats
        assert sum(remote.values()) < 0.3 * (sum(local.values()) + sum(remote.values())), (local, remote)


def test_an_agent_restarted_abruptly_mid_epoch_resumes_its_ranks_exactly(node_job, tmp_path):
    lengths = _lengths(300, seed=8)
    spec = JobSpec(
        world_size=4, token_budget=1024, seed=4, policy=PolicySpec(name="balanced", window=16, depth=2)
    )
    job = node_job(spec, lengths, nodes=2, state_dir=tmp_path)
    restarted = threading.Event()

    def on_step(rank: int, n: int) -> None:
        if rank == 2 and n == 6 and not restarted.is_set():
            restarted.set()
            threading.Thread(target=job.restart, args=(1,), daemon=True).start()

    results = _drain(job, on_step)
    assert restarted.is_set()
    _check_exactly_once(results, len(lengths))
    for s in range(len(results[0])):
        assert len({res[s][1].step for res in results}) == 1


def test_node_agents_ride_out_a_coordinator_restart(node_job, tmp_path):
    lengths = _lengths(240, seed=2)
    spec = JobSpec(
        world_size=4, token_budget=1024, seed=9, policy=PolicySpec(name="balanced", window=16, depth=2)
    )
    job = node_job(spec, lengths, nodes=2, state_dir=tmp_path)
    restarted = threading.Event()

    def on_step(rank: int, n: int) -> None:
        if rank == 0 and n == 4 and not restarted.is_set():
            restarted.set()
            threading.Thread(target=job.restart_coordinator, daemon=True).start()

    results = _drain(job, on_step)
    assert restarted.is_set() and job.state.restored
    _check_exactly_once(results, len(lengths))


def test_a_trainer_taking_5s_per_step_is_waited_for_past_the_lease(node_job):
    """Timeouts judge liveness, never speed: with a 2 s lease, a trainer that takes 5 s per step holds every
    barrier for longer than a lease; the node heartbeats keep its agent (and the other) alive."""
    lengths = [300] * 48
    spec = JobSpec(
        world_size=4, token_budget=1024, seed=1, policy=PolicySpec(name="balanced", window=4, depth=1)
    )
    job = node_job(spec, lengths, nodes=2, lease_s=2.0)
    slow_steps = []

    def on_step(rank: int, n: int) -> None:
        if rank == 3 and n <= 2:
            slow_steps.append(n)
            time.sleep(5.0)  # the stand-in for a slow GPU step, not a wait for an event

    results = _drain(job, on_step)
    assert slow_steps == [1, 2] and job.state.failure is None
    _check_exactly_once(results, len(lengths))


def test_a_stopped_agent_waits_for_its_link_thread_inside_a_call(node_job, monkeypatch):
    """`NodeAgent.stop` returns once its link's thread left the call it was in: a thread still inside a
    gRPC call when a process exits is ended holding that call's lock, and the exit hangs on it (CI)."""
    entered, release = threading.Event(), threading.Event()
    submit = CoordinatorState.submit_align

    def held(self, epoch, reports):  # the first round's reports wait: the link stays inside its call
        entered.set()
        release.wait(10)
        return submit(self, epoch, reports)

    monkeypatch.setattr(CoordinatorState, "submit_align", held)
    exchange = NodeLink._exchange

    def slow_to_leave(self, request, what):  # the call ends under the thread: it leaves a little later
        try:
            return exchange(self, request, what)
        finally:
            time.sleep(0.5)

    monkeypatch.setattr(NodeLink, "_exchange", slow_to_leave)
    spec = JobSpec(world_size=2, token_budget=1024, seed=3, policy=PolicySpec(name="balanced", window=8))
    job = node_job(spec, _lengths(120, seed=3), nodes=1)
    agent = job.agents[0]
    try:
        assert entered.wait(30), "the node agent never sent its first round"
        link = [t for t in threading.enumerate() if t.name == f"batchd-node-link-{agent.name}"]
        assert len(link) == 1, threading.enumerate()
        agent.stop(grace=0)
        assert not link[0].is_alive(), "stop() returned with the link's thread still inside its call"
    finally:
        release.set()


def test_node_ranks_follow_torchrun_and_name_what_is_missing():
    assert node_ranks(4, 2) == [8, 9, 10, 11]
    assert node_ranks(env={"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "3"}) == [6, 7]
    assert node_ranks(env={"LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1"}) == [2, 3]
    with pytest.raises(ValueError, match=r"--node-rank.*GROUP_RANK"):
        node_ranks(env={"LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE='two'"):
        node_ranks(env={"LOCAL_WORLD_SIZE": "two", "GROUP_RANK": "0"})
    with pytest.raises(ValueError, match="local_ranks must be >= 1"):
        node_ranks(0, 0)


@pytest.fixture
def coordinator():
    spec = JobSpec(world_size=4, token_budget=1024, policy=PolicySpec(name="local", window=8, depth=2))
    server, port, state = create_server(f"{HOST}:0", spec, 1.5, 60.0)
    server.start()
    channel = grpc.insecure_channel(f"{HOST}:{port}")
    yield spec, pb_grpc.CoordinatorStub(channel), state
    channel.close()
    server.stop(0)
    state.close()


def _hello(spec, node, ranks, protocol=pb.NODE_PROTOCOL_V1, address="127.0.0.1:1"):
    return pb.NodeRequest(
        hello=pb.NodeHello(
            protocol=protocol, node=node, ranks=ranks, spec=wire.spec_to_pb(spec), address=address
        )
    )


def test_the_coordinator_refuses_a_node_of_another_protocol_or_out_of_order(coordinator):
    spec, stub, state = coordinator
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Node(iter([_hello(spec, "old", [0, 1], protocol=pb.NODE_PROTOCOL_UNSPECIFIED)]), timeout=5))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "node protocol 0" in e.value.details() and "same batchd version" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Node(iter([pb.NodeRequest(align=pb.NodeAlign(epoch=0, round=0))]), timeout=5))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "before its hello" in e.value.details()
    report = pb.AlignRequest(rank=3, epoch=0, round=0, capacity=1)
    with pytest.raises(grpc.RpcError) as e:
        list(
            stub.Node(
                iter(
                    [
                        _hello(spec, "a", [0, 1]),
                        pb.NodeRequest(align=pb.NodeAlign(epoch=0, round=0, reports=[report])),
                    ]
                ),
                timeout=5,
            )
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "rank(s) [3], which it did not register" in e.value.details()
    bad = JobSpec(world_size=4, token_budget=2048, policy=PolicySpec(name="local", window=8, depth=2))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Node(iter([_hello(bad, "b", [2, 3])]), timeout=5))
    assert "token_budget: coordinator 1024, node agent 2048" in e.value.details()


def test_two_live_agents_cannot_serve_one_rank_and_a_silent_one_fails_the_job_naming_it(coordinator):
    spec, stub, state = coordinator
    state.register_node("a", [0, 1], spec, "10.0.0.1:7100")
    with pytest.raises(
        ValueError, match=r"node agent 'b' claims rank 1, which node agent 'a' at 10.0.0.1:7100"
    ):
        state.register_node("b", [1, 2], spec, "10.0.0.2:7100")
    state.register_node("b", [2, 3], spec, "10.0.0.2:7100")
    assert state.topology() == [0, 0, 1, 1]
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # node a heartbeats (both its ranks in one call); b stays silent
        stub.Heartbeat(pb.HeartbeatRequest(rank=0, ranks=[0, 1]), timeout=5)
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while state.failure is None and time.monotonic() < deadline:
        stub.Heartbeat(pb.HeartbeatRequest(rank=0, ranks=[0, 1]), timeout=5)
        time.sleep(0.2)
    assert state.failure is not None, "the silent node agent did not fail the job"
    assert (
        "node agent 'b' at 10.0.0.2:7100, ranks 2-3" in state.failure and "missed its lease" in state.failure
    )


def test_a_balanced_plan_reaches_each_node_cut_to_what_it_needs():
    from batchd.core import decision_for_node

    s = [Sample(i, 10 + i, home_rank=i % 4) for i in range(8)]
    plan = ((tuple(s[0:2]),), (tuple(s[2:5]),), (tuple(s[5:7]),), (tuple(s[7:8]),))
    decision = RoundDecision(3, 1, plan)
    reply = pb.NodeReply.FromString(
        wire.node_decision_to_pb(decision_for_node(decision, {0, 1}), 0).SerializeToString()
    )
    got = wire.decision_from_pb(reply.decision)
    assert got.plan[0] == plan[0] and got.plan[1] == plan[1]  # its own ranks: whole
    # others: only what ranks 0 and 1 lend them (homes 0 and 1)
    assert got.plan[2] == ((s[5],),) and got.plan[3] == ((),)
    assert got.target == 1 and got.round == 3


def test_a_replay_goes_at_once_while_the_nodes_other_rank_is_elsewhere():
    """After a restart, a rank behind replays rounds the coordinator has passed without waiting for the
    node's other rank (which may wait for its trainer, which waits in DDP for this one)."""
    spec = JobSpec(world_size=2, token_budget=256, policy=PolicySpec(name="local", window=4, depth=4))
    server, port, state = create_server(f"{HOST}:0", spec, 10.0, 60.0)
    server.start()
    links = []
    try:

        def run_round(link, states, which):
            out = {}

            def one(r):
                report = states[r].report(4)
                decision = link.call(r, "align", 0, report)
                commit = states[r].apply(decision)
                out[r] = states[r].finalize(link.call(r, "commit", 0, commit))

            threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in which]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert set(out) == set(which), f"round did not complete for ranks {sorted(set(which) - set(out))}"
            return out

        def fresh_states():
            states = {r: RankState(spec, r) for r in (0, 1)}
            for r, st in states.items():
                for i in range(4):
                    st.push(Sample(r + 2 * i, 10, home_rank=r))
            return states

        link = NodeLink(f"{HOST}:{port}", "n", [0, 1], spec, "127.0.0.1:9", startup_timeout_s=10)
        links.append(link)
        link.hello()
        states = fresh_states()
        first = run_round(link, states, [0, 1])
        link.close()
        # The agent restarts: rank 0's journal is past round 0, rank 1's is not (it replays round 0 alone).
        link2 = NodeLink(f"{HOST}:{port}", "n", [0, 1], spec, "127.0.0.1:9", startup_timeout_s=10)
        links.append(link2)
        assert link2.hello().round == 1 and link2.position == (0, 1)
        replayed = fresh_states()
        again = run_round(link2, replayed, [1])
        assert [st.info for st in again[1]] == [st.info for st in first[1]]
    finally:
        for link in links:
            link.close()
        server.stop(0)
        state.close()


def test_an_agent_told_apart_from_a_coordinator_that_predates_node_agents():
    """A coordinator without the Node RPC (an older build): the agent fails at once, saying so."""
    from batchd.core import CoordinatorError

    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port(f"{HOST}:0")
    server.start()  # serves no method at all: every call is UNIMPLEMENTED
    link = NodeLink(
        f"{HOST}:{port}",
        "n",
        [0],
        JobSpec(world_size=1, token_budget=64, policy=PolicySpec(name="local", window=512, depth=8)),
        "127.0.0.1:9",
        startup_timeout_s=5,
    )
    try:
        with pytest.raises(CoordinatorError, match="does not serve node agents.*same batchd version"):
            link.hello()
    finally:
        link.close()
        server.stop(0)


def test_a_dead_agent_is_noticed_at_once_and_without_a_journal_fails_the_job_before_its_lease(
    node_job, tmp_path, caplog
):
    """An agent's process gone (its stream broke) is logged at once; one that journals is waited for (a
    restart resumes it), one without a journal fails the job once it has not reconnected for 10 s,
    naming it, long before its 60 s lease."""
    spec = JobSpec(
        world_size=4, token_budget=1024, seed=4, policy=PolicySpec(name="balanced", window=16, depth=2)
    )
    journaled = node_job(spec, _lengths(200), nodes=2, state_dir=tmp_path, lease_s=60.0)
    plain = node_job(spec, _lengths(200), nodes=2, lease_s=60.0)
    for job in (journaled, plain):
        wait_until("both agents registered", lambda j=job: len(j.state.liveness.registered) == 4, 30)
    with caplog.at_level(logging.WARNING, logger="batchd.coordinator"):
        t0 = time.monotonic()
        for job in (journaled, plain):
            job.agents[1].stop(grace=0)
        wait_until("the plain job failed", lambda: plain.state.failure is not None, 40)
        took = time.monotonic() - t0
    assert "node agent 'node-1' (rank(s) [2, 3]) went away" in plain.state.failure, plain.state.failure
    assert "keeps no journal" in plain.state.failure and took < 30, (took, plain.state.failure)
    assert journaled.state.failure is None, journaled.state.failure
    assert "node agent 'node-1' (rank(s) [2, 3]): its stream broke" in caplog.text
    assert "resumes from its journal" in caplog.text
