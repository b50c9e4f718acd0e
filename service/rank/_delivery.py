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

Failure: the job's failure (it names the rank) reaches the trainer as a RuntimeError (the handler sends
ABORTED). A trainer that disconnects mid-epoch and does not come back within `client_grace_s` fails the job,
naming this rank; so does a trainer that never connects, or does not come back for the next epoch, while
the rank's batches wait for it for `trainer_timeout_s` (`Delivery.check`, judged every WATCH_S by the
rank's watcher thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from batchd.core import ATTACHED, SEND_END, WAIT, Connect, Delivery, Step
from batchd.proto import batchd_pb2 as pb

WATCH_S = 0.5  # how often the liveness of the trainer is judged (`Delivery.check`)
BUSY_WAIT_S = 2.0  # a new trainer stream waits this long for a holder whose stream is ending


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
    ) -> None:
        self.delivery, self.cond, self._stop = delivery, cond, stop
        self._failure, self._on_end_sent = failure, on_end_sent
        self.batches: dict[int, tuple[Step, pb.Batch]] = {}
        self.resize_from = 0  # a resized job: the world size of the first trainer's saved state

    def _prune_locked(self) -> None:
        for i in [i for i in self.batches if i < self.delivery.acked]:
            del self.batches[i]

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
                holder = self.delivery.holder_of(member)
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
                if nxt is not None:
                    return nxt, self.batches[nxt][1]
                self.cond.wait(0.5)

    def sent(self, stream: TrainerStream, step: int) -> None:
        """Step `step` was written to `stream` (it takes one of its credits)."""
        with self.cond:
            self.delivery.sent(stream, step)
