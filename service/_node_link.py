"""A node agent's link to the coordinator: one persistent bidirectional stream for all its ranks.

`NodeLink` owns the stream (`Coordinator.Node`). The agent's rank services (one `RankServiceCore` per
local rank, each with its own round loop) talk to it through `LocalRankClient`, which has the interface
of the one-rank `CoordinatorClient`. Per barrier the link sends ONE message with the reports (or commits)
of its ranks and gets one reply, so the coordinator handles a message per node, not per rank.

Gathering. Every rank of the job must be in a barrier before it completes, so the link waits until each
of its running ranks has a call pending, then sends the lowest (epoch, round, phase) among them; nothing
waits longer than the barrier itself would. One exception: after a restart (of the agent or of the
coordinator) the agent's ranks may stand at different rounds, their journals having been written at
different moments, and a rank ahead may wait for its trainer, which waits (in DDP) for a rank behind. So
a call for a round the coordinator has already passed (it said where it stands in its reply to the hello)
is a replay and is sent at once, alone if need be.

Liveness, as for one rank (`_coord_client`): the hello waits up to `startup_timeout_s` for a coordinator
that is not up yet; a stream that breaks (a coordinator restarting from its journal) is reopened, with a
new hello and the call in flight sent again, for up to two of the coordinator's leases (`patience`, why
two: `_coord_client`); one heartbeat per node (every rank it serves) every min(lease/3, 2 s). A failure
(ABORTED from the coordinator, or a rank of this agent reporting one) reaches every rank's pending and
later calls.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

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

from ._coord_client import PATIENCE_LEASES, call_coordinator, patience

log = logging.getLogger("batchd.node")

HEARTBEAT_S = 2.0
_PHASE = {"align": 0, "commit": 1}


class _Call:
    """One rank's pending align or commit."""

    __slots__ = ("rank", "kind", "epoch", "round", "message", "result", "error", "done")

    def __init__(self, rank: int, kind: str, epoch: int, rnd: int, message: RankReport | RankCommit) -> None:
        self.rank, self.kind, self.epoch, self.round, self.message = rank, kind, epoch, rnd, message
        self.result: RoundDecision | RoundTotals | None = None
        self.error: CoordinatorError | None = None
        self.done = False

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.epoch, self.round, _PHASE[self.kind])


class _Requests:
    """The request side of the stream: an iterator fed by `put`, ended by `close`."""

    def __init__(self) -> None:
        self._q: queue.Queue[pb.NodeRequest | None] = queue.Queue()

    def put(self, request: pb.NodeRequest) -> None:
        self._q.put(request)

    def close(self) -> None:
        self._q.put(None)

    def __iter__(self) -> _Requests:
        return self

    def __next__(self) -> pb.NodeRequest:
        item = self._q.get()
        if item is None:
            raise StopIteration
        return item


class NodeLink:
    """The stream of node agent `node` (serving `ranks`, reachable at `address`) to the coordinator."""

    def __init__(
        self,
        coordinator: str,
        node: str,
        ranks: list[int],
        spec: JobSpec,
        address: str,
        startup_timeout_s: float = 600.0,
        security: Security | None = None,
        journaled: bool = False,
    ) -> None:
        if not ranks:
            raise ValueError(f"a node agent serves at least one rank, got {ranks=}")
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s=}")
        self.coordinator, self.node, self.ranks, self.spec = coordinator, node, sorted(ranks), spec
        self.address, self.startup_timeout_s = address, startup_timeout_s
        self.journaled = journaled  # told in the hello: the coordinator judges a broken stream by it
        self.channel = channel(coordinator, security, CHANNEL_OPTIONS)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.lease_s = 60.0
        self.registered: pb.RegisterReply | None = None
        self.position = (0, 0)  # where the coordinator stood at the last hello: (epoch, round)
        self.failure: CoordinatorError | None = None
        self.cond = threading.Condition()
        self.pending: dict[int, _Call] = {}
        self.running = set(self.ranks)  # ranks whose round loop still calls (not finished)
        self._requests: _Requests | None = None
        self._replies: Iterator[pb.NodeReply] | None = None
        self._stop = threading.Event()
        self._hello_lock = threading.Lock()
        self._on_failure: list[Callable[[str], None]] = []
        self._thread: threading.Thread | None = None
        self._hb: threading.Thread | None = None

    @property
    def patience_s(self) -> float:
        """How long the agent retries a coordinator it cannot reach: `_coord_client.patience`."""
        return patience(self.lease_s)

    def client(self, rank: int) -> LocalRankClient:
        if rank not in self.ranks:
            raise ValueError(f"node agent {self.node!r} does not serve {rank=} (it serves {self.ranks})")
        return LocalRankClient(self, rank)

    # -- stream --------------------------------------------------------------------------------------
    def _open(self) -> pb.RegisterReply:
        """Opens a stream and says hello; returns the registration (raises grpc.RpcError)."""
        if self._requests is not None:
            self._requests.close()
        self._requests = requests = _Requests()
        self._replies = replies = cast(Iterator[pb.NodeReply], self.stub.Node(requests))
        requests.put(
            pb.NodeRequest(
                hello=pb.NodeHello(
                    protocol=pb.NODE_PROTOCOL_V1,
                    node=self.node,
                    ranks=self.ranks,
                    spec=wire.spec_to_pb(self.spec),
                    address=self.address,
                    journaled=self.journaled,
                )
            )
        )
        reply = next(replies)
        if reply.WhichOneof("kind") != "registered":
            raise RuntimeError(
                f"the coordinator answered the hello of node agent {self.node!r} with "
                f"{reply.WhichOneof('kind')}"
            )
        registered: pb.RegisterReply = reply.registered
        self.lease_s = registered.lease_ms / 1000 or self.lease_s
        self.position = (int(registered.epoch), int(registered.round))
        self.registered = registered
        return registered

    def _what(self, what: str) -> str:
        return (
            f"the coordinator at {self.coordinator} ({what} of node agent {self.node!r}, ranks {self.ranks})"
        )

    def _error(self, what: str, exc: grpc.RpcError | Unreachable) -> CoordinatorError:
        if isinstance(exc, Unreachable):
            return CoordinatorError(
                f"coordinator at {self.coordinator} unreachable for {exc.elapsed_s:.0f}s "
                f"({what} from node agent {self.node!r}): {exc.error.details()}",
                exc.error.code(),
            )
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return CoordinatorError(
                f"the coordinator at {self.coordinator} does not serve node agents (it predates "
                f"them): run the same batchd version on every party, or one `batchd rank` per "
                f"rank ({exc.details()})",
                exc.code(),
            )
        return CoordinatorError(
            f"{what} from node agent {self.node!r} (ranks {self.ranks}) failed: "
            f"{exc.code().name}: {exc.details()}",
            exc.code(),
        )

    def hello(self) -> pb.RegisterReply:
        """Registers every rank of the node (once; later calls return the registration)."""
        with self._hello_lock:
            if self.registered is not None:
                return self.registered
            try:
                reply: pb.RegisterReply = retry_while_unreachable(
                    self._open, self.startup_timeout_s, self._what("hello"), stop=self._stop, logger=log
                )
            except (Unreachable, grpc.RpcError) as exc:
                raise self._error("hello", exc) from None
            log.info(
                "node agent %r registered ranks %s with the coordinator at %s (epoch %d round %d)",
                self.node,
                self.ranks,
                self.coordinator,
                *self.position,
            )
            self._thread = threading.Thread(
                target=self._run, name=f"batchd-node-link-{self.node}", daemon=True
            )
            self._thread.start()
            return reply

    def _exchange(self, request: pb.NodeRequest, what: str) -> pb.NodeReply:
        """Sends `request` and returns its reply; a broken stream is reopened (new hello) and the request
        sent again, for up to `patience_s` (the coordinator replays what it decided)."""

        def once() -> pb.NodeReply:
            if self._replies is None:
                self._open()
            requests, replies = self._requests, self._replies
            assert requests is not None and replies is not None  # _open set both
            try:
                requests.put(request)
                return next(replies)
            except grpc.RpcError as exc:
                if transient(exc):  # noticed now: a coordinator restarted with its journal resumes the job
                    log.warning(
                        "node agent %r: its stream to the coordinator at %s broke (%s); reopening it for up "
                        "to %gs (%d leases)",
                        self.node,
                        self.coordinator,
                        exc.code().name,
                        self.patience_s,
                        PATIENCE_LEASES,
                    )
                    self._replies = None  # reopen on the retry
                raise
            except StopIteration:  # the server ended the stream without a status: treat as a restart
                self._replies = None
                raise _Ended() from None

        deadline = time.monotonic() + self.patience_s
        while True:
            try:
                reply: pb.NodeReply = retry_while_unreachable(
                    once, max(deadline - time.monotonic(), 0.1), self._what(what), stop=self._stop, logger=log
                )
                return reply
            except _Ended:
                if time.monotonic() > deadline or self._stop.is_set():
                    raise CoordinatorError(
                        f"the coordinator at {self.coordinator} kept ending the stream of "
                        f"node agent {self.node!r} ({what})",
                        grpc.StatusCode.UNAVAILABLE,
                    ) from None
                time.sleep(0.2)

    def _ready(self) -> list[_Call] | None:
        """The calls to send now (see module docstring), or None."""
        if not self.pending:
            return None
        low = min(c.key for c in self.pending.values())
        replay = low[:2] < self.position
        if not replay and not self.running <= set(self.pending):
            return None
        return [c for c in self.pending.values() if c.key == low]

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.cond:
                batch = self._ready()
                while batch is None and self.failure is None and not self._stop.is_set():
                    self.cond.wait(0.5)
                    batch = self._ready()
                if self.failure is not None or self._stop.is_set() or batch is None:
                    return
            first = batch[0]
            what = f"{first.kind} of epoch {first.epoch} round {first.round}"
            if first.kind == "align":
                request = pb.NodeRequest(
                    align=pb.NodeAlign(
                        epoch=first.epoch,
                        round=first.round,
                        reports=[wire.report_to_pb(cast(RankReport, c.message), c.epoch) for c in batch],
                    )
                )
            else:
                request = pb.NodeRequest(
                    commit=pb.NodeCommit(
                        epoch=first.epoch,
                        round=first.round,
                        commits=[wire.commit_to_pb(cast(RankCommit, c.message), c.epoch) for c in batch],
                    )
                )
            result: RoundDecision | RoundTotals | None
            error: CoordinatorError | None
            try:
                reply = self._exchange(request, what)
                if first.kind == "align":
                    result = wire.decision_from_pb(reply.decision)
                else:
                    result = wire.totals_from_pb(reply.totals)
                error = None
            except (Unreachable, grpc.RpcError) as exc:
                result, error = None, self._error(what, exc)
            except CoordinatorError as exc:
                result, error = None, exc
            except ValueError:  # `close()` closed the channel under a retry: the agent is stopping
                if not self._stop.is_set():
                    raise
                result, error = None, CoordinatorError(f"node agent {self.node!r} stopped ({what})")
            with self.cond:
                for c in batch:
                    c.result, c.error, c.done = result, error, True
                    self.pending.pop(c.rank, None)
                if error is not None and error.code == grpc.StatusCode.ABORTED:
                    self.failure = error
                self.cond.notify_all()

    def call(
        self, rank: int, kind: str, epoch: int, message: RankReport | RankCommit
    ) -> RoundDecision | RoundTotals:
        """Rank `rank`'s align or commit: waits for its reply (see module docstring)."""
        call = _Call(rank, kind, epoch, message.round, message)
        with self.cond:
            if self.failure is not None:
                raise self.failure
            if rank in self.pending:
                raise RuntimeError(f"rank {rank} has a call pending already")
            self.pending[rank] = call
            self.cond.notify_all()
            while not call.done:
                if self.failure is not None:
                    self.pending.pop(rank, None)
                    raise self.failure
                if self._stop.is_set():
                    self.pending.pop(rank, None)
                    raise CoordinatorError("the node agent is stopping", grpc.StatusCode.CANCELLED)
                self.cond.wait(0.5)
        if call.error is not None:
            raise call.error
        assert call.result is not None  # done without an error: `_run` set the reply
        return call.result

    def retire(self, rank: int) -> None:
        """`rank`'s loop makes no further call (its trainer took the job's last step)."""
        with self.cond:
            self.running.discard(rank)
            self.cond.notify_all()

    def fail_all(self, message: str, code: grpc.StatusCode = grpc.StatusCode.ABORTED) -> None:
        """Every pending and later call fails with `message`."""
        with self.cond:
            if self.failure is None:
                self.failure = CoordinatorError(message, code)
            self.cond.notify_all()

    # -- unary calls, heartbeats -----------------------------------------------------------------------
    def unary(
        self, what: str, fn: Callable[..., Any], request: Any, rank: int, timeout: float = 10.0
    ) -> Any:  # the protobuf reply of `fn`
        """A unary call on behalf of `rank` (Register, Finish), retried for up to `patience_s`."""
        patience_s = self.patience_s
        return call_coordinator(self.coordinator, rank, what, fn, request, timeout, patience_s, self._stop)

    def start_heartbeats(self, on_failure: Callable[[str], None]) -> None:
        """One heartbeat for every rank still running, every min(lease/3, HEARTBEAT_S); `on_failure` of every
        rank when the job failed or the coordinator has been unreachable for `patience_s`."""
        with self.cond:
            self._on_failure.append(on_failure)
            if self._hb is not None:
                return
            self._hb = threading.Thread(
                target=self._beat, name=f"batchd-node-heartbeat-{self.node}", daemon=True
            )
            self._hb.start()

    def _failed(self, message: str) -> None:
        self.fail_all(message)
        for fn in list(self._on_failure):
            fn(message)

    def _beat(self) -> None:
        last_ok = time.monotonic()
        told = False  # the coordinator's absence was logged since the last heartbeat that got through
        while not self._stop.wait(min(self.lease_s / 3, HEARTBEAT_S)):
            with self.cond:
                ranks = sorted(self.running)
            if not ranks:
                return
            try:
                reply = self.stub.Heartbeat(
                    pb.HeartbeatRequest(rank=ranks[0], ranks=ranks), timeout=self.lease_s / 3
                )
                last_ok, told = time.monotonic(), False
                if reply.state == "failed":
                    self._failed(reply.failure)
                    return
            except ValueError:  # the channel was closed
                return
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                if exc.code() == grpc.StatusCode.ABORTED:
                    self._failed(exc.details())
                    return
                if not transient(exc) and exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._failed(
                        f"the coordinator at {self.coordinator} refused the heartbeat of node agent "
                        f"{self.node!r}: {exc.code().name}: {exc.details()}"
                    )
                    return
                if not told:  # noticed now: a coordinator restarted with its journal resumes the job
                    told = True
                    log.warning(
                        "node agent %r: the coordinator at %s is unreachable (%s); retrying for up to %gs "
                        "(%d leases)",
                        self.node,
                        self.coordinator,
                        exc.code().name,
                        self.patience_s,
                        PATIENCE_LEASES,
                    )
                if time.monotonic() - last_ok > self.patience_s:
                    self._failed(
                        f"coordinator at {self.coordinator} unreachable for {self.patience_s:g}s "
                        f"({PATIENCE_LEASES} leases): "
                        f"{exc.code().name}: {exc.details()}"
                    )
                    return

    def close(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        if self._requests is not None:
            self._requests.close()
        self.channel.close()

    def join(self, timeout: float) -> list[threading.Thread]:
        """Waits up to `timeout` (each) for the link's threads to end after `close`; returns those still
        running."""
        threads = [t for t in (self._thread, self._hb) if t is not None]
        for t in threads:
            t.join(timeout)
        self._replies = self._requests = None  # the stream's call object goes now, not in a finalizer
        return [t for t in threads if t.is_alive()]


class _Ended(Exception):
    """The coordinator ended the node stream without an error (it is stopping)."""


class LocalRankClient:
    """One rank of a node agent, as its `RankServiceCore` sees the coordinator (`CoordinatorClient`'s
    interface); its aligns and commits go through the node's one stream."""

    def __init__(self, link: NodeLink, rank: int) -> None:
        self.link, self.rank = link, rank
        self.address = link.coordinator

    @property
    def lease_s(self) -> float:
        return self.link.lease_s

    @property
    def patience_s(self) -> float:
        return self.link.patience_s

    def register(self, my_address: str) -> pb.RegisterReply:
        """The node's registration at first; later (a rank refreshing its peers' addresses) a unary Register
        of this rank at the node's address, which keeps it on its node."""
        if self.link.registered is None:
            return self.link.hello()
        request = pb.RegisterRequest(rank=self.rank, spec=wire.spec_to_pb(self.link.spec), address=my_address)
        reply: pb.RegisterReply = self.link.unary("Register", self.link.stub.Register, request, self.rank)
        return reply

    def align(self, epoch: int, report: RankReport) -> RoundDecision:
        return cast(RoundDecision, self.link.call(self.rank, "align", epoch, report))

    def commit(self, epoch: int, commit: RankCommit) -> RoundTotals:
        return cast(RoundTotals, self.link.call(self.rank, "commit", epoch, commit))

    def resume(self, epoch: int, step: int, from_world: int) -> pb.ResumeReply:
        """`CoordinatorClient.resume`, a unary call of this rank."""
        request = pb.ResumeRequest(rank=self.rank, epoch=epoch, step=step, from_world_size=from_world)
        reply: pb.ResumeReply = self.link.unary("Resume", self.link.stub.Resume, request, self.rank, 60.0)
        return reply

    def oom(self, request: pb.OomRequest) -> pb.OomReply:
        """`CoordinatorClient.oom`, a unary call of this rank."""
        request.rank = self.rank
        reply: pb.OomReply = self.link.unary("Oom", self.link.stub.Oom, request, self.rank)
        return reply

    def finish(self) -> None:
        self.link.unary("Finish", self.link.stub.Finish, pb.FinishRequest(rank=self.rank), self.rank)
        self.link.retire(self.rank)

    def stop_heartbeats(self) -> None:
        self.link.retire(self.rank)

    def fail(self, reason: str) -> None:
        """Reports this rank's failure to the coordinator and to the other ranks of the node at once."""
        try:
            self.link.stub.Fail(pb.FailRequest(rank=self.rank, reason=reason), timeout=5)
        except grpc.RpcError as exc:
            log.warning("could not report failure to the coordinator: %s", exc.details())
        except ValueError as exc:  # the channel was closed (the agent is shutting down)
            log.warning("could not report failure to the coordinator: %s", exc)
        self.link.fail_all(f"rank {self.rank}: {reason}")

    def start_heartbeats(self, on_failure: Callable[[str], None]) -> None:
        self.link.start_heartbeats(on_failure)

    def close(self) -> None:
        """The link is closed by the agent, once every rank stopped."""
