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
- One trainer per rank, or one trainer group: in model-parallel jobs (tensor, context or pipeline
  parallelism) a group of `group_size` processes consumes one data-parallel rank's batches. Each
  member connects with its index; every member gets every step, with its own credits and cursor; a
  step is freed once every member acknowledged it, and the end of the epoch is sent to a member once
  every member acknowledged every step. The first trainer to connect fixes the group size; one that
  declares another size is refused, naming both; a second process for a member is refused, naming the
  rank, the member and the holder.
- Resume and rewind: a trainer resumes at (epoch, `start_step`) anywhere from the `floor` on. Steps the
  trainers consumed stay held until their checkpoints make them unneeded, so trainers that restart together
  from a checkpoint at step S (a crash after S: the steps after it belonged to a model that was thrown
  away) get the steps after S again, the same batches, in this epoch or in an epoch before it (`past`).
  A member's checkpoints (`checkpoint`: `BatchClient.state_dict()` was taken there; `durable`: the
  trainer said the save completed) move the floor: it is the older of each member's last two checkpoints
  (a crash in the middle of writing the newest one resumes from the one before), or its last durable
  one, whichever is later, the minimum over the members; it never moves back. A trainer that rewinds
  drops its checkpoints after the rewind point (they were of the lineage thrown away). `drop_until`
  raises the floor (the service's memory budget for held steps). A start before the floor is refused,
  naming both positions.
- Resize: until its service knows whether the job was resized since its state was saved, a rank holds
  its trainers back (`await_resume`: they WAIT); not resized, it goes on where it stands (`release`);
  resized, its first trainer's (epoch, start_step) is the request the service passes to the
  coordinator, and `start_at` puts the delivery at the answer.
- Timeouts (liveness only; a slow trainer never fails): a trainer (a group member) that disconnected
  mid-epoch and did not come back within `grace_s` fails the job; a rank whose ready steps (or end of
  epoch) waited `trainer_timeout_s` with no trainer connected (one that never connected, or did not
  come back for the next epoch: model loading and evaluation take long) fails it too. `check(now)`
  names the rank (and the
  member of a group).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

from ._state import (
    K_ACKED,
    K_DONE,
    K_END_SENT,
    K_ENDS,
    K_EPOCH,
    K_FLOOR,
    K_GROUP,
    K_MADE,
    K_PAST,
    K_POINTS,
    K_PREV,
    K_READY,
)
from ._types import check_int

# outcomes of `connect`
ATTACHED, WAIT, END, REFUSED = "attached", "wait", "end", "refused"
# what `next_for` says besides a step number
SEND_END = "end"


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


Point = tuple[int, int]  # (epoch, step): a position in the job, ordered


class _Member:
    """One trainer process of a rank's group: who streams to it, what it was sent and consumed."""

    __slots__ = (
        "holder",
        "credits",
        "cursor",
        "acked",
        "end_sent",
        "gone_since",
        "unattended_since",
        "points",
        "replay",
    )

    def __init__(self, now: float, acked: int = 0, points: list[Point] | None = None) -> None:
        self.holder: Hashable | None = None
        self.credits = 1
        self.cursor = acked  # the next step to send
        self.acked = acked  # every step < acked was consumed by this member
        self.end_sent = False  # this member took the end of the epoch
        self.gone_since: float | None = None  # it left mid-epoch at this time
        self.unattended_since = now  # no process connected as this member since
        self.points: list[Point] = list(points or [])  # its last checkpoints, oldest first (at most 2)
        # replaying an epoch before the current one: [epoch, cursor, acked] of that epoch, else None
        self.replay: list[int] | None = None


class Delivery:
    """Delivery of one rank's steps to its trainer, or to its trainer group (see module docstring)."""

    def __init__(
        self,
        rank: int,
        epochs: int,
        depth: int,
        grace_s: float,
        trainer_timeout_s: float,
        now: float,
        epoch: int = 0,
    ) -> None:
        check_int("rank", rank, lo=0)
        check_int("epochs", epochs, lo=1)
        check_int("depth", depth, lo=1)
        check_int("epoch", epoch, lo=0, hi=epochs - 1)
        if not grace_s > 0 or not trainer_timeout_s > 0:
            raise ValueError(f"timeouts must be > 0, got {grace_s=} {trainer_timeout_s=}")
        self.rank, self.epochs, self.depth = rank, epochs, depth
        self.grace_s, self.trainer_timeout_s = grace_s, trainer_timeout_s
        self.group_size: int | None = None  # fixed by the first trainer that connects
        self.members: list[_Member] = []
        self.floor: Point = (epoch, 0)  # the earliest position a trainer may resume at
        # steps made in each epoch before this one; those at or after the floor's epoch are still held
        self.past: dict[int, int] = {}
        self._reset(epoch, now)
        self.prev_epoch_steps = 0
        self.awaiting = False  # a resized job: the first trainer's position says where it goes on
        self.resume_request: tuple[int, int] | None = None  # (epoch, start_step) it asked for

    def _reset(self, epoch: int, now: float, acked: int = 0) -> None:
        self.epoch = epoch
        self.ready: list[int] = []
        self.made = 0  # steps made in this epoch (0..made-1)
        self.acked = acked  # every step < acked was consumed by every member
        self.done = False  # no step follows `made` in this epoch
        points = [m.points for m in self.members] or [[]]
        self.members = [
            _Member(now, acked, points[k] if k < len(points) else None) for k in range(self.group_size or 1)
        ]

    # -- views ---------------------------------------------------------------------------------------
    @property
    def end_sent(self) -> bool:
        """Every member took the end of the epoch."""
        return all(m.end_sent for m in self.members)

    @property
    def holder(self) -> Hashable | None:
        """The stream of the first connected member, or None when no trainer is connected."""
        return next((m.holder for m in self.members if m.holder is not None), None)

    @property
    def cursor(self) -> int:
        """The next step to send member 0."""
        return self.members[0].cursor

    @property
    def gone_since(self) -> float | None:
        """When the first member that is still gone left mid-epoch, or None."""
        return min((m.gone_since for m in self.members if m.gone_since is not None), default=None)

    def holder_of(self, member: int) -> Hashable | None:
        return self.members[member].holder if member < len(self.members) else None

    def holds(self, client: Hashable) -> bool:
        """`client` is the stream of one of the members."""
        return self._member(client) is not None

    def _member(self, client: Hashable) -> _Member | None:
        return next((m for m in self.members if m.holder is not None and m.holder == client), None)

    def _who(self, k: int) -> str:
        return (
            f"trainer of rank {self.rank}"
            if len(self.members) == 1
            else f"trainer of rank {self.rank} (group member {k} of {len(self.members)})"
        )

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
        """Every member took the end of the job's last epoch."""
        return self.end_sent and self.epoch + 1 >= self.epochs

    @property
    def can_advance(self) -> bool:
        return self.end_sent and self.epoch + 1 < self.epochs

    def advance(self, now: float) -> None:
        """Starts the next epoch (every member took this one's end)."""
        if not self.can_advance:
            raise ValueError(
                f"rank {self.rank}: epoch {self.epoch} cannot hand off "
                f"(end sent: {self.end_sent}, epochs {self.epochs})"
            )
        self.prev_epoch_steps = self.made
        self.past[self.epoch] = self.made
        self._reset(self.epoch + 1, now)
        self._normalize_floor()

    # -- a resized job ---------------------------------------------------------------------------------
    def await_resume(self) -> None:
        """This rank starts in a resized job (`batchd.core._resize`): every step it holds is stale, and the
        first trainer to connect says where the job goes on (`resume_request`); until `start_at`, a
        trainer waits (WAIT)."""
        self.awaiting, self.resume_request = True, None

    def release(self) -> None:
        """Ends `await_resume` without moving: the delivery goes on where it stands (the job was not
        resized since its state was saved)."""
        self.awaiting, self.resume_request = False, None

    def start_at(self, epoch: int, step: int, now: float) -> None:
        """Goes on in `epoch` from step `step` (the coordinator's answer to the resume request): nothing
        made or held before it, nobody connected."""
        check_int("epoch", epoch, lo=0, hi=self.epochs - 1)
        check_int("step", step, lo=0)
        self.awaiting, self.resume_request = False, None
        for m in self.members:
            m.points = []
        self._reset(epoch, now, acked=step)
        self.made = step
        self.floor, self.past = (epoch, step), {}

    # -- the trainer's side --------------------------------------------------------------------------
    def connect(
        self,
        client: Hashable,
        epoch: int,
        start_step: int,
        credits: int,
        now: float,
        member: int = 0,
        group_size: int = 1,
    ) -> Connect:
        """A trainer (member `member` of a group of `group_size` processes sharing this rank's batches)
        opens a stream for `epoch` at `start_step` with `credits`."""
        check_int("start_step", start_step, lo=0)
        check_int("group_size", group_size, lo=1)
        check_int("member", member, lo=0, hi=group_size - 1)
        if self.group_size is not None and group_size != self.group_size:
            return Connect(
                REFUSED,
                f"rank {self.rank}'s trainers form a group of {self.group_size} process(es), "
                f"but this trainer says its group has {group_size}",
            )
        if self.awaiting:
            if self.resume_request is None:
                self.resume_request = (epoch, start_step)
            return Connect(WAIT, f"rank {self.rank} waits for the coordinator to resume the resized job")
        m = self.members[member] if self.group_size is not None or member == 0 else None
        if epoch == self.epoch + 1 < self.epochs and (self.end_sent or (m is not None and m.end_sent)):
            return Connect(WAIT, f"rank {self.rank} starts epoch {epoch} next")
        steps_before = self._steps_of(epoch)
        if epoch < self.epoch and steps_before is not None and start_step >= steps_before:
            return Connect(END)  # it took every step of that epoch but lost the end
        if epoch < self.epoch and epoch in self.past and (epoch, start_step) >= self.floor:
            if m is not None and m.holder is not None and m.holder != client:
                return self._busy(m, member, group_size)
            return self._attach(client, epoch, start_step, credits, member, group_size)
        if epoch < self.epoch and (epoch, start_step) < self.floor:
            return self._before_floor(epoch, start_step)
        if epoch != self.epoch:
            if epoch >= self.epochs:
                why = f"the job runs {self.epochs} epoch(s), 0..{self.epochs - 1}"
            else:
                why = f"rank {self.rank} is in epoch {self.epoch}" + (
                    " and its trainer has not taken that epoch's last step" if epoch == self.epoch + 1 else ""
                )
            return Connect(REFUSED, f"the trainer asked for epoch {epoch}, but {why}")
        if m is not None and m.holder is not None and m.holder != client:
            return self._busy(m, member, group_size)
        if (epoch, start_step) < self.floor:
            return self._before_floor(epoch, start_step)
        if start_step > self.made:
            return Connect(
                REFUSED,
                f"the trainer resumes rank {self.rank} at step {start_step} of epoch {epoch}, "
                f"but this rank made {self.made} step(s) so far",
            )
        return self._attach(client, epoch, start_step, credits, member, group_size)

    def _before_floor(self, epoch: int, start_step: int) -> Connect:
        fe, fs = self.floor
        return Connect(
            REFUSED,
            f"the trainer resumes rank {self.rank} at step {start_step} of epoch {epoch}, but this rank "
            f"holds steps only from epoch {fe} step {fs} on (it is at step {self.acked} of epoch "
            f"{self.epoch}; the steps before the trainer's second-last checkpoint, or past the service's "
            "retention budget, were freed): resume from a later checkpoint",
        )

    def _busy(self, m: _Member, member: int, group_size: int) -> Connect:
        whose = f"rank {self.rank}'s" + (f" group member {member}'s" if group_size > 1 else "")
        return Connect(
            REFUSED,
            f"{whose} batches already stream to trainer {m.holder}; a rank serves one "
            f"trainer" + (" per group member" if group_size > 1 else ""),
        )

    def _attach(
        self, client: Hashable, epoch: int, start_step: int, credits: int, member: int, group_size: int
    ) -> Connect:
        """Attaches member `member` at (epoch, start_step), a position the checks of `connect` allowed: in
        this epoch, or replaying one before it (`past`). A start before what the member consumed is a
        rewind: what it consumed after it is sent again, and its checkpoints after it are dropped."""
        if self.group_size is None:
            self.group_size = group_size
            if group_size > 1:
                old = self.members[0]
                self.members = [old] + [
                    _Member(old.unattended_since, self.acked) for _ in range(group_size - 1)
                ]
        m = self.members[member]
        m.holder, m.credits = client, max(int(credits), 1)
        m.gone_since = None
        at = (epoch, start_step)
        # where a trainer first starts is a checkpoint (its loaded one, or the job's start)
        m.points = [p for p in m.points if p <= at] if m.points else [at]
        if epoch < self.epoch:  # replaying an epoch before this one; this one is sent again after it
            m.replay = [epoch, start_step, start_step]
            m.cursor = m.acked = 0
            m.end_sent = False
            return Connect(ATTACHED)
        m.replay = None
        if start_step < m.acked:  # a rewind (a member that took the end consumed every step)
            m.acked, m.end_sent = start_step, False
        m.cursor = start_step
        self._ack(m, start_step)
        return Connect(ATTACHED)

    def disconnect(self, client: Hashable, now: float) -> None:
        """A member's stream ended (any reason); streams that hold nothing are ignored."""
        m = self._member(client)
        if m is None:
            return
        m.holder = None
        m.replay = None  # a replay goes on where the trainer says when it connects again
        m.unattended_since = now
        if not m.end_sent:
            m.gone_since = now

    def ack(self, client: Hashable, step: int) -> None:
        """The member streaming to `client` consumed every step < `step`; a step is freed once every
        member of the group consumed it."""
        m = self._member(client)
        if m is not None and m.replay is not None:
            m.replay[2] = max(m.replay[2], min(step, self.past[m.replay[0]]))
        elif m is not None:
            self._ack(m, step)

    def _ack(self, m: _Member, step: int) -> None:
        m.acked = max(m.acked, min(step, self.made))  # nobody consumed more than was made
        acked = min(x.acked for x in self.members)
        if acked > self.acked:
            self.acked = acked
            self.ready = [s for s in self.ready if s >= acked]

    def next_for(self, client: Hashable) -> int | str | None:
        """What to send `client` now: a step number, SEND_END, or None (wait for a change)."""
        m = self._member(client)
        if m is None:
            return None
        if m.replay is not None:
            _, cursor, acked = m.replay
            made = self.past[m.replay[0]]
            if cursor < made:
                return cursor if cursor - acked < m.credits else None
            return SEND_END if acked >= made else None
        if m.cursor < self.made:
            return m.cursor if m.cursor - m.acked < m.credits else None
        if self.done and self.acked >= self.made and m.acked >= self.made:
            return SEND_END
        return None

    def epoch_of(self, client: Hashable) -> int:
        """The epoch whose steps `client` is sent: this one, or the one it replays."""
        m = self._member(client)
        return m.replay[0] if m is not None and m.replay is not None else self.epoch

    def sent(self, client: Hashable, step: int) -> None:
        m = self._member(client)
        if m is not None and m.replay is not None:
            if step == m.replay[1]:
                m.replay[1] += 1
        elif m is not None and step == m.cursor:
            m.cursor += 1

    def mark_end_sent(self, client: Hashable) -> None:
        """The end of the epoch is about to be written to `client` (journal it first)."""
        m = self._member(client)
        if m is None or self.next_for(client) != SEND_END:
            raise ValueError(f"rank {self.rank}: the end of epoch {self.epoch} is not due")
        if m.replay is not None:  # the end of a replayed epoch: it asks for the next one again
            m.replay = None
        else:
            m.end_sent = True

    # -- checkpoints and the floor ---------------------------------------------------------------------
    def checkpoint(self, client: Hashable, epoch: int, step: int, durable: bool = False) -> None:
        """The member streaming to `client` took a checkpoint at (epoch, step) (`BatchClient.state_dict`);
        `durable`: its save completed. Moves the floor (see module docstring)."""
        check_int("epoch", epoch, lo=0)
        check_int("step", step, lo=0)
        m = self._member(client)
        if m is None:
            return
        at = (epoch, step)
        m.points = [at] if durable else [p for p in m.points if p < at][-1:] + [at]
        self._refloor()

    def drop_until(self, epoch: int, step: int) -> None:
        """Raises the floor to (epoch, step), or to the lowest position a connected member still has to
        consume, whichever is earlier: earlier steps are no longer held (a memory budget)."""
        self.floor = max(self.floor, min((epoch, step), *(self._position(m) for m in self.members)))
        self._normalize_floor()

    def _position(self, m: _Member) -> Point:
        """The first step member `m` has not consumed."""
        return (m.replay[0], m.replay[2]) if m.replay is not None else (self.epoch, m.acked)

    def _refloor(self) -> None:
        lows = [m.points[0] for m in self.members if m.points]
        if len(lows) == len(self.members):
            self.floor = max(self.floor, min(lows))
            self._normalize_floor()

    def _normalize_floor(self) -> None:
        """An epoch's end as floor is the next epoch's start. Epochs before the floor's hold no step but
        keep their step counts in `past`: a trainer restarting at such an epoch's end (or in an epoch
        with no steps) is told it ended, not refused."""
        epoch, step = self.floor
        while epoch < self.epoch and step >= (self._steps_of(epoch) or 0):
            epoch, step = epoch + 1, 0
        self.floor = (epoch, step)

    def _steps_of(self, epoch: int) -> int | None:
        """Steps made in an epoch before this one, when known (held, or the one just before)."""
        return self.past.get(epoch, self.prev_epoch_steps if epoch + 1 == self.epoch else None)

    def held_from(self, epoch: int) -> int | None:
        """The first step of `epoch` still held (consumed steps the floor keeps, then the ready ones), or
        None when none of it is held."""
        if epoch == self.epoch:
            return (
                min(self.acked, self.floor[1])
                if self.floor[0] == epoch
                else (0 if self.floor[0] < epoch else self.acked)
            )
        if epoch not in self.past or epoch < self.floor[0]:
            return None
        return self.floor[1] if self.floor[0] == epoch else 0

    # -- liveness ------------------------------------------------------------------------------------
    def check(self, now: float) -> str | None:
        """The failure at `now`, naming this rank (and the group member), or None."""
        if self.finished:
            return None
        waiting = bool(self.ready) or (self.done and not self.end_sent)
        for k, m in enumerate(self.members):
            if m.holder is not None or m.end_sent:
                continue
            if m.gone_since is not None and now - m.gone_since > self.grace_s:
                return f"{self._who(k)} disconnected and did not reconnect within {self.grace_s:g}s"
            if waiting and now - m.unattended_since > self.trainer_timeout_s:
                who = (
                    f"rank {self.rank}'s service"
                    if len(self.members) == 1
                    else f"rank {self.rank}'s service as group member {k} of {len(self.members)}"
                )
                return (
                    f"no trainer connected to {who} for {self.trainer_timeout_s:g}s "
                    "while its batches were ready"
                )
        return None

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            K_EPOCH: self.epoch,
            K_READY: list(self.ready),
            K_MADE: self.made,
            K_ACKED: self.acked,
            K_DONE: self.done,
            K_END_SENT: self.end_sent,
            K_PREV: self.prev_epoch_steps,
            K_GROUP: self.group_size,
            K_ENDS: [k for k, m in enumerate(self.members) if m.end_sent],
            K_FLOOR: list(self.floor),
            K_PAST: {str(q): n for q, n in self.past.items()},
            K_POINTS: [[list(p) for p in m.points] for m in self.members],
        }

    def load_state_dict(self, state: Mapping[str, Any], now: float) -> None:
        """Restores a `state_dict()`; nobody is connected afterwards, and every member resumes from the
        steps all of them consumed."""
        check_int("epoch", state[K_EPOCH], lo=0, hi=self.epochs - 1)
        group = state.get(K_GROUP)
        if group is not None:
            check_int("group_size", group, lo=1)
        self.group_size = group
        self._reset(state[K_EPOCH], now, acked=state[K_ACKED])
        self.ready, self.made = list(state[K_READY]), state[K_MADE]
        self.done, self.prev_epoch_steps = state[K_DONE], state[K_PREV]
        for k in state.get(K_ENDS, range(len(self.members)) if state[K_END_SENT] else ()):
            self.members[k].end_sent = True
        floor = state.get(K_FLOOR, [self.epoch, self.acked])  # a state from before rewinds: what was held
        self.floor = (int(floor[0]), int(floor[1]))
        self.past = {int(q): int(n) for q, n in state.get(K_PAST, {}).items()}
        for m, points in zip(self.members, state.get(K_POINTS, []), strict=False):
            m.points = [(int(e), int(s)) for e, s in points]
