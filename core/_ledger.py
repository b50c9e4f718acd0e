"""The step ledger: which sample ids every step of one epoch held, all ranks together.

The coordinator is the one party that sees every rank's commit, so it keeps the ledger, one round at a
time (`Coordinator.commit`): per step, the ids its ranks kept (after a non-join quota cut; an IDLE or
closing step holds none) and the step's global samples and loss tokens. A resize
(`batchd.core._resize`) reads from it which ids the steps before the resume step S held, and replays
the update windows over the totals of those steps. The daemon journals each round's rows and rebuilds
the ledger from them after a restart (`rows` / `add`).

Memory: one int64 per sample and two per step (`array`), about 8 MB for an epoch of a million samples.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ._state import (
    K_EPOCH,
    K_LEDGER_ENDS,
    K_LEDGER_IDS,
    K_LEDGER_LOSS,
    K_VERSION,
    STATE_VERSION,
    check_state,
)
from ._types import check_int


class StepLedger:
    """The ids and totals of the steps of epoch `epoch`, in step order (module docstring)."""

    def __init__(self, epoch: int = 0) -> None:
        check_int("epoch", epoch, lo=0)
        self.epoch = epoch
        self._ids = array("q")
        self._ends = array("q")  # per step: len(_ids) after its ids
        self._loss = array("q")  # per step: its global loss tokens

    @property
    def steps(self) -> int:
        """Steps recorded (step numbers 0 .. steps - 1)."""
        return len(self._ends)

    def add(self, rows: Sequence[Sequence[int]], loss_tokens: Sequence[int]) -> None:
        """Appends one round's steps: `rows[j]` the ids step j held on every rank, `loss_tokens[j]` its
        global loss tokens. Raises ValueError on rows and totals of different lengths."""
        if len(rows) != len(loss_tokens):
            raise ValueError(f"one loss-token total per row, got {len(rows)=} {len(loss_tokens)=}")
        for row, loss in zip(rows, loss_tokens, strict=True):
            self._ids.extend(int(i) for i in row)
            self._ends.append(len(self._ids))
            self._loss.append(int(loss))

    def truncate(self, steps: int) -> None:
        """Forgets the steps from `steps` on (a resize resumes there; those steps are dealt again)."""
        check_int("steps", steps, lo=0, hi=self.steps)
        keep = self._ends[steps - 1] if steps else 0
        del self._ids[keep:], self._ends[steps:], self._loss[steps:]

    def row(self, step: int) -> list[int]:
        """The ids step `step` held."""
        check_int("step", step, lo=0, hi=self.steps - 1)
        start = self._ends[step - 1] if step else 0
        return self._ids[start : self._ends[step]].tolist()

    def rows(self, first: int, last: int) -> list[list[int]]:
        """The ids of steps first .. last - 1, one list per step."""
        return [self.row(s) for s in range(first, last)]

    def consumed(self, before: int) -> frozenset[int]:
        """The ids held by steps 0 .. before - 1."""
        check_int("before", before, lo=0, hi=self.steps)
        end = self._ends[before - 1] if before else 0
        return frozenset(self._ids[:end].tolist())

    def totals(self, before: int) -> tuple[list[int], list[int]]:
        """(samples, loss tokens) of each of the steps 0 .. before - 1."""
        check_int("before", before, lo=0, hi=self.steps)
        samples = [self._ends[s] - (self._ends[s - 1] if s else 0) for s in range(before)]
        return samples, self._loss[:before].tolist()

    def loss_tokens(self, first: int, last: int) -> list[int]:
        """The global loss tokens of steps first .. last - 1."""
        return self._loss[first:last].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.rows(0, self.steps))

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: the epoch, every id, each step's end offset and loss tokens (large: the daemon
        journals rows per round instead)."""
        return {
            K_VERSION: STATE_VERSION,
            K_EPOCH: self.epoch,
            K_LEDGER_IDS: self._ids.tolist(),
            K_LEDGER_ENDS: self._ends.tolist(),
            K_LEDGER_LOSS: self._loss.tolist(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a `state_dict()` of the same epoch (ValueError naming both epochs otherwise)."""
        check_state(state, {K_EPOCH: self.epoch}, "StepLedger")
        ids, ends, loss = state[K_LEDGER_IDS], state[K_LEDGER_ENDS], state[K_LEDGER_LOSS]
        if len(ends) != len(loss) or (ends and ends[-1] != len(ids)):
            raise ValueError(f"StepLedger state is inconsistent: {len(ids)=} {len(ends)=} {len(loss)=}")
        self._ids, self._ends, self._loss = array("q", ids), array("q", ends), array("q", loss)
