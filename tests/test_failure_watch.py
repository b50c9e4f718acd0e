"""The trainer's `FailureWatch` (batchd/_train/failure.py) against a real gRPC rank service stand-in on
loopback: it reports the job's failure, and `stop()` ends its thread even while a poll is in flight, so
a trainer never exits with the watch still inside gRPC (CI saw trainers abort at exit, SIGABRT)."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc
from batchd.testing import FailureWatch


class _Status(pb_grpc.RankServiceServicer):
    """RankStatus only: holds each call until `release` is set (at most `hold_s`), then answers
    `failure`."""

    def __init__(self, failure: str = "", hold_s: float = 0.0) -> None:
        self.failure, self.hold_s = failure, hold_s
        self.entered = threading.Event()
        self.release = threading.Event()

    def RankStatus(self, request, context):  # noqa: N802 - gRPC's method name
        self.entered.set()
        if self.hold_s:
            self.release.wait(self.hold_s)
        return pb.RankStatusReply(failure=self.failure)


class _Client:
    """What FailureWatch uses of a BatchClient: its rank and its stub."""

    def __init__(self, port: int) -> None:
        self.rank, self.address = 0, f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.RankServiceStub(self.channel)


@pytest.fixture
def serve():
    servers, clients = [], []

    def start(servicer: _Status) -> _Client:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RankServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        clients.append(_Client(port))
        return clients[-1]

    yield start
    for c in clients:
        c.channel.close()
    for s in servers:
        s.stop(None)


def test_stop_waits_for_a_poll_in_flight(serve):
    servicer = _Status(hold_s=10.0)
    watch = FailureWatch(serve(servicer), period_s=0.01)
    assert servicer.entered.wait(30), "the watch never polled"
    threading.Timer(0.3, servicer.release.set).start()  # the poll in flight answers a little later
    watch.stop()
    assert not watch._thread.is_alive(), "stop() returned with the watch still inside its poll"
    assert watch.failure is None


def test_the_job_failure_is_kept(serve):
    servicer = _Status(failure="rank 1: its trainer exited")
    watch = FailureWatch(serve(servicer), period_s=0.01)
    watch._thread.join(30)  # the thread ends once it read a failure
    assert watch.failure == "rank 1: its trainer exited"
    watch.stop()
