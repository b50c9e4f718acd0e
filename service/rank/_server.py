"""The rank service's gRPC server: a thin servicer over `RankServiceCore` (`_core`), or a node agent's.

`Batches` (the trainer's bidi stream: credits and acks in, collated batches out; `_delivery`), `Ingest`
(producers push samples: decoded here, validated and queued by the rank's `IngestSource`), `Fetch`
(payloads a balanced plan moved to another rank: lent ones, else re-made by the source; `_payloads`) and
`RankStatus`. Each handler decodes, calls the core and encodes; domain errors become status codes with
`context.abort` (the job's failure: ABORTED; a request the rank cannot serve: FAILED_PRECONDITION;
a malformed one: INVALID_ARGUMENT; a payload no one has: NOT_FOUND).
`create_rank_server(address, core) -> (server, port)` binds port 0 in tests.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Iterator, Mapping
from concurrent import futures
from typing import NoReturn

import grpc

from batchd.core import ATTACHED, END, CoordinatorError, Sample
from batchd.proto import GRPC_OPTIONS, Security, wire
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc

from .._security import add_port, server_interceptors
from ..preprocess import IngestRefused, Payload
from ._core import RankServiceCore
from ._delivery import TrainerStream
from ._payloads import FetchRefused


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """`context.abort`, which raises (grpc's contract); typed as never returning."""
    context.abort(code, message)
    raise AssertionError("grpc's ServicerContext.abort returned")


log = logging.getLogger("batchd.rank")
FETCH_REPLY_BYTES = 16 << 20  # a Fetch reply stops adding samples past this (the message cap is 64 MiB)


class RankServicer(pb_grpc.RankServiceServicer):
    """Thin gRPC layer over one `RankServiceCore`, or over the several of a node agent (by rank).

    A node agent's requests name their rank (`BatchRequest.rank` in a trainer's first message,
    `FetchRequest.rank`, `RankStatusRequest.rank`, an Ingest stream's `meta.home_rank`); a one-rank
    service also takes requests that do not (a client that predates the field)."""

    fetch_reply_bytes = FETCH_REPLY_BYTES  # per servicer class: a Fetch reply's size cap

    def __init__(self, core: RankServiceCore | Mapping[int, RankServiceCore]) -> None:
        self.cores = dict(core) if isinstance(core, Mapping) else {core.rank: core}
        if not self.cores:
            raise ValueError("a rank service needs at least one rank")
        self.core = next(iter(self.cores.values()))  # the one-rank case

    def _pick(self, rank: int | None, context: grpc.ServicerContext, what: str) -> RankServiceCore:
        if rank is None:
            if len(self.cores) == 1:
                return self.core
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what}: this node agent serves ranks {sorted(self.cores)}; the request must name its "
                f"rank (a client older than node agents?)",
            )
        core = self.cores.get(rank)
        if core is None:
            served = sorted(self.cores)
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{what} for rank {rank}, but this service serves rank{'s' if len(served) > 1 else ''} "
                f"{served if len(served) > 1 else served[0]}: check the trainer's rank and address",
            )
        return core

    def Batches(
        self, request_iterator: Iterator[pb.BatchRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.Batch]:
        try:
            first = next(request_iterator)
        except StopIteration:
            return
        core = self._pick(int(first.rank) if first.HasField("rank") else None, context, "Batches")
        stream = TrainerStream(context.peer(), context)
        try:
            outcome = core.streams.connect(
                stream,
                int(first.epoch),
                int(first.start_step),
                int(first.credits),
                int(first.group_rank),
                max(int(first.group_size), 1),
                int(first.resize_from),
            )
        except RuntimeError as exc:
            core.failure_told = core.failure is not None
            context.abort(grpc.StatusCode.ABORTED, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank {core.rank}: {exc}")
        if outcome.outcome == END:  # it took every step of the epoch before but lost the end
            yield pb.Batch(end_of_epoch=True)
            return
        if outcome.outcome != ATTACHED:
            log.warning("Batches: refused trainer %s: %s", stream, outcome.reason)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, outcome.reason or "not attached")
        context.add_callback(lambda: core.streams.detach(stream))

        def read_acks() -> None:
            try:
                for req in request_iterator:
                    if req.HasField("saved_step"):
                        core.streams.checkpoint(
                            stream, int(req.saved_epoch), int(req.saved_step), req.saved_durable
                        )
                    else:
                        core.streams.ack(stream, int(req.ack_step))
            except grpc.RpcError:
                pass
            except ValueError:  # the stream ended under the reader
                pass

        threading.Thread(target=read_acks, name=f"batchd-acks-{core.rank}", daemon=True).start()
        while True:
            try:
                item = core.streams.next_item(stream)
            except RuntimeError as exc:
                core.failure_told = core.failure is not None
                context.abort(grpc.StatusCode.ABORTED, str(exc))
            except ConnectionAbortedError:
                return
            if item is None:
                yield pb.Batch(end_of_epoch=True)
                return
            step, batch = item
            yield batch
            core.streams.sent(stream, step)

    def Ingest(
        self, request_iterator: Iterator[pb.IngestRequest], context: grpc.ServicerContext
    ) -> pb.IngestReply:
        """Decodes each pushed record and hands it to the rank's `IngestSource.ingest` (which validates and
        queues it, or quarantines it); replies with the counts. A refusal (`IngestRefused`) ends the stream
        with FAILED_PRECONDITION."""
        if len(self.cores) == 1:
            core = self.core
        else:  # a node agent: the stream's rank is its first sample's home rank
            try:
                first = next(request_iterator)
            except StopIteration:
                return pb.IngestReply()
            core = self._pick(int(first.meta.home_rank), context, "Ingest")
            request_iterator = itertools.chain([first], request_iterator)
        accepted, quarantined = 0, []
        try:
            source = core.ingest_source()
            for req in request_iterator:
                core.wait_for_epoch(int(req.epoch), int(req.meta.id), context.is_active)
                if req.end_of_epoch:
                    source.end()
                    continue
                reason = source.ingest(functools.partial(_decode_pushed, req), core.rank)
                if reason is None:
                    accepted += 1
                    continue
                log.warning("Ingest: quarantined sample %d: %s", req.meta.id, reason)
                quarantined.append(pb.Quarantined(id=req.meta.id, reason=reason))
                if core.metrics is not None:
                    core.metrics.ingest_quarantined()
        except IngestRefused as exc:
            log.warning("Ingest: %s", exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.IngestReply(accepted=accepted, quarantined=quarantined)

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> pb.FetchReply:
        """The payloads of `request.ids`, in order: a prefix of them when the reply would pass
        `fetch_reply_bytes` (at least one); the caller asks again for the rest. Samples of this epoch or of
        the one before (a peer still finishing it) are served; another epoch is refused."""
        core = self._pick(int(request.rank) if request.HasField("rank") else None, context, "Fetch")
        try:
            samples = core.lend_out([int(i) for i in request.ids], int(request.epoch), self.fetch_reply_bytes)
        except FetchRefused as exc:
            code = grpc.StatusCode.NOT_FOUND if exc.not_found else grpc.StatusCode.FAILED_PRECONDITION
            _abort(context, code, str(exc))
        return pb.FetchReply(samples=samples)

    def Oom(self, request: pb.OomRequest, context: grpc.ServicerContext) -> pb.OomReply:
        """A trainer's out-of-memory step, forwarded to the coordinator (`Coordinator.Oom`)."""
        core = self._pick(int(request.rank), context, "Oom")
        log.error(
            "rank %d: its trainer ran out of memory on step %d: %s", core.rank, request.step, request.detail
        )
        try:
            return core.coord.oom(request)
        except CoordinatorError as exc:
            _abort(context, exc.code or grpc.StatusCode.UNAVAILABLE, str(exc))

    def RankStatus(self, request: pb.RankStatusRequest, context: grpc.ServicerContext) -> pb.RankStatusReply:
        core = self._pick(int(request.rank) if request.HasField("rank") else None, context, "RankStatus")
        with core.cond:
            state = "failed" if core.failure else ("done" if core.done else "running")
            core.failure_told = core.failure_told or bool(core.failure)
            return pb.RankStatusReply(
                rank=core.rank,
                buffered=len(core.state.buffer),
                ready=len(core.delivery.ready),
                next_step=core.state.step,
                round=core.state.round,
                state=state,
                failure=core.failure or "",
                epoch=core.epoch,
                epochs=core.spec.epochs,
                fetched_local=core.store.fetched["local"],
                fetched_remote=core.store.fetched["remote"],
                job_samples=job_samples(core),
                max_tokens=max_tokens(core),
            )


def _decode_pushed(req: pb.IngestRequest) -> tuple[Sample, Payload]:
    """A pushed record's (metadata, payload); ValueError when its bytes do not decode."""
    return wire.sample_from_pb(req.meta), wire.tensors_from_pb(req.tensors)


def max_tokens(core: RankServiceCore) -> int:
    """The most tokens one sample of this rank's steps may have: what the over-budget policy cuts or
    rejects above (`truncate`, `reject`), else its source's longest sample (`Source.longest`); 0 when
    unknown (a pushed source under `singleton`)."""
    if core.spec.policy.over_budget in ("truncate", "reject"):
        return core.state.truncate_length
    return int(getattr(core.source, "longest", None) or 0)


def job_samples(core: RankServiceCore) -> int:
    """Samples the job trains on per epoch, all ranks together, as far as a rank knows it: the non-join
    quota, else the dataset its sampler view splits (the records of a `RaySource`, bad ones included:
    quarantined records never reach a trainer); 0 for a source of unknown size (pushed samples)."""
    if core.spec.mode == "non-join":
        return int(core.spec.quota or 0)
    return int(getattr(getattr(core.source, "view", None), "num_samples", 0) or 0)


def create_rank_server(
    address: str, core: RankServiceCore | Mapping[int, RankServiceCore], security: Security | None = None
) -> tuple[grpc.Server, int]:
    """Builds (not starts) the server of one rank service, or of a node agent's ranks ({rank: core}), bound
    to `address`; returns (server, port).

    `security` (TLS / mutual TLS / bearer token) defaults to the cores' `security`: one object per process.
    """
    servicer = RankServicer(core)
    security = servicer.core.security if security is None else security
    name = f"batchd-rank{servicer.core.rank}" if len(servicer.cores) == 1 else "batchd-node"
    # Per rank: a trainer stream, its ack reader, a producer or a peer's Fetch now and then.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=12 + 4 * len(servicer.cores), thread_name_prefix=name),
        options=GRPC_OPTIONS,
        interceptors=server_interceptors(security),
    )
    pb_grpc.add_RankServiceServicer_to_server(servicer, server)
    port = add_port(server, address, security)
    if port == 0:
        raise OSError(f"rank service could not bind {address}")
    return server, port
