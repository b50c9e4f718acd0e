"""One rank's delivery of aligned steps to its trainer, across the epochs of a job: a pure state machine.

The rank service's round loop makes steps (`add`, then `close` once the epoch has no further step);
its `Batches` stream hands them to one trainer under credit-based flow control; the trainer
acknowledges what it consumed. Nothing here does I/O or reads a clock: every call that depends on
time takes `now`, so the daemon drives it with `time.monotonic()` and the tests with a moved clock.

Contract:
- Held until acknowledged: a step stays `ready` until the trainer acknowledges it (`ack(k)`: every
  step < k was consumed), so a restarted trainer gets it again. At most `depth` steps are ready
  (`capacity` is what the rank reports to the alignment round).
- Credits: at most `credits` steps are sent ahead of the last acknowledgement.
- End of epoch is sent once, and only after every step was acknowledged (unconsumed steps stay held
  for a restarted trainer). The service marks it `end_sent` before it writes it (write-ahead: a
  restart must not wait for a trainer that already left).
- Epoch hand-off: once the trainer took the end of epoch e < epochs-1, `advance()` starts e+1. A
  trainer asking for epoch e+1 before that waits (`WAIT`); one asking again for epoch e after taking
  all of its steps but losing the end gets the end again (`END`); any other epoch is refused naming why.
- Job end: `finished` once the trainer took the end of the last epoch.
- One trainer per rank: a second one is refused, naming the rank and the holder.
- Resume: a trainer resumes at `start_step`; a step before the last acknowledgement was freed and
  cannot be sent again, so such a start is refused naming both numbers.
- Timeouts (liveness only; a slow trainer never fails): a trainer that disconnected mid-epoch and did
  not come back within `grace_s` fails the job; a rank whose ready steps (or end of epoch) waited
  `trainer_timeout_s` with no trainer connected (one that never connected, or did not come back for
  the next epoch: model loading and evaluation take long) fails it too. `check(now)` names the rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

from ._types import check_int

# outcomes of `connect`
ATTACHED, WAIT, END, REFUSED = "attached", "wait", "end", "refused"
# what `next_for` says besides a step number
SEND_END = "end"
K_EPOCH, K_READY, K_MADE, K_ACKED, K_DONE, K_END_SENT, K_PREV = (
    "epoch", "ready", "made", "acked", "done", "end_sent", "prev_epoch_steps")


def fixed_capacity(depth: int) -> int:
    """The capacity every rank reports in deterministic mode (`JobSpec.deterministic`): max(1, depth // 2).

    Half the depth: while a round runs, the trainer still has the other half of its batches buffered, so
    it rarely waits on the round; and a constant, so the alignment target never follows the trainer's speed.
    """
    check_int("depth", depth, lo=1)
    return max(1, depth // 2)


def report_capacity(free: int, depth: int, deterministic: bool) -> int | None:
    """The capacity a rank with `free` output slots (of `depth`) reports now, or None: wait for its trainer
    to free slots first.

    Default: every free slot (`free`), once there is one; the round's T then follows how fast the trainer
    consumes. Deterministic: `fixed_capacity(depth)`, once at least that many slots are free; the value
    never depends on `free`, so it never depends on timing. Either way the value is <= `free` (a round never
    makes more steps than fit), and a rank whose trainer took every batch (`free == depth`) reports.
    """
    check_int("depth", depth, lo=1)
    check_int("free", free, lo=0, hi=depth)
    if deterministic:
        c = fixed_capacity(depth)
        return c if free >= c else None
    return free if free > 0 else None


@dataclasses.dataclass(frozen=True)
class Connect:
    """What `connect` decided: `outcome` is ATTACHED, WAIT, END or REFUSED (`reason` says why)."""

    outcome: str
    reason: str = ""


class Delivery:
    """Delivery of one rank's steps to its trainer (see module docstring)."""

    def __init__(self, rank: int, epochs: int, depth: int, grace_s: float, trainer_timeout_s: float,
                 now: float, epoch: int = 0) -> None:
        check_int("rank", rank, lo=0)
        check_int("epochs", epochs, lo=1)
        check_int("depth", depth, lo=1)
        check_int("epoch", epoch, lo=0, hi=epochs - 1)
        if not grace_s > 0 or not trainer_timeout_s > 0:
            raise ValueError(f"timeouts must be > 0, got {grace_s=} {trainer_timeout_s=}")
        self.rank, self.epochs, self.depth = rank, epochs, depth
        self.grace_s, self.trainer_timeout_s = grace_s, trainer_timeout_s
        self._reset(epoch, now)
        self.prev_epoch_steps = 0
        self.holder: Hashable | None = None
        self.credits = 1
        self.cursor = 0  # the next step to send to the holder

    def _reset(self, epoch: int, now: float) -> None:
        self.epoch = epoch
        self.ready: list[int] = []
        self.made = 0  # steps made in this epoch (0..made-1)
        self.acked = 0  # every step < acked was consumed
        self.done = False  # no step follows `made` in this epoch
        self.end_sent = False
        self.gone_since: float | None = None  # the trainer left mid-epoch at this time
        self.unattended_since = now  # no trainer connected since

    # -- the round loop's side -----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Steps the next round may make: `depth` minus the steps waiting for the trainer."""
        return self.depth - len(self.ready)

    def add(self, steps: list[int]) -> None:
        """The round made these steps (consecutive numbers from `made`)."""
        if self.done:
            raise ValueError(f"rank {self.rank}: epoch {self.epoch} is closed, got steps {steps}")
        if list(steps) != list(range(self.made, self.made + len(steps))):
            raise ValueError(f"rank {self.rank}: steps must continue at {self.made}, got {steps}")
        if len(self.ready) + len(steps) > self.depth:
            raise ValueError(f"rank {self.rank}: {len(steps)} steps exceed the capacity {self.capacity}")
        self.ready += steps
        self.made += len(steps)

    def close(self) -> None:
        """The epoch has no step after the ones made."""
        self.done = True

    @property
    def finished(self) -> bool:
        """The trainer took the end of the job's last epoch."""
        return self.end_sent and self.epoch + 1 >= self.epochs

    @property
    def can_advance(self) -> bool:
        return self.end_sent and self.epoch + 1 < self.epochs

    def advance(self, now: float) -> None:
        """Starts the next epoch (its trainer took this one's end)."""
        if not self.can_advance:
            raise ValueError(f"rank {self.rank}: epoch {self.epoch} cannot hand off "
                             f"(end sent: {self.end_sent}, epochs {self.epochs})")
        self.prev_epoch_steps = self.made
        self._reset(self.epoch + 1, now)

    # -- the trainer's side --------------------------------------------------------------------------
    def connect(self, client: Hashable, epoch: int, start_step: int, credits: int, now: float) -> Connect:
        """A trainer opens a stream for `epoch` at `start_step` with `credits`."""
        check_int("start_step", start_step, lo=0)
        if epoch == self.epoch + 1 < self.epochs and self.end_sent:
            return Connect(WAIT, f"rank {self.rank} starts epoch {epoch} next")
        if epoch + 1 == self.epoch and start_step >= self.prev_epoch_steps:
            return Connect(END)  # it took every step of the epoch before but lost the end
        if epoch != self.epoch:
            if epoch >= self.epochs:
                why = f"the job runs {self.epochs} epoch(s), 0..{self.epochs - 1}"
            else:
                why = f"rank {self.rank} is in epoch {self.epoch}" + (
                    " and its trainer has not taken that epoch's last step" if epoch == self.epoch + 1 else "")
            return Connect(REFUSED, f"the trainer asked for epoch {epoch}, but {why}")
        if self.holder is not None and self.holder != client:
            return Connect(REFUSED, f"rank {self.rank}'s batches already stream to trainer {self.holder}; "
                                    f"a rank serves one trainer")
        if start_step < self.acked:
            return Connect(REFUSED, f"the trainer resumes rank {self.rank} at step {start_step} of epoch {epoch}, "
                                    f"but steps < {self.acked} were acknowledged and freed")
        if start_step > self.made:
            return Connect(REFUSED, f"the trainer resumes rank {self.rank} at step {start_step} of epoch {epoch}, "
                                    f"but this rank made {self.made} step(s) so far")
        self.holder, self.credits, self.cursor = client, max(int(credits), 1), start_step
        self.gone_since = None
        self._ack(start_step)
        return Connect(ATTACHED)

    def disconnect(self, client: Hashable, now: float) -> None:
        """The holder's stream ended (any reason); others are ignored."""
        if client != self.holder:
            return
        self.holder = None
        self.unattended_since = now
        if not self.end_sent:
            self.gone_since = now

    def ack(self, client: Hashable, step: int) -> None:
        """The holder consumed every step < `step`."""
        if client == self.holder:
            self._ack(step)

    def _ack(self, step: int) -> None:
        if step > self.made:
            step = self.made  # a trainer cannot have consumed more than was made
        if step > self.acked:
            self.acked = step
            self.ready = [s for s in self.ready if s >= step]

    def next_for(self, client: Hashable) -> int | str | None:
        """What to send the holder now: a step number, SEND_END, or None (wait for a change)."""
        if client != self.holder:
            return None
        if self.cursor < self.made:
            return self.cursor if self.cursor - self.acked < self.credits else None
        if self.done and self.acked >= self.made:
            return SEND_END
        return None

    def sent(self, client: Hashable, step: int) -> None:
        if client == self.holder and step == self.cursor:
            self.cursor += 1

    def mark_end_sent(self, client: Hashable) -> None:
        """The end of the epoch is about to be written to the holder (journal it first)."""
        if client != self.holder or self.next_for(client) != SEND_END:
            raise ValueError(f"rank {self.rank}: the end of epoch {self.epoch} is not due")
        self.end_sent = True

    # -- liveness ------------------------------------------------------------------------------------
    def check(self, now: float) -> str | None:
        """The failure at `now`, naming this rank, or None."""
        if self.holder is not None or self.finished:
            return None
        if self.gone_since is not None and now - self.gone_since > self.grace_s:
            return f"trainer of rank {self.rank} disconnected and did not reconnect within {self.grace_s:g}s"
        waiting = bool(self.ready) or (self.done and not self.end_sent)
        if waiting and now - self.unattended_since > self.trainer_timeout_s:
            return (f"no trainer connected to rank {self.rank}'s service for {self.trainer_timeout_s:g}s "
                    f"while its batches were ready")
        return None

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {K_EPOCH: self.epoch, K_READY: list(self.ready), K_MADE: self.made, K_ACKED: self.acked,
                K_DONE: self.done, K_END_SENT: self.end_sent, K_PREV: self.prev_epoch_steps}

    def load_state_dict(self, state: Mapping[str, Any], now: float) -> None:
        """Restores a `state_dict()`; nobody is connected afterwards."""
        check_int("epoch", state[K_EPOCH], lo=0, hi=self.epochs - 1)
        self._reset(state[K_EPOCH], now)
        self.ready, self.made, self.acked = list(state[K_READY]), state[K_MADE], state[K_ACKED]
        self.done, self.end_sent, self.prev_epoch_steps = state[K_DONE], state[K_END_SENT], state[K_PREV]
        self.holder = None
