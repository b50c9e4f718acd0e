"""Resizing a job mid-epoch: the epoch's remainder, dealt to another number of ranks.

A job that ran at W ranks and whose trainers checkpointed at step S of epoch e (the model is the same on
every data-parallel rank, so S is the job's, not a rank's) goes on at W' ranks: the samples that no
step before S held are trained exactly once by the new ranks, none of the steps before S is repeated,
the new ranks run equal steps from S on, and later epochs are dealt at W' as usual.

- Which ids: the coordinator's `StepLedger` holds every step's ids; those of steps 0 .. S-1 are
  `consumed`. Steps at or after S (planned, maybe even trained after the checkpoint) are forgotten:
  their ids are dealt again. A sample that was buffered, in preprocessing or quarantined is not
  consumed either: the new views read it again.
- Where: S must end an optimizer update (with `tokens_per_update` / `samples_per_update`; every step
  does without), so no accumulated gradient is lost; it must not lie past the ledger's last step.
  `resume_point` checks both, naming the update and its last step, and replays the update windows
  and the emitted count over the totals of steps < S, so updates go on counting where they stood.
- How it is dealt (`Remainder`): the new views are the epoch's views at W' over the ids not
  consumed: `ViewSource` keeps the epoch's permutation minus the consumed ids, split r::W';
  `BlockView` deals the units with rows left (fresh order, seeded with the resize's `generation`)
  to W' ranks by their remaining rows and cuts windows as usual, so a rank reads only its units'
  blocks and memory stays within its window budget. In non-join mode a view that runs out wraps over
  its remainder (over the whole epoch when nothing is left); the quota counts on from the samples
  emitted before S.
- Generations: each resize of an epoch gets the next generation number (1, 2, ...); it seeds the new
  deal and is part of the views' state, so a view state saved before a resize is refused after it.

All of it is pure; the simulator (`batchd simulate --resize`) and the daemon run the same functions.
"""

from __future__ import annotations

import base64
import dataclasses
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._ledger import StepLedger
from ._types import check_int
from ._updates import UpdateWindows


@dataclasses.dataclass(frozen=True)
class Remainder:
    """What is left of epoch `epoch` after a resize at step `step` to `world_size` ranks (module docstring).

    Attributes:
        epoch: The epoch resized.
        step: S, the first step at the new world size.
        world_size: W', the new number of ranks (>= 1).
        generation: The resize's number within the epoch (>= 1).
        consumed: The ids held by the steps before S (a frozenset; give any iterable of ints).
    """

    epoch: int
    step: int
    world_size: int
    generation: int
    consumed: frozenset[int]

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch, lo=0)
        check_int("step", self.step, lo=0)
        check_int("world_size", self.world_size, lo=1)
        check_int("generation", self.generation, lo=1)
        consumed = frozenset(int(i) for i in self.consumed)
        if any(i < 0 for i in consumed):
            raise ValueError(f"consumed ids must be >= 0, got {min(consumed)=}")
        object.__setattr__(self, "consumed", consumed)

    @property
    def salt(self) -> int:
        """A number that names this remainder in the seeds of its deal (epoch, step, generation)."""
        return zlib.crc32(f"resize:{self.epoch}:{self.step}:{self.generation}".encode())

    def mask(self, num_samples: int) -> np.ndarray:
        """A bool array over ids 0 .. num_samples - 1: True where the id is left (not consumed). Raises
        ValueError on a consumed id outside the dataset (a resize of another dataset)."""
        keep = np.ones(num_samples, dtype=bool)
        if self.consumed:
            ids = np.fromiter(self.consumed, dtype=np.int64, count=len(self.consumed))
            if int(ids.max()) >= num_samples:
                raise ValueError(
                    f"the resize's consumed ids reach {int(ids.max())}, outside this dataset of "
                    f"{num_samples} samples: the job resumed with another dataset"
                )
            keep[ids] = False
        return keep

    def to_json(self) -> dict[str, Any]:
        """JSON-safe; the consumed ids as a zlib-compressed bitmap (base64)."""
        size = max(self.consumed, default=-1) + 1
        bits = np.zeros(size, dtype=bool)
        if self.consumed:
            bits[np.fromiter(self.consumed, dtype=np.int64, count=len(self.consumed))] = True
        packed = zlib.compress(np.packbits(bits).tobytes())
        return {
            "epoch": self.epoch,
            "step": self.step,
            "world_size": self.world_size,
            "generation": self.generation,
            "consumed_bits": size,
            "consumed": base64.b64encode(packed).decode(),
        }

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> Remainder:
        size = int(obj["consumed_bits"])
        raw = np.frombuffer(zlib.decompress(base64.b64decode(obj["consumed"])), dtype=np.uint8)
        ids = np.flatnonzero(np.unpackbits(raw)[:size])
        return Remainder(
            int(obj["epoch"]),
            int(obj["step"]),
            int(obj["world_size"]),
            int(obj["generation"]),
            frozenset(ids.tolist()),
        )


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where the epoch's counters stood at step S: the update windows' state, the samples emitted."""

    step: int
    windows: dict[str, Any]
    emitted: int


def resume_point(ledger: StepLedger, step: int, windows: UpdateWindows) -> ResumePoint:
    """Replays `windows` (a fresh epoch's `UpdateWindows`, as the job counts updates) over the totals of
    the ledger's steps before `step`, and checks that `step` may be resumed at.

    Raises:
        ValueError: `step` past the ledger's last step (the coordinator never committed it), or inside
            an optimizer update (naming the update, its first step and the step that ends it).
    """
    check_int("step", step, lo=0)
    if step > ledger.steps:
        raise ValueError(
            f"cannot resume epoch {ledger.epoch} at step {step}: the coordinator committed only "
            f"{ledger.steps} step(s) of it (steps 0..{ledger.steps - 1})"
        )
    samples, loss = ledger.totals(step)
    windows.close(samples, loss, False)
    if windows.open_steps:
        first = step - windows.open_steps
        after, after_loss = ledger.totals(ledger.steps)
        probe = UpdateWindows(windows.per_update, windows.unit, windows.rule)
        probe.close(samples[:first], loss[:first], False)
        ends = probe.close(after[first:], after_loss[first:], False).ends
        end = next((first + j for j, e in enumerate(ends) if e), None)
        where = f"it ends at step {end}" if end is not None else "its end was not committed"
        raise ValueError(
            f"cannot resume epoch {ledger.epoch} at step {step}: it lies inside optimizer update "
            f"{windows.updates} (steps {first}..; {where}); resume from a checkpoint taken at an "
            f"update's end (StepInfo.update_end)"
        )
    return ResumePoint(step, windows.state_dict(), sum(samples))


def remaining_order(order: Iterable[int], remainder: Remainder, num_samples: int) -> list[int]:
    """`order` (the epoch's permutation of ids) without the consumed ids, in the same order."""
    keep = remainder.mask(num_samples)
    return [int(i) for i in order if keep[int(i)]]


def check_remainder(remainder: Remainder | None, epoch: int, world_size: int) -> None:
    """Raises ValueError when a view of `epoch` at `world_size` is given another epoch's or world size's
    remainder."""
    if remainder is not None and (remainder.epoch != epoch or remainder.world_size != world_size):
        raise ValueError(
            f"a view of epoch {epoch} at world_size {world_size} cannot read the remainder of a resize "
            f"of epoch {remainder.epoch} to world_size {remainder.world_size}"
        )


def resize_key(remainder: Remainder | None) -> list[int] | None:
    """What a view's state records of its remainder: [generation, step], or None."""
    return None if remainder is None else [remainder.generation, remainder.step]
