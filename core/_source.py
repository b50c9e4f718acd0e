"""Per-rank sampler views: which sample ids a rank's stream yields, in order, with exact resume.

Without shuffle, rank r owns ids r, r+N, r+2N, ... (like `DistributedSampler(shuffle=False)` but
without padding: views differ by at most one sample and the protocol, not the sampler, equalizes
steps). With shuffle, the same split is applied to a permutation seeded by (seed, epoch). In
non-join mode a view that runs out starts another pass in a fresh seeded order (`wrap=True`), so no
rank idles before the epoch's quota closes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._resize import Remainder, check_remainder, resize_key
from ._state import (
    K_EPOCH,
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


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's seeded permutation of range(num_samples) (identical on every host)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


class ViewSource:
    """Rank `rank`'s stream of sample ids for one epoch.

    Args:
        num_samples: Samples in the dataset (ids 0..num_samples-1).
        rank: This rank.
        world_size: N.
        seed: Seeds the permutation.
        epoch: Epoch number.
        shuffle: Permute before splitting.
        wrap: Start a new seeded pass when the view runs out (non-join mode).
        remainder: After a resize of this epoch (`batchd.core.Remainder`, its `world_size` this one's):
            the epoch's permutation without the ids it consumed, split r::N; None: the whole epoch.
    """

    def __init__(
        self,
        num_samples: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = False,
        wrap: bool = False,
        remainder: Remainder | None = None,
    ) -> None:
        check_int("num_samples", num_samples, lo=0)
        check_int("world_size", world_size, lo=1)
        check_int("rank", rank, lo=0, hi=world_size - 1)
        check_remainder(remainder, epoch, world_size)
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.seed, self.epoch, self.shuffle, self.wrap = seed, epoch, shuffle, wrap
        self.remainder = remainder
        base = epoch_permutation(num_samples, seed, epoch) if shuffle else np.arange(num_samples)
        if remainder is not None:
            left = base[remainder.mask(num_samples)[base]]
            base = left if len(left) or not wrap else base  # non-join: nothing left is a new pass
        self._view: list[int] = base[rank::world_size].tolist()
        self._order: list[int] = self._view
        self.position = 0
        self.passes = 0

    def __len__(self) -> int:
        return len(self._view)

    def _pass_order(self, p: int) -> list[int]:
        if p == 0:
            return self._view
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, p])
        return [self._view[i] for i in rng.permutation(len(self._view))]

    def unread(self) -> int | None:
        """Ids of this epoch's view not yet taken (None with wrap: the view never ends)."""
        return None if self.wrap else len(self._view) - self.position

    def exhausted(self) -> bool:
        """True when no id is left (never, with wrap, unless the view is empty)."""
        if not self._view:
            return True
        return not self.wrap and self.position >= len(self._view)

    def peek(self) -> int | None:
        """The id `next()` would return, without consuming it."""
        if self.exhausted():
            return None
        if self.position >= len(self._order):
            return self._pass_order(self.passes + 1)[0]
        return self._order[self.position]

    def next(self) -> int | None:
        """The next id, or None when the view is exhausted."""
        if self.exhausted():
            return None
        if self.position >= len(self._order):
            self.passes += 1
            self.position = 0
            self._order = self._pass_order(self.passes)
        i = self._order[self.position]
        self.position += 1
        return i

    def for_epoch(self, epoch: int, remainder: Remainder | None = None) -> ViewSource:
        """The same rank's view of `epoch` (its own seeded permutation when shuffled), from its start; with
        a resize's `remainder` (of `epoch`), the ids it left."""
        return ViewSource(
            self.num_samples, self.rank, self.world_size, self.seed, epoch, self.shuffle, self.wrap, remainder
        )

    def reset(self) -> None:
        """Back to the start of the epoch."""
        self.position, self.passes, self._order = 0, 0, self._view

    def state_dict(self) -> dict[str, Any]:
        return {
            K_VERSION: STATE_VERSION,
            K_RANK: self.rank,
            K_WORLD: self.world_size,
            K_SEED: self.seed,
            K_EPOCH: self.epoch,
            K_NUM: self.num_samples,
            K_RESIZE: resize_key(self.remainder),
            K_POS: self.position,
            K_PASS: self.passes,
        }

    def state_at(self, seq: int) -> dict[str, Any]:
        """The `state_dict()` this view has after yielding `seq` ids from its start (passes wrap in
        non-join)."""
        n = len(self)
        passes, position = divmod(seq, n) if self.wrap and n else (0, seq)
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
                K_RESIZE: resize_key(self.remainder),
            },
            f"ViewSource(rank={self.rank})",
        )
        self.passes, self.position = state[K_PASS], state[K_POS]
        self._order = self._pass_order(self.passes)
