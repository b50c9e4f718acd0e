"""Per-rank sampler views over a dataset stored in blocks: block shuffle, then a window shuffle.

A dataset too large for memory is read by blocks (Parquet row groups, Arrow record batches, runs of
JSONL lines): reading row by row in a global permutation would read a whole block for every sample.
`BlockView` is the seeded, exact, resumable order a rank reads its share in, the scheme MosaicML
Streaming and Ray Data use (block shuffle plus a bounded shuffle buffer), made deterministic:

1. Units. Block k holds ids [offset_k, offset_k + rows_k). Blocks larger than
   ceil(total / (UNITS_PER_RANK * N)) rows are cut into units of that many rows, so a small dataset (one
   row group, say) still gives every rank a share. A rank reading one unit of a block reads the block.
2. Epoch e permutes the units with a generator seeded by (seed, e) (no permutation without shuffle) and
   deals them in that order, each to the rank holding the fewest rows so far (ties: the lowest rank):
   views differ by at most one unit's rows, and the protocol, not the sampler, equalizes steps.
3. Windows. A rank cuts its unit sequence into windows: maximal runs whose distinct blocks' bytes sum to
   at most `window_bytes` (at least one unit). Within a window the rows are permuted with a generator
   seeded by (seed, e, rank, window, pass). A reader holds the window being read and the next one.

With `window_bytes` over the dataset's size a rank's view is one window: a uniform permutation of its
rows. With smaller windows, rows of one block stay within one window (how far that is from a global
permutation is measured in docs/benchmarks.md, "streaming"). Every id is in exactly one rank's view.
In non-join mode (`wrap=True`) a view that runs out starts another pass with fresh window permutations.

The state is (rank, world size, seed, epoch, samples, layout fingerprint, position, pass): loading a
state of another dataset layout, budget or job raises ValueError naming the field.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._resize import Remainder, check_remainder, resize_key
from ._state import (
    K_EPOCH,
    K_LAYOUT,
    K_NUM,
    K_PASS,
    K_POS,
    K_RANK,
    K_RESIZE,
    K_SEED,
    K_VERSION,
    K_WORLD,
    STATE_VERSION,
    check_state,
)
from ._types import check_int

UNITS_PER_RANK = 8


def split_units(
    block_rows: Sequence[int] | np.ndarray, world_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unit first id, unit rows, unit's block) for blocks of `block_rows` rows in id order (step 1)."""
    rows = np.asarray(block_rows, dtype=np.int64)
    total = int(rows.sum())
    cap = max(1, -(-total // (UNITS_PER_RANK * world_size)))
    starts, sizes, owner = [], [], []
    first = 0
    for k, n in enumerate(rows.tolist()):
        for s in range(0, n, cap):
            starts.append(first + s)
            sizes.append(min(cap, n - s))
            owner.append(k)
        first += n
    unit_start, unit_rows, unit_block = (np.asarray(x, dtype=np.int64) for x in (starts, sizes, owner))
    return unit_start, unit_rows, unit_block


def deal_units(unit_rows: np.ndarray, world_size: int, order: np.ndarray) -> list[list[int]]:
    """Units in `order`, each dealt to the rank with the fewest rows so far (ties: lowest rank) (step 2)."""
    heap = [(0, r) for r in range(world_size)]  # (rows so far, rank): the least loaded, lowest rank first
    out: list[list[int]] = [[] for _ in range(world_size)]
    for u in order.tolist():
        load, r = heapq.heappop(heap)
        out[r].append(u)
        heapq.heappush(heap, (load + int(unit_rows[u]), r))
    return out


def cut_windows(
    units: Sequence[int], unit_block: np.ndarray, block_bytes: np.ndarray, window_bytes: int
) -> list[list[int]]:
    """Maximal runs of `units` whose distinct blocks' bytes sum to at most `window_bytes` (step 3)."""
    windows: list[list[int]] = []
    cur: list[int] = []
    held: set[int] = set()
    size = 0
    for u in units:
        b = int(unit_block[u])
        extra = 0 if b in held else int(block_bytes[b])
        if cur and size + extra > window_bytes:
            windows.append(cur)
            cur, held, size = [], set(), 0
            extra = int(block_bytes[b])
        cur.append(u)
        if b not in held:
            held.add(b)
            size += extra
    if cur:
        windows.append(cur)
    return windows


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """How a dataset is stored and read: `block_rows[k]` rows and `block_bytes[k]` bytes a reader holds for
    block k (in id order: block k's ids follow block k-1's; stored as int64 arrays), and `window_bytes`, a
    window's budget (module docstring; None: one window per view). Its fingerprint is part of a
    `BlockView`'s state.

    Raises:
        ValueError: naming the field, on mismatched lengths, negative sizes or a window budget < 1.
    """

    block_rows: Sequence[int] | np.ndarray
    block_bytes: Sequence[int] | np.ndarray
    window_bytes: int | None = None

    def __post_init__(self) -> None:
        block_rows, block_bytes = self.block_rows, self.block_bytes
        if len(block_rows) != len(block_bytes):
            raise ValueError(
                f"block_rows and block_bytes must have one entry per block, got "
                f"{len(block_rows)=} {len(block_bytes)=}"
            )
        rows, nbytes = np.asarray(block_rows, dtype=np.int64), np.asarray(block_bytes, dtype=np.int64)
        if (rows < 0).any() or (nbytes < 0).any():
            raise ValueError(f"block_rows and block_bytes must be >= 0, got {block_rows=} {block_bytes=}")
        if self.window_bytes is not None:
            check_int("window_bytes", self.window_bytes, lo=1)
        object.__setattr__(self, "block_rows", rows)
        object.__setattr__(self, "block_bytes", nbytes)


class BlockView:
    """Rank `rank`'s stream of sample ids for one epoch of a block-stored dataset (module docstring).

    Args:
        layout: The dataset's blocks and the window budget (`BlockLayout`).
        rank, world_size, seed, epoch, shuffle, wrap: As in `ViewSource`.
        remainder: After a resize of this epoch (`batchd.core.Remainder`, its `world_size` this one's):
            the units are dealt by the rows they have left, in an order seeded by the resize too, and a
            window holds only those rows; None: the whole epoch.

    Raises:
        ValueError: naming the argument, on a bad rank, world size or remainder.
    """

    def __init__(
        self,
        layout: BlockLayout,
        rank: int,
        world_size: int,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        wrap: bool = False,
        remainder: Remainder | None = None,
    ) -> None:
        if not isinstance(layout, BlockLayout):
            raise ValueError(f"layout must be a BlockLayout, got {layout=!r}")
        check_int("world_size", world_size, lo=1)
        check_int("rank", rank, lo=0, hi=world_size - 1)
        check_remainder(remainder, epoch, world_size)
        self.blocks = layout
        self.block_rows = np.asarray(layout.block_rows, dtype=np.int64)
        self.block_bytes = np.asarray(layout.block_bytes, dtype=np.int64)
        window_bytes = layout.window_bytes
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, epoch
        self.shuffle, self.wrap, self.window_bytes = shuffle, wrap, window_bytes
        self.num_samples = int(self.block_rows.sum())
        self.remainder = remainder
        self.unit_start, self.unit_rows, self.unit_block = split_units(self.block_rows, world_size)
        n_units = len(self.unit_rows)
        seeds = [seed, epoch] if remainder is None else [seed, epoch, remainder.salt]
        order = np.random.default_rng(seeds).permutation(n_units) if shuffle else np.arange(n_units)
        self._keep: np.ndarray | None = None
        self.unit_left = self.unit_rows
        if remainder is not None:  # deal the units by the rows they have left
            keep = remainder.mask(self.num_samples)
            if keep.any() or not wrap:  # non-join: nothing left is a new pass over every row
                self._keep = keep
                ends = np.concatenate([[0], np.cumsum(keep, dtype=np.int64)])
                self.unit_left = ends[self.unit_start + self.unit_rows] - ends[self.unit_start]
                order = order[self.unit_left[order] > 0]
        self.units = deal_units(self.unit_left, world_size, order)[rank]
        budget = window_bytes if window_bytes is not None else max(int(self.block_bytes.sum()), 1)
        self.windows = cut_windows(self.units, self.unit_block, self.block_bytes, budget)
        sizes = [int(self.unit_left[w].sum()) for w in self.windows]
        self._ends = np.cumsum(sizes, dtype=np.int64)
        self._len = int(self._ends[-1]) if sizes else 0
        self.layout = zlib.crc32(
            np.asarray(
                [len(self.block_rows), budget, *self.block_rows.tolist(), *self.block_bytes.tolist()],
                dtype=np.int64,
            ).tobytes()
        )
        self.position = 0
        self.passes = 0
        self._cached: tuple[int, int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self._len

    # -- windows ---------------------------------------------------------------------------------------
    def window_ids(self, w: int, p: int = 0) -> np.ndarray:
        """Window `w`'s ids in pass `p`'s order."""
        if self._cached is not None and self._cached[:2] == (w, p):
            return self._cached[2]
        ids = (
            np.concatenate(
                [
                    np.arange(self.unit_start[u], self.unit_start[u] + self.unit_rows[u])
                    for u in self.windows[w]
                ]
            )
            if self.windows[w]
            else np.zeros(0, np.int64)
        )
        seeds = [self.seed, self.epoch, self.rank, w, p]
        if self._keep is not None and self.remainder is not None:
            ids = ids[self._keep[ids]]
            seeds.append(self.remainder.salt)
        if self.shuffle or p > 0:
            ids = ids[np.random.default_rng(seeds).permutation(len(ids))]
        self._cached = (w, p, ids)
        return ids

    def window_of(self, position: int) -> int:
        """The window holding the view's `position`-th id (of a pass); len(windows) past the end."""
        return int(np.searchsorted(self._ends, position, side="right"))

    def window_blocks(self, w: int) -> list[int]:
        """The blocks window `w` reads, in first-use order ([] past the last window)."""
        if not 0 <= w < len(self.windows):
            return []
        return list(dict.fromkeys(int(self.unit_block[u]) for u in self.windows[w]))

    def _at(self, position: int, p: int) -> int:
        w = self.window_of(position)
        start = int(self._ends[w - 1]) if w > 0 else 0
        return int(self.window_ids(w, p)[position - start])

    # -- the stream ------------------------------------------------------------------------------------
    def exhausted(self) -> bool:
        """True when no id is left (never, with wrap, unless the view is empty)."""
        if self._len == 0:
            return True
        return not self.wrap and self.position >= self._len

    def peek(self) -> int | None:
        """The id `next()` would return, without consuming it."""
        if self.exhausted():
            return None
        if self.position >= self._len:
            return self._at(0, self.passes + 1)
        return self._at(self.position, self.passes)

    def next(self) -> int | None:
        """The next id, or None when the view is exhausted."""
        if self.exhausted():
            return None
        if self.position >= self._len:
            self.passes += 1
            self.position = 0
        i = self._at(self.position, self.passes)
        self.position += 1
        return i

    def ids(self) -> list[int]:
        """Every id of the view's first pass, in order (for tests and reports)."""
        return [int(i) for w in range(len(self.windows)) for i in self.window_ids(w)]

    def for_epoch(self, epoch: int, remainder: Remainder | None = None) -> BlockView:
        """The same rank's view of `epoch`, from its start; with a resize's `remainder` (of `epoch`), the
        ids it left."""
        return BlockView(
            self.blocks, self.rank, self.world_size, self.seed, epoch, self.shuffle, self.wrap, remainder
        )

    def reset(self) -> None:
        """Back to the start of the epoch."""
        self.position, self.passes = 0, 0

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            K_VERSION: STATE_VERSION,
            K_RANK: self.rank,
            K_WORLD: self.world_size,
            K_SEED: self.seed,
            K_EPOCH: self.epoch,
            K_NUM: self.num_samples,
            K_LAYOUT: self.layout,
            K_RESIZE: resize_key(self.remainder),
            K_POS: self.position,
            K_PASS: self.passes,
        }

    def state_at(self, seq: int) -> dict[str, Any]:
        """The `state_dict()` this view has after yielding `seq` ids from its start."""
        passes, position = divmod(seq, self._len) if self.wrap and self._len else (0, seq)
        return {**self.state_dict(), K_POS: position, K_PASS: passes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state(
            state,
            {
                K_RANK: self.rank,
                K_WORLD: self.world_size,
                K_SEED: self.seed,
                K_EPOCH: self.epoch,
                K_NUM: self.num_samples,
                K_LAYOUT: self.layout,
                K_RESIZE: resize_key(self.remainder),
            },
            f"BlockView(rank={self.rank})",
        )
        self.passes, self.position = int(state[K_PASS]), int(state[K_POS])
