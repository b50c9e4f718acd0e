"""`BlockReader`: the blocks of a `RecordDataset` a rank holds, read ahead by a thread, under a byte budget.

A rank's `RaySource` tells the reader which blocks it wants next (`want`: the blocks of the window it
dispatches from and of the next one, in first-use order) and asks it for records (`items`). A background
thread reads the wanted blocks in order while what it holds stays within `budget` bytes; `want` drops
every block no longer wanted. `items` reads a missing block itself (a random access: a restored journal,
a peer's fetch, a retry) and keeps the last `EXTRA_BLOCKS` such blocks until the next `want`: the budget
may be exceeded by those. The bytes counted are Arrow's (`Table.nbytes`) or the JSONL text's; before a
block is read its size is the metadata's estimate, scaled by the largest actual / estimate ratio seen so
far. A block the thread fails to read is left to `items`, which reads it again and raises.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ._dataset import RecordDataset

log = logging.getLogger("batchd.preprocess")
EXTRA_BLOCKS = 2  # blocks read at random (`items` of blocks not wanted) kept until the next `want`


def _nbytes(data: pa.Table | list[str | bytes]) -> int:
    return int(data.nbytes) if isinstance(data, pa.Table) else sum(len(s) for s in data)


class BlockReader:
    """Blocks of `dataset` held for one reader, read ahead within `budget` bytes (module docstring)."""

    def __init__(self, dataset: RecordDataset, budget: int) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1 byte, got {budget=}")
        self.dataset, self.budget = dataset, int(budget)
        self._held: dict[int, tuple[Any, int]] = {}
        self._extra: dict[int, tuple[Any, int]] = {}  # blocks read at random (not wanted), oldest first
        self._loading: set[int] = set()
        self._wanted: list[int] = []
        self._cond = threading.Condition()
        self._closed = False
        self.reads = 0  # blocks read (a block read again after eviction counts again)
        self.bytes_read = 0
        self.peak_bytes = 0  # the most bytes held at once
        self.error: BaseException | None = None
        self._ratio = 1.0  # the largest bytes read / metadata estimate of a block so far
        self._idle = False  # the read-ahead thread has nothing it may read now
        self._thread = threading.Thread(target=self._prefetch, name="batchd-block-reader", daemon=True)
        self._thread.start()

    @property
    def held_bytes(self) -> int:
        with self._cond:
            return sum(n for _, n in self._held.values())

    def settle(self, timeout: float) -> bool:
        """Waits until the read-ahead thread has read every wanted block it has room for; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self._idle and not self._loading):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def want(self, blocks: Sequence[int]) -> None:
        """The blocks to hold next, in first-use order; others are dropped, missing ones read ahead."""
        with self._cond:
            self._wanted = list(dict.fromkeys(int(b) for b in blocks))
            self._idle = False
            keep = set(self._wanted)
            for b in [b for b in self._held if b not in keep]:
                del self._held[b]
            for b in [b for b in self._extra if b in keep]:  # read at random, now wanted: held
                self._held[b] = self._extra.pop(b)
            self._extra.clear()
            self._cond.notify_all()

    def _room_for(self, b: int) -> bool:
        # A block's size is known from metadata only before it is read (Parquet's uncompressed size runs
        # ~20% under Arrow's count on short text rows): scaled by the largest read / estimate seen so far.
        held = sum(n for _, n in self._held.values())
        return held + self.dataset.blocks[b].nbytes * self._ratio <= self.budget or not self._held

    def _prefetch(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    todo = next(
                        (b for b in self._wanted if b not in self._held and b not in self._loading), None
                    )
                    if todo is not None and self._room_for(todo):
                        break
                    self._idle = True
                    self._cond.notify_all()
                    self._cond.wait()
                self._idle = False
                self._loading.add(todo)
            try:
                self._load(todo)
            except BaseException as exc:  # noqa: BLE001 - reported by the next `items` that needs it
                log.warning("reading block %d failed: %s", todo, exc)
                with self._cond:
                    self._loading.discard(todo)
                    self.error = exc
                    self._wanted = [b for b in self._wanted if b != todo]
                    self._cond.notify_all()

    def _load(self, b: int) -> Any:
        data = self.dataset.read_block(b)
        n = _nbytes(data)
        with self._cond:
            self._loading.discard(b)
            self.reads += 1
            self.bytes_read += n
            self._ratio = max(self._ratio, n / max(self.dataset.blocks[b].nbytes, 1))
            if b in self._wanted:
                self._held[b] = (data, n)
            else:  # a random access: kept with the last few such blocks until the next `want`
                self._extra[b] = (data, n)
                while len(self._extra) > EXTRA_BLOCKS:
                    self._extra.pop(next(iter(self._extra)))
            self.peak_bytes = max(
                self.peak_bytes,
                sum(m for _, m in self._held.values()) + sum(m for _, m in self._extra.values()),
            )
            self._cond.notify_all()
        return data

    def _block(self, b: int) -> Any:
        with self._cond:
            while b in self._loading:
                self._cond.wait()
            if b in self._held:
                return self._held[b][0]
            if b in self._extra:
                return self._extra[b][0]
            self._loading.add(b)
        try:
            return self._load(b)
        except BaseException:
            with self._cond:
                self._loading.discard(b)
                self._cond.notify_all()
            raise

    def items(self, ids: Sequence[int]) -> list[tuple[int, str, str, Any]]:
        """`RecordDataset.items` of `ids` in their order, reading the blocks not held."""
        by_block: dict[int, list[int]] = {}
        for i in ids:
            by_block.setdefault(self.dataset.block_of(int(i)), []).append(int(i))
        out: dict[int, tuple[int, str, str, Any]] = {}
        for b, members in by_block.items():
            for item in self.dataset.items(b, self._block(b), members):
                out[item[0]] = item
        return [out[int(i)] for i in ids]

    def stats(self) -> dict[str, int]:
        with self._cond:
            held = sum(n for _, n in self._held.values())
            return {
                "blocks_read": self.reads,
                "bytes_read": self.bytes_read,
                "held_bytes": held,
                "peak_held_bytes": self.peak_bytes,
                "budget_bytes": self.budget,
            }

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._held.clear()
            self._extra.clear()
            self._cond.notify_all()
