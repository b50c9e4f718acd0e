"""The grpc.aio coordinator's barriers: sync callers and Node streams in one barrier, failure and shutdown
waking every waiter with their status, a cancelled stream leaving the others waiting.

A real server on loopback; the sync side calls `CoordinatorState` directly from a thread. Every wait is
a deadline.
"""

from __future__ import annotations

import queue
import threading

import grpc
import pytest

from batchd.core import JobSpec, PolicySpec, RankCommit, RankReport
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc
from batchd.proto import wire
from batchd.service import create_server
from batchd.service.coordinator import Barrier

HOST = "127.0.0.1"
SPEC = JobSpec(world_size=3, token_budget=1024, policy=PolicySpec(name="local", window=8, depth=2))


@pytest.fixture
def coordinator():
    server, port, state = create_server(f"{HOST}:0", SPEC, 30.0, 60.0)
    server.start()
    channel = grpc.insecure_channel(f"{HOST}:{port}")
    yield pb_grpc.CoordinatorStub(channel), state
    channel.close()
    state.close()
    server.stop(0)


class Stream:
    """A Node stream fed from a queue (hello sent at once); `replies` iterates the coordinator's."""

    def __init__(self, stub, node: str, ranks: list[int]) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.q.put(
            pb.NodeRequest(
                hello=pb.NodeHello(
                    protocol=pb.NODE_PROTOCOL_V1,
                    node=node,
                    ranks=ranks,
                    spec=wire.spec_to_pb(SPEC),
                    address=f"{HOST}:1",
                )
            )
        )
        self.call = stub.Node(iter(self.q.get, None), timeout=20)
        assert next(self.call).WhichOneof("kind") == "registered"
        self.ranks = ranks

    def align(self, rnd: int = 0) -> None:
        self.q.put(
            pb.NodeRequest(
                align=pb.NodeAlign(
                    epoch=0,
                    round=rnd,
                    reports=[
                        wire.report_to_pb(RankReport(r, rnd, 1, 0, 0, False, ()), 0) for r in self.ranks
                    ],
                )
            )
        )

    def commit(self, rnd: int = 0) -> None:
        self.q.put(
            pb.NodeRequest(
                commit=pb.NodeCommit(
                    epoch=0,
                    round=rnd,
                    commits=[wire.commit_to_pb(RankCommit(r, rnd, (), 0, False), 0) for r in self.ranks],
                )
            )
        )


def _align(state, report: RankReport):
    """A sync caller's Align (as a rank service alone would send it): submit, then wait on the barrier."""
    got = state.submit_align(0, [report])
    return state.outcome(got, [report.rank], timeout=20) if isinstance(got, Barrier) else got


def _commit(state, commit: RankCommit):
    got = state.submit_commit(0, [commit])
    return state.outcome(got, [commit.rank], timeout=20) if isinstance(got, Barrier) else got


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_sync_caller_and_a_node_stream_share_one_barrier(coordinator):
    stub, state = coordinator
    state.register(0, SPEC, f"{HOST}:2")
    stream = Stream(stub, "n", [1, 2])
    t, out = _in_thread(lambda: _align(state, RankReport(0, 0, 1, 0, 0, False, ())))
    stream.align()
    reply = next(stream.call)
    t.join(10)
    assert reply.WhichOneof("kind") == "decision" and reply.decision.round == 0
    assert out["value"].round == 0 and out["value"].target == reply.decision.target
    t, out = _in_thread(lambda: _commit(state, RankCommit(0, 0, (), 0, False)))
    stream.commit()
    totals = next(stream.call).totals
    t.join(10)
    assert totals.round == 0 and out["value"].steps == totals.steps == 0
    assert state.core.round == 1 and len(state.latencies_ms) == 1
    stream.q.put(None)


def test_fail_wakes_every_waiter_with_aborted_and_tells_its_ranks(coordinator):
    stub, state = coordinator
    state.register(0, SPEC, f"{HOST}:2")
    stream = Stream(stub, "n", [1, 2])
    stream.align()  # waits for rank 0
    t, out = _in_thread(lambda: next(stream.call))
    t.join(0.3)
    assert t.is_alive(), "the barrier completed without rank 0"
    stub.Fail(pb.FailRequest(rank=0, reason="trainer crashed"), timeout=5)
    t.join(10)
    assert out["error"].code() == grpc.StatusCode.ABORTED
    assert "rank 0: trainer crashed" in out["error"].details()
    assert {1, 2} <= state.informed
    with pytest.raises(Exception, match="trainer crashed"):
        _align(state, RankReport(0, 0, 1, 0, 0, False, ()))


def test_close_wakes_waiters_with_unavailable_and_a_cancelled_stream_leaves_the_others(coordinator):
    stub, state = coordinator
    gone = Stream(stub, "gone", [0])
    gone.align()
    stream = Stream(stub, "n", [1])
    stream.align()  # rank 2 never reports: the barrier stays pending
    gone.call.cancel()  # its waiter's future is cancelled; the other waiter keeps waiting
    t, out = _in_thread(lambda: next(stream.call))
    t.join(0.3)
    assert t.is_alive()
    state.close()
    t.join(10)
    assert out["error"].code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in out["error"].details()


def test_stop_releases_the_port_for_a_restart_at_once():
    server, port, state = create_server(f"{HOST}:0", SPEC)
    server.start()
    state.close()
    server.stop(0)
    again, port2, state2 = create_server(f"{HOST}:{port}", SPEC)
    try:
        assert port2 == port
        again.start()
        with grpc.insecure_channel(f"{HOST}:{port}") as ch:
            assert pb_grpc.CoordinatorStub(ch).Status(pb.StatusRequest(), timeout=5).state == "running"
    finally:
        state2.close()
        assert again.stop(1.0).wait(10)


_STOP_FREES_THE_POLLER = """
import sys
from batchd.core import JobSpec, PolicySpec
from batchd.service import create_server

for _ in range(3):
    server, port, state = create_server("127.0.0.1:0", JobSpec(world_size=1, token_budget=1024), 30.0, 60.0)
    server.start()
    loop = server._loop
    readers = lambda: {k.fd for k in loop._selector.get_map().values()} - {loop._ssock.fileno()}
    assert readers(), "gRPC's poller socket is a reader of the loop while the server runs"
    state.close()
    assert server.stop(1.0).wait(10)
    # `server` is still held here: the poller's socket must already be off the loop (and closed)
    assert not readers(), readers()
print("ok")
"""


def test_stop_shuts_grpc_aio_down_on_the_loop_before_the_caller_lets_go():
    """gRPC's asyncio module shuts down (its poller's socket off the loop, closed) when its last server is
    freed. The server is freed on the loop's own thread as it stops, before `stop()`'s event is set, so
    the caller that drops it later (`run_coordinator` returning) never closes that socket under the loop
    thread running its reader: the `PollerCompletionQueue._handle_events ... OSError: [Errno 9] Bad file
    descriptor` traceback at exit. Its own process: no other gRPC asyncio object may be alive there."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _STOP_FREES_THE_POLLER], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("mode", ["join", "non-join"])
def test_commits_read_off_the_wire_total_as_the_core_sums_them(mode):
    """`commit_with_sums_from_pb`'s lazy steps and C sums give the core's totals exactly, cut or not."""
    import random

    from batchd.core import Coordinator, RoundDecision

    rng = random.Random(7)
    for quota in (10_000, 40, 3):
        spec = JobSpec.from_keys(
            world_size=4,
            token_budget=1024,
            window=8,
            depth=4,
            mode=mode,
            **({"quota": quota} if mode == "non-join" else {}),
        )
        commits = [
            RankCommit(
                r,
                0,
                tuple(
                    tuple((rng.randint(1, 900), rng.randint(0, 900)) for _ in range(rng.randint(0, 9)))
                    for _ in range(3)
                ),
                rng.randint(0, 5),
                False,
            )
            for r in range(4)
        ]
        totals = []
        for wire_side in (False, True):
            core = Coordinator(spec, 0)
            core.resume_decided(RoundDecision(0, 3))
            if wire_side:
                read = [wire.commit_with_sums_from_pb(wire.commit_to_pb(c, 0)) for c in commits]
                assert [c for c, _ in read] == commits
                totals.append(core.commit([c for c, _ in read], {c.rank: s for c, s in read}))
            else:
                totals.append(core.commit(commits))
        assert totals[0] == totals[1]


def test_the_method_table_is_the_generated_one_with_replies_passed_as_bytes():
    """Registration takes the generated table (every method of the service, its streaming kind) and only
    wraps each response serializer so that a reply serialized once for a whole round passes through."""
    from batchd.service import CoordinatorServicer, CoordinatorState
    from batchd.service.coordinator import method_handlers

    state = CoordinatorState(SPEC)
    try:
        table = method_handlers(CoordinatorServicer(state))
    finally:
        state.close()
    assert set(table) == set(pb.DESCRIPTOR.services_by_name["Coordinator"].methods_by_name)
    reply = pb.AlignReply(epoch=1, round=3, target=2)
    serialize = table["Align"].response_serializer
    assert serialize(reply) == reply.SerializeToString() and serialize(b"shared") == b"shared"
    assert table["Node"].request_streaming and table["Node"].response_streaming
    assert not table["Commit"].request_streaming and not table["Commit"].response_streaming
