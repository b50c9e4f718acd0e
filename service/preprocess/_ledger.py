"""`Ledger`: a `RaySource`'s account of the samples it pulled from its view, and the order they leave in.

Each sample pulled from the view gets the next sequence number (`seq`: its pull position, counting on
across the passes of a wrapping view) and an `Entry` that moves FLIGHT (requested from the pool) ->
READY (its metadata came back) -> DONE (emitted or quarantined). Invariants:

- `low` is the first seq not yet DONE (or `next` when all are); entries below it are dropped, so the
  ledger holds only the span `low .. next - 1`, at most the source's `max_in_flight` open entries plus
  the DONE ones above the first open one.
- `open` counts the entries in FLIGHT or READY (`RaySource.in_flight`).
- Ordered mode emits seq `low` only, once READY (view order); completion-order mode emits the smallest
  READY seq (`ready`, a heap).
- `skip` holds seqs resolved before a resume (`RaySource.load_state_dict`): pulled again, they are DONE
  at once and never requested.

Pure bookkeeping: no Ray, no I/O, no lock (the source's lock covers it). Each operation is O(1), or
O(log n) on the heap, except `peek_id`, `ready_count` and `resolved_ahead`, which scan the span.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

from batchd.core import Sample

FLIGHT, READY, DONE = 0, 1, 2


@dataclasses.dataclass(slots=True)
class Entry:
    """One pulled sample: its id in the dataset, its status, the actor deaths it saw, and (READY) its
    metadata and payload reference."""

    id: int
    status: int
    attempts: int = 0
    sample: Sample | None = None
    payload: Any = None


class Ledger:
    """The pulled samples of one view from seq `low` on (module docstring: statuses and invariants).

    Args:
        low: The first seq (0 for a fresh view; the resume point after `load_state_dict`).
        skip: Seqs at or above `low` already resolved (emitted or quarantined before the resume).
        ordered: Emit in view order (True) or in completion order.
    """

    FLIGHT, READY, DONE = FLIGHT, READY, DONE  # the statuses, for callers of the public `Ledger`

    def __init__(self, low: int, skip: set[int], ordered: bool) -> None:
        self.entries: dict[int, Entry] = {}
        self.ready: list[int] = []  # heap of READY seqs (completion-order mode)
        self.low = self.next = low
        self.skip = skip
        self.open = 0
        self.ordered = ordered

    def add(self, sample_id: int) -> int | None:
        """Takes the view's next id as the next seq: its seq when it is to be requested, None when it
        was resolved before a resume (then DONE at once)."""
        seq = self.next
        self.next += 1
        if seq in self.skip:
            self.skip.discard(seq)
            self.entries[seq] = Entry(sample_id, DONE)
            return None
        self.entries[seq] = Entry(sample_id, FLIGHT)
        self.open += 1
        return seq

    def advance(self) -> None:
        """Drops the DONE entries at the low end."""
        while self.low < self.next and self.entries[self.low].status == DONE:
            del self.entries[self.low]
            self.low += 1

    def resolve(self, seq: int) -> None:
        """Marks `seq` DONE (emitted or quarantined)."""
        self.entries[seq].status = DONE
        self.open -= 1

    def mark_ready(self, seq: int, sample: Sample, payload: Any) -> None:
        """Records `seq`'s metadata and payload reference: it may now be emitted."""
        e = self.entries[seq]
        e.sample = sample
        e.payload = payload
        e.status = READY
        if not self.ordered:
            heapq.heappush(self.ready, seq)

    def next_ready(self) -> int | None:
        """The seq to emit now (removed from the heap in completion-order mode), or None."""
        self.advance()
        if self.ordered:
            if self.low < self.next and self.entries[self.low].status == READY:
                return self.low
            return None
        if self.ready:
            return heapq.heappop(self.ready)
        return None

    def ready_count(self) -> int:
        """Entries READY and not yet emitted."""
        return sum(1 for e in self.entries.values() if e.status == READY)

    def peek_id(self) -> int | None:
        """The id of the next sample to leave (completion order: the smallest READY seq's; view order:
        the first not DONE), or None when every pulled sample is resolved."""
        self.advance()
        if not self.ordered and self.ready:
            return self.entries[self.ready[0]].id
        for seq in range(self.low, self.next):
            if self.entries[seq].status != DONE:
                return self.entries[seq].id
        return None

    def resolved_ahead(self) -> list[int]:
        """Offsets from `low` of the seqs beyond it already resolved, sorted (what a resume skips)."""
        self.advance()
        low = self.low
        return sorted(
            {s - low for s, e in self.entries.items() if e.status == DONE and s > low}
            | {s - low for s in self.skip if s >= low}
        )
