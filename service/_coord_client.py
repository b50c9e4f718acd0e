"""A rank service's connection to the coordinator: registration, the two round barriers, heartbeats, finish.

Timeouts judge liveness, never speed:
- start-up: `register` waits up to `startup_timeout_s` (default 10 min) for a coordinator that is not up
  yet, logging every few seconds whom it waits for;
- during the job, a call that finds the coordinator unreachable (restarting from its journal, its host
  cut off) is retried for up to `patience(lease)`, two leases, then fails with a message naming its
  address;
- the barrier calls themselves have no deadline: a barrier lasts as long as the slowest rank's trainer
  needs; a coordinator that vanished is found by the connection breaking (or keepalive pings);
- heartbeats every min(lease/3, 2 s); a coordinator unreachable for two leases fails the job, naming it.

Why two leases: the coordinator alone judges liveness, with one lease; a party never gives up on it
sooner than it could still be taken back. The second lease covers the time a healed link takes to carry
a stalled connection's traffic again (TCP's retransmission backoff holds it for up to about as long
as the outage, docs/deployment.md#network-faults) and the heartbeat in flight, so a link outage the
coordinator rides through never fails a party on its own; a coordinator that failed the job meanwhile
says why as soon as it is reached again.
ABORTED carries the job's failure message (it names the failed rank) and is never retried.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from batchd.core import CoordinatorError, JobSpec, RankCommit, RankReport, RoundDecision, RoundTotals
from batchd.proto import (
    CHANNEL_OPTIONS,
    Security,
    Unreachable,
    channel,
    retry_while_unreachable,
    transient,
    wire,
)
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc

log = logging.getLogger("batchd.rank")


HEARTBEAT_S = 2.0  # at most this long between two heartbeats
PATIENCE_LEASES = 2  # a party waits this many of the coordinator's leases for it (module docstring)


def patience(lease_s: float) -> float:
    """Seconds a party retries a coordinator (or peer) it cannot reach before it fails the job."""
    return PATIENCE_LEASES * lease_s


def call_coordinator(
    address: str,
    rank: int,
    what: str,
    fn: Callable[..., Any],
    request: Any,
    timeout: float | None,
    retry_s: float,
    stop: threading.Event,
) -> Any:
    """`fn(request, timeout=timeout)`, a unary call of rank `rank` to the coordinator at `address`, retried
    while the coordinator is unreachable for up to `retry_s` (or until `stop`); raises CoordinatorError
    naming the address, the call and the rank (its gRPC code kept) when it gives up or is refused."""
    try:
        return retry_while_unreachable(
            lambda: fn(request, timeout=timeout),
            retry_s,
            f"the coordinator at {address} ({what} of rank {rank})",
            stop=stop,
            logger=log,
        )
    except Unreachable as gone:
        raise CoordinatorError(
            f"coordinator at {address} unreachable for {gone.elapsed_s:.0f}s "
            f"({what} from rank {rank}): {gone.error.details()}",
            gone.error.code(),
        ) from None
    except grpc.RpcError as exc:
        raise CoordinatorError(
            f"{what} from rank {rank} failed: {exc.code().name}: {exc.details()}", exc.code()
        ) from None


class CoordinatorLink(Protocol):
    """What a rank service calls of its coordinator: a `CoordinatorClient` of its own, or, in a node
    agent, the node's `LocalRankClient` (its aligns and commits ride the node's one stream)."""

    @property
    def lease_s(self) -> float: ...

    @property
    def patience_s(self) -> float: ...

    def register(self, my_address: str) -> pb.RegisterReply: ...

    def align(self, epoch: int, report: RankReport) -> RoundDecision: ...

    def commit(self, epoch: int, commit: RankCommit) -> RoundTotals: ...

    def resume(self, epoch: int, step: int, from_world: int) -> pb.ResumeReply: ...

    def oom(self, request: pb.OomRequest) -> pb.OomReply: ...

    def finish(self) -> None: ...

    def fail(self, reason: str) -> None: ...

    def start_heartbeats(self, on_failure: Callable[[str], None]) -> None: ...


class CoordinatorClient:
    """Talks to the coordinator on behalf of one rank (`security`: TLS / token, None = plaintext)."""

    def __init__(
        self,
        address: str,
        rank: int,
        spec: JobSpec,
        startup_timeout_s: float = 600.0,
        security: Security | None = None,
    ) -> None:
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s=}")
        self.address, self.rank, self.spec = address, rank, spec
        self.startup_timeout_s = startup_timeout_s
        self.channel = channel(address, security, CHANNEL_OPTIONS)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.lease_s = 60.0  # the coordinator's, once registered
        self.registered = False
        self._stop = threading.Event()
        self._hb: threading.Thread | None = None

    @property
    def patience_s(self) -> float:
        return patience(self.lease_s)

    def close(self) -> None:
        self._stop.set()
        self.channel.close()

    def _call(
        self, what: str, fn: Callable[..., Any], request: Any, timeout: float | None, retry_s: float
    ) -> Any:  # the protobuf reply of `fn`
        return call_coordinator(self.address, self.rank, what, fn, request, timeout, retry_s, self._stop)

    def register(self, my_address: str) -> pb.RegisterReply:
        """Registers (again: a restarted rank, or a rank refreshing its peers' addresses)."""
        retry = self.patience_s if self.registered else self.startup_timeout_s
        reply: pb.RegisterReply = self._call(
            "Register",
            self.stub.Register,
            pb.RegisterRequest(rank=self.rank, spec=wire.spec_to_pb(self.spec), address=my_address),
            10.0,
            retry,
        )
        self.lease_s = reply.lease_ms / 1000 or self.lease_s
        self.registered = True
        return reply

    def align(self, epoch: int, report: RankReport) -> RoundDecision:
        reply = self._call("Align", self.stub.Align, wire.report_to_pb(report, epoch), None, self.patience_s)
        return wire.decision_from_pb(reply)

    def commit(self, epoch: int, commit: RankCommit) -> RoundTotals:
        request = wire.commit_to_pb(commit, epoch)
        reply = self._call("Commit", self.stub.Commit, request, None, self.patience_s)
        return wire.totals_from_pb(reply)

    def resume(self, epoch: int, step: int, from_world: int) -> pb.ResumeReply:
        """Where the resized job goes on, for this rank whose trainer resumes `epoch` at `step`."""
        request = pb.ResumeRequest(rank=self.rank, epoch=epoch, step=step, from_world_size=from_world)
        reply: pb.ResumeReply = self._call("Resume", self.stub.Resume, request, 60.0, self.patience_s)
        return reply

    def oom(self, request: pb.OomRequest) -> pb.OomReply:
        """Reports this rank's trainer's out-of-memory step (`Coordinator.Oom`): the job's lowered budget."""
        request.rank = self.rank
        reply: pb.OomReply = self._call("Oom", self.stub.Oom, request, 10.0, self.patience_s)
        return reply

    def finish(self) -> None:
        """Tells the coordinator this rank's trainer took the job's last step; stops the heartbeats."""
        self._call("Finish", self.stub.Finish, pb.FinishRequest(rank=self.rank), 10.0, self.patience_s)
        self.stop_heartbeats()

    def stop_heartbeats(self) -> None:
        self._stop.set()

    def fail(self, reason: str) -> None:
        try:
            self.stub.Fail(pb.FailRequest(rank=self.rank, reason=reason), timeout=5)
        except grpc.RpcError as exc:
            log.warning("could not report failure to the coordinator: %s", exc.details())
        except ValueError as exc:  # the channel was closed (this client is shutting down)
            log.warning("could not report failure to the coordinator: %s", exc)

    def start_heartbeats(self, on_failure: Callable[[str], None]) -> None:
        """Heartbeats every min(lease/3, HEARTBEAT_S) in a daemon thread (so a failure elsewhere reaches this
        rank within seconds); `on_failure(message)` when the job failed or the coordinator has been
        unreachable for `patience_s`."""

        def beat() -> None:
            last_ok = time.monotonic()
            while not self._stop.wait(min(self.lease_s / 3, HEARTBEAT_S)):
                try:
                    reply = self.stub.Heartbeat(pb.HeartbeatRequest(rank=self.rank), timeout=self.lease_s / 3)
                    last_ok = time.monotonic()
                    if reply.state == "failed":
                        on_failure(reply.failure)
                        return
                except ValueError:  # close() closed the channel between the wait and the call
                    return
                except grpc.RpcError as exc:
                    if self._stop.is_set():
                        return
                    if exc.code() == grpc.StatusCode.ABORTED:
                        on_failure(exc.details())
                        return
                    if not transient(exc) and exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        on_failure(
                            f"the coordinator at {self.address} refused rank {self.rank}'s heartbeat: "
                            f"{exc.code().name}: {exc.details()}"
                        )
                        return
                    if time.monotonic() - last_ok > self.patience_s:
                        on_failure(
                            f"coordinator at {self.address} unreachable for {self.patience_s:g}s "
                            f"({PATIENCE_LEASES} leases): "
                            f"{exc.code().name}: {exc.details()}"
                        )
                        return

        self._hb = threading.Thread(target=beat, name=f"batchd-heartbeat-{self.rank}", daemon=True)
        self._hb.start()
