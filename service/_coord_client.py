"""A rank service's connection to the coordinator: registration, the two round barriers, heartbeats.

Every call has a deadline. UNAVAILABLE (coordinator restarting or not up yet) is retried until
`connect_timeout_s`; then the call fails with a message naming the coordinator's address. ABORTED
carries the job's failure message (it names the failed rank) and is never retried.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from batchd import wire
from batchd.core import RankCommit, RankReport, RoundDecision, RoundTotals
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc

from ._coordinator import CHANNEL_OPTIONS
from ._security import Security, channel
from ._spec import JobSpec

log = logging.getLogger("batchd.rank")


class CoordinatorError(RuntimeError):
    """A coordinator call failed for good; `code` is the gRPC status code."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class CoordinatorClient:
    """Talks to the coordinator on behalf of one rank (`security`: TLS / token, None = plaintext)."""

    def __init__(self, address: str, rank: int, spec: JobSpec, connect_timeout_s: float = 30.0,
                 security: Security | None = None) -> None:
        self.address, self.rank, self.spec = address, rank, spec
        self.connect_timeout_s = connect_timeout_s
        self.channel = channel(address, security, CHANNEL_OPTIONS)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.lease_s = 30.0
        self.round_timeout_s = 120.0
        self._stop = threading.Event()
        self._hb: threading.Thread | None = None

    def close(self) -> None:
        self._stop.set()
        self.channel.close()

    def _call(self, what: str, fn: Callable, request, timeout: float):
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                return fn(request, timeout=timeout)
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline and not self._stop.is_set():
                    time.sleep(0.1)
                    continue
                if code == grpc.StatusCode.UNAVAILABLE:
                    raise CoordinatorError(f"coordinator at {self.address} is unreachable ({what} from rank "
                                           f"{self.rank}): {exc.details()}", code) from None
                raise CoordinatorError(f"{what} from rank {self.rank} failed: {code.name}: {exc.details()}",
                                       code) from None

    def register(self, my_address: str) -> pb.RegisterReply:
        reply = self._call("Register", self.stub.Register,
                           pb.RegisterRequest(rank=self.rank, spec=self.spec.to_pb(), address=my_address), 10.0)
        self.lease_s = reply.lease_ms / 1000
        self.round_timeout_s = reply.round_timeout_ms / 1000
        return reply

    def align(self, epoch: int, report: RankReport) -> RoundDecision:
        reply = self._call("Align", self.stub.Align, wire.report_to_pb(report, epoch), self.round_timeout_s + 5)
        return wire.decision_from_pb(reply)

    def commit(self, epoch: int, commit: RankCommit) -> RoundTotals:
        reply = self._call("Commit", self.stub.Commit, wire.commit_to_pb(commit, epoch), self.round_timeout_s + 5)
        return wire.totals_from_pb(reply)

    def fail(self, reason: str) -> None:
        try:
            self.stub.Fail(pb.FailRequest(rank=self.rank, reason=reason), timeout=5)
        except grpc.RpcError as exc:
            log.warning("could not report failure to the coordinator: %s", exc.details())
        except ValueError as exc:  # the channel was closed (this client is shutting down)
            log.warning("could not report failure to the coordinator: %s", exc)

    def start_heartbeats(self, on_failure: Callable[[str], None]) -> None:
        """Heartbeats every lease/3 in a daemon thread; `on_failure(message)` when the job failed or the
        coordinator has been unreachable for a whole lease."""

        def beat() -> None:
            last_ok = time.monotonic()
            while not self._stop.wait(self.lease_s / 3):
                try:
                    reply = self.stub.Heartbeat(pb.HeartbeatRequest(rank=self.rank), timeout=self.lease_s / 3)
                    last_ok = time.monotonic()
                    if reply.state == "failed":
                        on_failure(reply.failure)
                        return
                except ValueError:  # close() closed the channel between the wait and the call
                    return
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.ABORTED:
                        on_failure(exc.details())
                        return
                    if time.monotonic() - last_ok > self.lease_s:
                        on_failure(f"coordinator at {self.address} unreachable for {self.lease_s:g}s: "
                                   f"{exc.code().name}")
                        return

        self._hb = threading.Thread(target=beat, name=f"batchd-heartbeat-{self.rank}", daemon=True)
        self._hb.start()
