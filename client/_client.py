"""The trainer-side client: an iterator over one rank's aligned batches, resumable mid-epoch.

    client = BatchClient("127.0.0.1:7001", rank=r, world_size=n)
    for batch, info in client:          # batch: dict of torch tensors, info: batchd.core.StepInfo
        train_step(ddp_model, optimizer, batch, info)   # loss x info.loss_scale; IDLE: zero weight

It opens the rank service's `Batches` bidi stream: the first message says where to start and how many
batches it may hold (credits); each later message acknowledges what was consumed, so the service
frees them; end of epoch comes once every step is acknowledged. Every rank yields the same number of
steps (the service's alignment guarantees it).

- Epochs: `for e in range(client.epoch, client.job_epochs()): client.set_epoch(e); for ... in client:`
  (a restored client starts at its saved epoch and keeps its position in it).
- Resume: `state_dict()` stores rank, world size, epoch and the next step; `load_state_dict()` refuses
  a state of another rank or world size. A new client resumes exactly where the old one stopped.
- Rewind to a checkpoint: `state_dict()` also tells the rank service that a checkpoint is taken there.
  The service keeps every batch from the older of the last two such checkpoints on (a crash while the
  newest is written resumes from the one before), so trainers that crash at any step and restart together
  from their last checkpoint get the steps after it again: the same batches, in this epoch or the ones
  before it. `checkpointed()` says the save completed: the service then frees the batches before it at
  once. Take `state_dict()` for checkpoints only (not for logging: two calls free the batches before the
  first). The service's memory for held batches is bounded (`batchd node --retain-mb`); past it, the
  oldest are freed and a resume before them is refused, naming the step it can resume from.
  `load_state_dict(state, resize=True)` takes a state saved at another world size, for a job resumed at
  this one (`batchd coordinator --resize`).
- Start order: the first connection waits up to `ClientOptions.startup_timeout_s` (default 10 min) for a
  rank service that is not up yet (it may be starting Ray), logging every 5 s whom it waits for and why
  ("waiting for the rank service at ADDR (rank R of N) (5s of 600s): UNAVAILABLE: ... Connection
  refused", the services' wording), then raises `RankServiceError` naming the address and what was tried.
- Rank service restart: UNAVAILABLE is retried for `ClientOptions.reconnect_timeout_s`, from the next
  step. The three knobs (credits too) are one `ClientOptions`: `BatchClient(..., options=ClientOptions(...))`.
- Step time: unlimited. A trainer may take minutes per step; only a party that is gone fails the job.
- One trainer per rank: a second client on a rank's service is refused (`RankServiceError`, a
  `BatchdError`, naming the holder).
- Model-parallel groups (tensor / context / pipeline parallelism: several processes consume one
  data-parallel rank's batches): every process of the group passes the same `rank` (its data-parallel
  rank), `world_size` (the data-parallel size), `group_size` and its own `group_rank`. Every member
  gets the same steps; a step is freed once every member acknowledged it; a member that dies and does
  not come back within the rank service's grace fails the job, naming the rank and the member.
- Job failure: the service's ABORTED (its message names the failed rank) raises `JobFailed`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import grpc
import torch

from batchd.core import BatchdError, JobFailed, RankServiceError, StepInfo
from batchd.proto import CHANNEL_OPTIONS, WAIT_LOG_S, Security, transient, wire
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc
from batchd.proto import channel as secure_channel

log = logging.getLogger("batchd.client")


class _Ended(Exception):
    """A `Batches` stream ended without the end of the epoch."""


@dataclass(frozen=True)
class ClientOptions:
    """How a `BatchClient` talks to its rank service: `credits`, the batches the service may send ahead of
    consumption; `reconnect_timeout_s`, how long it retries a rank service that became unreachable (a
    restart); `startup_timeout_s`, how long the first connection waits for a rank service that is not up
    yet (module docstring).

    Raises:
        ValueError: naming the value, on `credits` < 1 or a timeout <= 0.
    """

    credits: int = 4
    reconnect_timeout_s: float = 60.0
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.credits < 1:
            raise ValueError(f"credits must be >= 1, got credits={self.credits}")
        for name in ("reconnect_timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {name}={value}")


class BatchClient:
    """Iterates over (batch, StepInfo) for one rank (see module docstring).

    Args:
        address: The rank service's host:port.
        rank: This trainer's rank.
        world_size: Ranks in the job.
        epoch: Epoch to read.
        security: TLS / mutual TLS / bearer token of this trainer process (`batchd.proto.Security`, e.g.
            `Security(token=..., tls_ca=...)`); None connects in plaintext without a token.
        group_rank: This process's index in the rank's model-parallel group, in [0, group_size).
        group_size: Processes that consume this rank's batches together (1: a plain data-parallel trainer).
        options: Credits and the reconnect and startup timeouts (`ClientOptions`; default `ClientOptions()`).

    Raises:
        ValueError: naming the value, on a rank or group rank out of range or `options` not a `ClientOptions`.
    """

    def __init__(
        self,
        address: str,
        rank: int,
        world_size: int,
        epoch: int = 0,
        *,
        security: Security | None = None,
        group_rank: int = 0,
        group_size: int = 1,
        options: ClientOptions | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got {rank=} {world_size=}")
        if group_size < 1 or not 0 <= group_rank < group_size:
            raise ValueError(f"group_rank must be in [0, group_size), got {group_rank=} {group_size=}")
        options = ClientOptions() if options is None else options
        if not isinstance(options, ClientOptions):
            raise ValueError(f"options must be a ClientOptions, got {options=!r}")
        self.group_rank, self.group_size = group_rank, group_size
        self.address, self.rank, self.world_size, self.epoch = address, rank, world_size, epoch
        self.options = options
        self.credits, self.reconnect_timeout_s = options.credits, options.reconnect_timeout_s
        self.startup_timeout_s = options.startup_timeout_s
        self._connected = False  # once a stream got through, an unreachable service is a restart
        self.next_step = 0
        self.finished = False
        self._marks: list[
            tuple[int, int, bool]
        ] = []  # checkpoints to tell the service, (epoch, step, durable)
        self._marks_lock = threading.Lock()
        # The open stream's requests: acks (int), checkpoints (epoch, step, durable), None to end it.
        self._open_requests: queue.Queue[int | tuple[int, int, bool] | None] | None = None
        self._last_point: tuple[int, int] | None = None
        self.resize_from = 0  # `load_state_dict(..., resize=True)` of a state saved at another world size
        self.channel = secure_channel(address, security, CHANNEL_OPTIONS)
        self.stub = pb_grpc.RankServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This client's position, for a checkpoint: the rank service keeps the batches after it for a
        restart from it (see module docstring, "Rewind to a checkpoint")."""
        self._last_point = (self.epoch, self.next_step)
        self._mark((*self._last_point, False))
        return {
            "version": 1,
            "rank": self.rank,
            "world_size": self.world_size,
            "group_rank": self.group_rank,
            "group_size": self.group_size,
            "epoch": self.epoch,
            "next_step": self.next_step,
            "finished": self.finished,
        }

    def checkpointed(self) -> None:
        """The checkpoint of the last `state_dict()` is saved (its write completed): the rank service frees
        the batches before it now, instead of keeping them until the next checkpoint. Optional."""
        if self._last_point is not None:
            self._mark((*self._last_point, True))

    def _mark(self, mark: tuple[int, int, bool]) -> None:
        with self._marks_lock:
            if self._open_requests is not None:
                self._open_requests.put(mark)
            else:  # told when the next stream opens
                self._marks.append(mark)

    def load_state_dict(self, state: Mapping[str, Any], resize: bool = False) -> None:
        """Resumes where `state` (a `state_dict()`) stopped. A state of another rank or world size is refused,
        unless `resize`: a job resumed at another world size (`batchd coordinator --resize`) takes any
        rank's state of the old size (every data-parallel rank saved the same position at an update's
        end), and the rank service resumes the epoch there at this world size. Raises ValueError naming
        each field that differs."""
        saved = {"group_rank": 0, "group_size": 1, **state}  # states from before groups: a plain trainer
        checked = [("group_rank", self.group_rank), ("group_size", self.group_size)]
        if not resize:
            checked = [("rank", self.rank), ("world_size", self.world_size), *checked]
        bad = [f"{k}: saved {saved.get(k)!r}, current {v!r}" for k, v in checked if saved.get(k) != v]
        if state.get("version") != 1 or bad:
            hint = (
                "; to resume at another world size pass resize=True"
                if not resize and "world_size" in " ".join(bad)
                else ""
            )
            raise ValueError(
                f"BatchClient state does not match this client ({'; '.join(bad) or 'version'}){hint}"
            )
        self.epoch, self.next_step, self.finished = state["epoch"], state["next_step"], state["finished"]
        self.resize_from = (
            int(state["world_size"]) if resize and state["world_size"] != self.world_size else 0
        )
        if self.resize_from:  # take the epoch's end again from the resized service: it learns where we stand
            self.finished = False

    def set_epoch(self, epoch: int) -> None:
        """Reads `epoch` next, from its first step: call it before each epoch's loop, like
        `DistributedSampler.set_epoch`. The current epoch keeps its position (a client restored with
        `load_state_dict` resumes mid-epoch). The rank service starts epoch e+1 once this trainer has
        taken the end of epoch e; an epoch the job does not run fails with the service's message."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch=}")
        if epoch != self.epoch:
            self.epoch, self.next_step, self.finished = epoch, 0, False

    def job_epochs(self, timeout: float | None = None) -> int:
        """The number of epochs the job runs, asked of the rank service (waits for it up to `timeout`,
        default `startup_timeout_s`, logging every few seconds; `RankServiceError` when it stays away)."""
        return max(self._status(timeout).epochs, 1)

    def job_samples(self, timeout: float | None = None) -> int | None:
        """Samples the job trains on per epoch, all ranks together (what `StepInfo.global_samples` sums to
        over the epoch; quarantined records drop out), or None when the rank service does not know it.
        Waits like `job_epochs`."""
        return self._status(timeout).job_samples or None

    def job_max_tokens(self, timeout: float | None = None) -> int | None:
        """The most tokens one sample of a step may have (the job's token budget and over-budget policy,
        its sources' cutoff), or None when the rank service does not know: size the model's positions by
        it. Waits like `job_epochs`."""
        return self._status(timeout).max_tokens or None

    def report_oom(self, info: StepInfo, error: BaseException) -> JobFailed:
        """Says that this trainer's step `info` of the current epoch ran out of memory (`error`): the job
        lowers its token budget for every step not yet trained and fails, to go on from the trainers'
        checkpoint once restarted (`Coordinator.Oom`). Returns the `JobFailed` to raise, which names the
        step and both budgets (or, when the report could not be made, why)."""
        request = pb.OomRequest(
            rank=self.rank,
            epoch=self.epoch,
            step=info.step,
            cost=info.cost,
            detail=str(error)[:1000],
        )
        try:
            reply: pb.OomReply = self.stub.Oom(request, timeout=60)
        except grpc.RpcError as exc:
            return JobFailed(
                f"rank {self.rank}'s trainer ran out of memory on step {info.step} ({error}); reporting "
                f"it to {self._party()} failed: {exc.code().name}: {exc.details()}"
            )
        return JobFailed(reply.message)

    def _status(self, timeout: float | None) -> pb.RankStatusReply:
        """This rank's `RankStatus`, retried while the rank service is unreachable (not up yet) for up to
        `timeout` (default `startup_timeout_s`)."""
        limit = self.startup_timeout_s if timeout is None else timeout
        start = last_log = time.monotonic()
        while True:
            left = limit - (time.monotonic() - start)
            try:  # no wait_for_ready: a refused connection fails at once, and its reason is logged
                reply: pb.RankStatusReply = self.stub.RankStatus(
                    pb.RankStatusRequest(rank=self.rank), timeout=max(min(left, WAIT_LOG_S), 0.1)
                )
                return reply
            except grpc.RpcError as exc:
                now = time.monotonic()
                if not (transient(exc) or exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise RankServiceError(
                        f"{self._party()} refused RankStatus: {exc.code().name}: {exc.details()}", exc.code()
                    ) from None
                if now - start >= limit:
                    raise self._unreachable("RankStatus", exc.code(), exc.details(), limit, True) from None
                if now - last_log >= WAIT_LOG_S:
                    self._log_wait(now - start, limit, exc.code(), exc.details())
                    last_log = now
                time.sleep(0.2)

    def _party(self) -> str:
        member = f", group member {self.group_rank} of {self.group_size}" if self.group_size > 1 else ""
        return f"the rank service at {self.address} (rank {self.rank} of {self.world_size}{member})"

    def _log_wait(self, waited: float, limit: float, code: grpc.StatusCode, details: str | None) -> None:
        """The waiting line, worded like the services' (`batchd.proto.retry_while_unreachable`)."""
        log.info("waiting for %s (%.0fs of %gs): %s: %s", self._party(), waited, limit, code.name, details)

    def _unreachable(
        self, what: str, code: grpc.StatusCode, details: str | None, limit: float, started: bool
    ) -> RankServiceError:
        return RankServiceError(
            f"{self._party()} unreachable for {limit:g}s: {code.name}: {details} ({what} retried every 0.2s "
            + (
                "since start-up, for the start-up timeout; is a rank service or node agent listening there?)"
                if started
                else "since the connection broke, for the reconnect timeout)"
            ),
            code,
        )

    # -- iteration -----------------------------------------------------------------------------------
    def __iter__(self) -> Generator[tuple[dict[str, Any], StepInfo], None, None]:
        start = None
        last_log = time.monotonic()
        while not self.finished:
            try:
                for item in self._stream():
                    start = None
                    self._connected = True
                    yield item
                if self.finished:
                    return
                # The stream ended without the end of the epoch: the service is stopping (a restart may
                # follow). As a disconnect: connect again within the reconnect window.
                raise _Ended()
            except (grpc.RpcError, _Ended) as exc:
                code, details = (
                    (
                        grpc.StatusCode.UNAVAILABLE,
                        "the rank service ended the stream before the end of the epoch",
                    )
                    if isinstance(exc, _Ended)
                    else (exc.code(), exc.details())
                )
                if code == grpc.StatusCode.ABORTED:
                    raise JobFailed(details) from None
                if code in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.CANCELLED,
                    grpc.StatusCode.UNKNOWN,
                    grpc.StatusCode.INTERNAL,
                ):
                    now = time.monotonic()
                    start = start or now
                    limit = self.reconnect_timeout_s if self._connected else self.startup_timeout_s
                    if now - start < limit:
                        if now - last_log >= WAIT_LOG_S:
                            self._log_wait(now - start, limit, code, details)
                            last_log = now
                        time.sleep(0.2)
                        continue
                    raise self._unreachable("Batches", code, details, limit, not self._connected) from None
                raise RankServiceError(f"{self._party()}: {code.name}: {details}", code) from None

    def _requests(self, acks: queue.Queue[int | tuple[int, int, bool] | None]) -> Iterator[pb.BatchRequest]:
        """A `Batches` call's requests: where to start, then each ack (an int) and checkpoint (a tuple)."""
        yield pb.BatchRequest(
            start_step=self.next_step,
            credits=self.credits,
            epoch=self.epoch,
            rank=self.rank,
            group_rank=self.group_rank,
            group_size=self.group_size,
            resize_from=self.resize_from,
        )
        while (item := acks.get()) is not None:
            if isinstance(item, tuple):
                epoch, step, durable = item
                yield pb.BatchRequest(saved_epoch=epoch, saved_step=step, saved_durable=durable)
            else:
                yield pb.BatchRequest(ack_step=item)

    def _stream(self) -> Iterator[tuple[dict[str, Any], StepInfo]]:
        """One `Batches` call. A receiver thread reads and decodes up to `credits` batches ahead while the
        trainer computes (torch releases the GIL), so receiving and decoding hide behind the step."""
        acks: queue.Queue[int | tuple[int, int, bool] | None] = queue.Queue()
        with self._marks_lock:  # checkpoints taken while no stream was open go first
            for mark in self._marks:
                acks.put(mark)
            self._marks.clear()
            self._open_requests = acks

        call = self.stub.Batches(self._requests(acks))
        ready: queue.Queue[object] = queue.Queue(maxsize=self.credits)
        stop = threading.Event()

        def put(item: object) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def receive(expected: int) -> None:
            try:
                for batch in call:
                    if batch.end_of_epoch:
                        put(_END)
                        return
                    info = wire.info_from_pb(batch.info)
                    if info.step != expected:
                        raise BatchdError(f"rank {self.rank}: expected step {expected}, got {info.step}")
                    # Model inputs: tensors, and max_seqlen as a plain int (flash-attention's kwarg).
                    tensors: dict[str, Any] = {
                        name: torch.from_numpy(arr.copy())
                        for name, arr in wire.tensors_from_pb(batch.tensors).items()
                    }
                    if "cu_seqlens" in tensors:
                        tensors["max_seqlen"] = int(
                            (tensors["cu_seqlens"][1:] - tensors["cu_seqlens"][:-1]).max()
                        )
                    tensors["sample_ids"] = torch.tensor(list(batch.sample_ids), dtype=torch.int64)
                    expected += 1
                    if not put((tensors, info)):
                        return
                put(_EOF)
            except Exception as exc:  # noqa: BLE001 - re-raised in the iterating thread
                put(exc)

        receiver = threading.Thread(
            target=receive, args=(self.next_step,), name=f"batchd-client-{self.rank}", daemon=True
        )
        receiver.start()
        try:
            while True:
                item = ready.get()
                if item is _END:
                    self.finished = True
                    return
                if item is _EOF:
                    return
                if isinstance(item, BaseException):
                    raise item
                tensors, info = cast(tuple[dict[str, Any], StepInfo], item)
                self.next_step = info.step + 1
                yield tensors, info
                acks.put(self.next_step)
        finally:
            with self._marks_lock:
                self._open_requests = None
            stop.set()
            acks.put(None)
            call.cancel()
            receiver.join(5)


_END = object()  # the service said: end of epoch
_EOF = object()  # the stream closed without saying so
