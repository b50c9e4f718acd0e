"""The coordinator's view of the job's parties: who registered, who is alive, who finished, when it ends.

A pure state machine: every call takes `now` (seconds on a monotonic clock), nothing sleeps or reads
a clock, so the daemon drives it with `time.monotonic()` and the tests with a hand-moved clock.

Contract (timeouts judge liveness, never speed):
- start-up: every rank must register within `startup_timeout_s` of the coordinator's start (parties
  start in any order; torchrun's rendezvous waits minutes too). `waiting(now)` names whom it waits for.
- lease: a registered rank that is not finished must be heard from (any call, or a heartbeat) at
  least every `lease_s`. A rank that is slow at anything (a long round, a trainer taking minutes per
  step) still heartbeats, so only a rank that is gone misses its lease.
- finish: a rank finishes once its trainer acknowledged the last step of the last epoch; a finished
  rank stops heartbeating and is no longer watched. The job ends when every rank finished: until then
  the coordinator stays, whatever the trainers' step times.
- restore: after a coordinator restart every registered, unfinished rank gets a fresh lease (the
  restarted coordinator has not heard from anyone yet), and the start-up window starts again for
  ranks that had not registered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ._state import K_FINISHED, K_REGISTERED
from ._types import check_int


class Liveness:
    """Registration, leases and the end of a job of `world_size` ranks (see module docstring)."""

    def __init__(self, world_size: int, lease_s: float, startup_timeout_s: float, now: float) -> None:
        check_int("world_size", world_size, lo=1)
        if not lease_s > 0 or not startup_timeout_s > 0:
            raise ValueError(f"timeouts must be > 0, got {lease_s=} {startup_timeout_s=}")
        self.world_size, self.lease_s, self.startup_timeout_s = world_size, lease_s, startup_timeout_s
        self.started = now
        self.last_seen: dict[int, float] = {}
        self.finished: set[int] = set()
        self.labels: dict[int, str] = {}  # what a failure says after "rank r" (a node agent serving it)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {rank=}")

    # -- events --------------------------------------------------------------------------------------
    def register(self, rank: int, now: float) -> None:
        """`rank` registered (again: a restarted rank service registers anew)."""
        self._check_rank(rank)
        self.last_seen[rank] = now

    def seen(self, rank: int, now: float) -> None:
        """Any call or heartbeat from `rank`."""
        self._check_rank(rank)
        if rank in self.last_seen:
            self.last_seen[rank] = max(self.last_seen[rank], now)

    def finish(self, rank: int, now: float) -> None:
        """`rank`'s trainer took the job's last step; the rank stops heartbeating."""
        self._check_rank(rank)
        self.last_seen.setdefault(rank, now)
        self.finished.add(rank)

    def restore(self, registered: Iterable[int], finished: Iterable[int], now: float) -> None:
        """After a restart: the ranks of a journal, each unfinished one with a fresh lease."""
        self.started = now
        self.last_seen = {}
        for r in registered:
            self.register(r, now)
        for r in finished:
            self.finish(r, now)

    def label(self, rank: int, text: str) -> None:
        """Failures that name `rank` add `text` (e.g. "node agent gpu-1 at 10.0.0.2:7100, ranks 4-7")."""
        self._check_rank(rank)
        self.labels[rank] = text

    def _name(self, rank: int) -> str:
        return f"rank {rank} ({self.labels[rank]})" if rank in self.labels else f"rank {rank}"

    # -- queries -------------------------------------------------------------------------------------
    @property
    def registered(self) -> list[int]:
        return sorted(self.last_seen)

    @property
    def all_registered(self) -> bool:
        return len(self.last_seen) == self.world_size

    @property
    def all_finished(self) -> bool:
        return len(self.finished) == self.world_size

    def unregistered(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.last_seen]

    def check(self, now: float) -> str | None:
        """The failure at `now`, naming the party, or None while every party is alive."""
        missing = self.unregistered()
        if missing and now - self.started > self.startup_timeout_s:
            return (
                f"rank(s) {missing} did not register within the start-up timeout "
                f"({self.startup_timeout_s:g}s)"
            )
        for rank, seen in sorted(self.last_seen.items()):
            if rank not in self.finished and now - seen > self.lease_s:
                silent = now - seen
                return (
                    f"{self._name(rank)} missed its lease: silent for {silent:.1f}s (lease {self.lease_s:g}s)"
                )
        return None

    def waiting(self, now: float) -> str | None:
        """A log line naming the parties the job waits for to start, or None once all registered."""
        missing = self.unregistered()
        if not missing:
            return None
        left = self.startup_timeout_s - (now - self.started)
        return (
            f"waiting for rank(s) {missing} to register ({now - self.started:.0f}s so far, "
            f"{max(left, 0):.0f}s left of the start-up timeout)"
        )

    def state_dict(self) -> dict[str, Any]:
        return {K_REGISTERED: self.registered, K_FINISHED: sorted(self.finished)}

    def load_state_dict(self, state: Mapping[str, Any], now: float) -> None:
        self.restore(state[K_REGISTERED], state[K_FINISHED], now)
