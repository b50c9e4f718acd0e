"""The Coordinator gRPC service (grpc.aio): decode the request, call `CoordinatorState`, encode the reply.

Every handler is a coroutine run by the server's event loop (`_server`: one thread for all calls):
state calls take the state's lock briefly and never wait in it; a barrier is awaited on a future that
completes when the round is decided / committed (or the job fails, or the coordinator closes).
Decision and totals replies shared by every caller are serialized once per round: the Align, Commit and
Node handlers hand gRPC bytes (`_server` registers serializers that pass bytes through).

Status codes (domain errors via `context.abort`): INVALID_ARGUMENT for malformed messages,
FAILED_PRECONDITION for protocol-order errors (wrong epoch or round, unregistered rank, spec mismatch,
a node message before its hello or for a rank it did not register, another node protocol version),
ABORTED once the job failed, UNAVAILABLE while the coordinator shuts down (callers retry).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio

from batchd.core import JobFailed, ProtocolError, RoundDecision, RoundTotals
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc
from batchd.proto import wire

from ._barrier import Barrier, ShuttingDown
from ._convert import register_reply, resume_reply, status_reply
from ._session import NodeSession
from ._state import CoordinatorState

log = logging.getLogger("batchd.coordinator")

DOMAIN_ERRORS = (JobFailed, ShuttingDown, ValueError)  # what a handler turns into a status code
R = TypeVar("R", RoundDecision, RoundTotals)


def status_code(exc: Exception) -> grpc.StatusCode:
    """The status code of a domain error (module docstring)."""
    if isinstance(exc, ShuttingDown):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, JobFailed):
        return grpc.StatusCode.ABORTED
    if isinstance(exc, ProtocolError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INVALID_ARGUMENT


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Thin grpc.aio layer over `CoordinatorState`: domain errors become status codes (module docstring)."""

    def __init__(self, state: CoordinatorState) -> None:
        self.state = state
        # (identity of the decision / totals, epoch, serialized reply) of the newest round, per reply kind
        self._shared: dict[str, tuple[object, int, bytes]] = {}

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
        code = status_code(exc)
        log.warning("%s: %s", code.name, exc)
        await context.abort(code, str(exc))

    async def _wait(self, got: R | Barrier, ranks: list[int]) -> R:
        """The decision / totals `got` from a `submit_*`, awaiting its barrier if it is one."""
        if not isinstance(got, Barrier):
            return got
        fut = self.state.barrier_future(got)
        if not fut.done():
            await fut
        return self.state.outcome(got, ranks)  # type: ignore[return-value]

    def _reply(self, kind: str, value: R, epoch: int, build: Callable[[R, int], Any]) -> bytes:
        """The serialized reply for `value` (a decision or totals that every caller of the round gets),
        built by `build(value, epoch)` once per (value, epoch)."""
        cached = self._shared.get(kind)
        if cached is not None and cached[0] is value and cached[1] == epoch:
            return cached[2]
        data: bytes = build(value, epoch).SerializeToString()
        self._shared[kind] = (value, epoch, data)
        return data

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            self.state.check_rank(request.rank, "Register")
            try:
                spec = wire.spec_from_pb(request.spec)
            except ValueError as exc:
                raise ValueError(
                    f"Register from rank {request.rank} carries an invalid job spec: {exc}"
                ) from None
            return register_reply(self.state.register(request.rank, spec, request.address))
        except DOMAIN_ERRORS as exc:
            await self._abort(context, exc)

    async def Align(self, request: pb.AlignRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            got = self.state.submit_align(request.epoch, [wire.report_from_pb(request)])
            decision = await self._wait(got, [request.rank])
            return self._reply("align", decision, request.epoch, wire.decision_to_pb)
        except DOMAIN_ERRORS as exc:
            await self._abort(context, exc)

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            commit, sums = wire.commit_with_sums_from_pb(request)
            got = self.state.submit_commit(request.epoch, [commit], [sums])
            totals = await self._wait(got, [request.rank])
            return self._reply("commit", totals, request.epoch, wire.totals_to_pb)
        except DOMAIN_ERRORS as exc:
            await self._abort(context, exc)

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            self.state.check_rank(request.rank, "Resume")
            resumed = self.state.resume(
                int(request.rank), int(request.epoch), int(request.step), int(request.from_world_size)
            )
            return resume_reply(resumed)
        except DOMAIN_ERRORS as exc:
            await self._abort(context, exc)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            ranks = [int(r) for r in request.ranks] or [int(request.rank)]
            state, failure = self.state.heartbeat_many(ranks)
            return pb.HeartbeatReply(state=state, failure=failure)
        except DOMAIN_ERRORS as exc:
            await self._abort(context, exc)

    async def Finish(self, request: pb.FinishRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            self.state.finish(request.rank)
            return pb.FinishReply()
        except DOMAIN_ERRORS as exc:
            await self._abort(context, exc)

    async def Oom(self, request: pb.OomRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            budget, message = self.state.oom(
                int(request.rank), int(request.epoch), int(request.step), float(request.cost)
            )
            return pb.OomReply(token_budget=budget, message=message)
        except DOMAIN_ERRORS as exc:
            await self._abort(context, exc)

    async def Fail(self, request: pb.FailRequest, context: grpc.aio.ServicerContext) -> Any:
        self.state.fail(request.rank, request.reason or "reported a failure")
        return pb.FailReply()

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> Any:
        return status_reply(self.state.status())

    async def Node(
        self, request_iterator: AsyncIterator[pb.NodeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """A node agent's stream (`_session`): a hello first, then its ranks' aligns and commits, one
        reply each in order. Domain errors end the stream with their status code (the agent reports
        them); a shutdown of a stream its agent already cancelled ends it quietly."""
        session = NodeSession(self.state)
        try:
            async for request in request_iterator:
                try:
                    yield await self._node_reply(session, request)
                except DOMAIN_ERRORS as exc:
                    if isinstance(exc, ShuttingDown) and context.cancelled():
                        return
                    await self._abort(context, exc)
        finally:  # its agent's process may be gone: noticed now, not at the lease
            if session.name is not None:
                self.state.node_stream_ended(session.name, sorted(session.ranks), session.journaled)

    async def _node_reply(self, session: NodeSession, request: pb.NodeRequest) -> pb.NodeReply | bytes:
        kind = request.WhichOneof("kind")
        if kind == "hello":
            return session.hello(request.hello)
        if kind == "align":
            ranks = session.own(kind, (m.rank for m in request.align.reports))
            epoch = int(request.align.epoch)
            got = self.state.submit_align(epoch, [wire.report_from_pb(m) for m in request.align.reports])
            decision = await self._wait(got, ranks)
            if decision.plan is None:  # the same for every node
                return self._reply("node-align", decision, epoch, wire.node_decision_to_pb)
            return session.decision_reply(decision, epoch)
        if kind == "commit":
            ranks = session.own(kind, (m.rank for m in request.commit.commits))
            epoch = int(request.commit.epoch)
            converted = [wire.commit_with_sums_from_pb(m) for m in request.commit.commits]
            got_totals = self.state.submit_commit(epoch, [c for c, _ in converted], [s for _, s in converted])
            totals = await self._wait(got_totals, ranks)
            return self._reply("node-commit", totals, epoch, wire.node_totals_to_pb)
        raise ValueError(f"a node stream sent an empty request ({kind=})")
