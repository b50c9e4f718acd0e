"""A rank's trainer side: attaching trainer streams, their credits and acks, over the pure `core.Delivery`.

The `Batches` handler (`_server`) drives one `TrainerStream` per call through `TrainerSide`:

    connect (attach, or the epoch's END, or a refusal) -> next_item / sent ... (credits bound what is in
    flight) -> ack (by the ack reader thread) -> detach (when the call ends)

`core.Delivery` decides everything (who holds a member's stream, what to send next, when a trainer is
gone); this module adds the waiting and the locking. Every method takes the rank's condition (`cond`, the
one lock of a `RankServiceCore`) and notifies it after a change, so the round loop sees freed output slots
and the handlers see new batches.

Output flow control: at most `depth` collated batches wait for the trainer (D of the ODB paper); the
capacity the rank reports is `depth - ready`, so the round never makes more steps than fit. A batch stays
held until the trainer acknowledges it (it asks for the next step), so a restarted trainer gets it again;
end of epoch is sent only after every step is acknowledged, and journaled as sent before it is written.

Rewind: consumed batches stay held from the floor on (`core.Delivery`: the older of the trainer's last two
checkpoints), in this epoch (`batches`) and in epochs before it (`past`), so trainers restarted from their
checkpoint get the same batches again. They count against `retain_bytes`: past it, the oldest are freed
(the floor rises, logged once per epoch with what a restart can still resume from).

Failure: the job's failure (it names the rank) reaches the trainer as a RuntimeError (the handler sends
ABORTED). A trainer that disconnects mid-epoch and does not come back within `client_grace_s` fails the job,
naming this rank; so does a trainer that never connects, or does not come back for the next epoch, while
the rank's batches wait for it for `trainer_timeout_s` (`Delivery.check`, judged every WATCH_S by the
rank's watcher thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from batchd.core import ATTACHED, SEND_END, WAIT, Connect, Delivery, Step
from batchd.proto import batchd_pb2 as pb

log = logging.getLogger("batchd.rank")

WATCH_S = 0.5  # how often the liveness of the trainer is judged (`Delivery.check`)
BUSY_WAIT_S = 2.0  # a new trainer stream waits this long for a holder whose stream is ending
RETAIN_BYTES = 2 << 30  # default memory for consumed batches held for a rewind, per rank


class TrainerStream:
    """One trainer `Batches` stream: identity per call, shown as the trainer's address."""

    __slots__ = ("peer", "context")

    def __init__(self, peer: str, context: Any) -> None:
        self.peer, self.context = peer, context

    def __str__(self) -> str:
        return self.peer


class TrainerSide:
    """The trainer streams of one rank (see module docstring).

    Args:
        delivery: The rank's `core.Delivery` (its epoch, held steps and trainer members).
        cond: The rank's condition; every method takes it.
        stop: Set when the service stops: waits end (`next_item` raises ConnectionAbortedError).
        failure: The job's failure message, or None (read with `cond` held).
        on_end_sent: Journals the end as sent (called with `cond` held, before the end is written).

    Attributes:
        batches: The collated batches of the held steps (`Delivery.ready`), by step number.
    """

    def __init__(
        self,
        delivery: Delivery,
        cond: threading.Condition,
        stop: threading.Event,
        failure: Callable[[], str | None],
        on_end_sent: Callable[[], None],
        retain_bytes: int = RETAIN_BYTES,
    ) -> None:
        if retain_bytes < 0:
            raise ValueError(f"retain_bytes must be >= 0, got {retain_bytes=}")
        self.delivery, self.cond, self._stop = delivery, cond, stop
        self._failure, self._on_end_sent = failure, on_end_sent
        self.batches: dict[int, tuple[Step, pb.Batch]] = {}
        self.past: dict[int, dict[int, tuple[Step, pb.Batch]]] = {}  # epochs before this one, held
        self.retain_bytes = retain_bytes
        # the consumed batches held, oldest first: (epoch, step) -> bytes (measured once), and their sum
        self._counted: dict[tuple[int, int], int] = {}
        self._held = 0
        self._count_from = 0  # this epoch's steps below it are counted (or were freed)
        self._over_budget_logged = -1  # the epoch whose budget overrun was logged
        self.resize_from = 0  # a resized job: the world size of the first trainer's saved state

    def end_epoch(self) -> None:
        """The epoch ends (call before `Delivery.advance`, with `cond` held): its batches stay held as a past
        epoch, for as long as the floor keeps them."""
        self._count()
        self.past[self.delivery.epoch] = dict(self.batches)
        self.batches.clear()
        self._count_from = 0

    def clear(self) -> None:
        """Forgets every batch (a resized job starts over)."""
        self.batches.clear()
        self.past.clear()
        self._counted.clear()
        self._held, self._count_from = 0, 0

    def batch_of(self, epoch: int, step: int) -> pb.Batch:
        return (self.batches if epoch == self.delivery.epoch else self.past[epoch])[step][1]

    def held_bytes(self) -> int:
        """Bytes of the consumed batches held for a rewind (each batch measured once)."""
        return self._held

    def recount(self) -> None:
        """Counts every held batch again, oldest first (after the batches were restored from a journal)."""
        self._counted.clear()
        self._held = 0
        for q in sorted(self.past):
            for i in sorted(self.past[q]):
                self._add(q, i, self.past[q][i][1])
        self._count_from = 0
        self._count()

    def _add(self, epoch: int, step: int, batch: pb.Batch) -> None:
        size = self._counted[(epoch, step)] = batch.ByteSize()
        self._held += size

    def _count(self) -> None:
        """Counts this epoch's batches consumed since the last count (in step order: oldest first)."""
        d = self.delivery
        for i in range(self._count_from, d.acked):
            item = self.batches.get(i)
            if item is not None and (d.epoch, i) not in self._counted:
                self._add(d.epoch, i, item[1])
        self._count_from = max(self._count_from, d.acked)

    def _prune_locked(self) -> None:
        d = self.delivery
        self._count()
        if self._held > self.retain_bytes:
            total = self._held
            for (q, i), size in self._counted.items():  # oldest first
                total -= size
                if total <= self.retain_bytes:
                    d.drop_until(q, i + 1)
                    break
            if self._over_budget_logged != d.epoch:
                self._over_budget_logged = d.epoch
                log.warning(
                    "rank %d: the batches consumed since its trainer's second-last checkpoint pass the "
                    "retention budget (%.0f MiB): a restarted trainer can resume no earlier than epoch "
                    "%d step %d; checkpoint more often or raise the budget (--retain-mb)",
                    d.rank,
                    self.retain_bytes / 2**20,
                    *d.floor,
                )
        while self._counted:  # free the oldest the floor no longer keeps: they were all consumed
            q, i = next(iter(self._counted))
            low = d.held_from(q)
            if low is not None and i >= low:
                break
            self._held -= self._counted.pop((q, i))
            (self.batches if q == d.epoch else self.past.get(q, {})).pop(i, None)
        for q in [q for q in self.past if d.held_from(q) is None or not self.past[q]]:
            del self.past[q]

    def prune(self) -> None:
        """Frees what the floor no longer keeps (call with `cond` held)."""
        self._prune_locked()

    def checkpoint(self, stream: TrainerStream, epoch: int, step: int, durable: bool) -> None:
        """`stream`'s trainer took a checkpoint at (epoch, step) (`Delivery.checkpoint`): frees what the
        floor no longer keeps."""
        with self.cond:
            self.delivery.checkpoint(stream, epoch, step, durable)
            self._prune_locked()
            self.cond.notify_all()

    def detach(self, stream: TrainerStream) -> None:
        """The end of `stream`'s call (its grace period starts, `Delivery.disconnect`)."""
        with self.cond:
            self.delivery.disconnect(stream, time.monotonic())
            self.cond.notify_all()

    def ack(self, stream: TrainerStream, step: int) -> None:
        """`stream`'s trainer asks for step `step`: every step before it is acknowledged and dropped."""
        with self.cond:
            self.delivery.ack(stream, step)
            self._prune_locked()
            self.cond.notify_all()

    def connect(
        self,
        stream: TrainerStream,
        epoch: int,
        start_step: int,
        credits: int,
        member: int = 0,
        group_size: int = 1,
        resize_from: int = 0,
    ) -> Connect:
        """Attaches a trainer stream, member `member` of a group of `group_size` (see `Delivery.connect`):
        waits while the next epoch is about to start, the rank waits for a resized job to resume
        (`resize_from`: the world size of the trainer's saved state, kept for the resume) or a previous
        stream of this member is ending (up to BUSY_WAIT_S); returns the final outcome. Raises RuntimeError
        with the job's failure."""
        busy_until = time.monotonic() + BUSY_WAIT_S
        with self.cond:
            if self.delivery.awaiting and self.delivery.resume_request is None:
                self.resize_from = resize_from
            while True:
                failure = self._failure()
                if failure is not None:
                    raise RuntimeError(failure)
                # The delivery's clients are this rank's TrainerStreams (core keeps them as Hashable).
                holder = cast(TrainerStream | None, self.delivery.holder_of(member))
                now = time.monotonic()
                if holder is not None and holder is not stream:
                    if not holder.context.is_active():  # its end is not processed yet
                        self.delivery.disconnect(holder, now)
                    elif now < busy_until and stream.context.is_active():
                        self.cond.wait(0.1)
                        continue
                outcome = self.delivery.connect(stream, epoch, start_step, credits, now, member, group_size)
                if outcome.outcome != WAIT or not stream.context.is_active() or self._stop.is_set():
                    if outcome.outcome == ATTACHED:
                        self._prune_locked()
                    self.cond.notify_all()
                    return outcome
                self.cond.wait(0.5)

    def next_item(self, stream: TrainerStream) -> tuple[int, pb.Batch] | None:
        """Waits for what to send `stream` next: (step, batch), or None for the end of the epoch (journaled
        as sent before it is written). Raises RuntimeError with the job failure; ConnectionAbortedError when
        the stream ended."""
        with self.cond:
            while True:
                failure = self._failure()
                if failure is not None:
                    raise RuntimeError(failure)
                if not stream.context.is_active() or self._stop.is_set() or not self.delivery.holds(stream):
                    raise ConnectionAbortedError
                nxt = self.delivery.next_for(stream)
                if nxt == SEND_END:
                    self.delivery.mark_end_sent(stream)
                    self._on_end_sent()
                    self.cond.notify_all()
                    return None
                if isinstance(nxt, int):
                    return nxt, self.batch_of(self.delivery.epoch_of(stream), nxt)
                self.cond.wait(0.5)

    def sent(self, stream: TrainerStream, step: int) -> None:
        """Step `step` was written to `stream` (it takes one of its credits)."""
        with self.cond:
            self.delivery.sent(stream, step)
