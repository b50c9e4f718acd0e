"""`Limits`: how long a rank service waits for whom, and what it holds for a rewind (`RankServiceCore`);
`adopt_budget`: the token budget a rank plans at when the job lowered it."""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from batchd.core import JobSpec

from ._delivery import RETAIN_BYTES

log = logging.getLogger("batchd.rank")


@dataclasses.dataclass(frozen=True)
class Limits:
    """How long a rank waits: `client_grace_s` for a trainer to come back (and for a failed job's trainers
    to hear why), `trainer_timeout_s` for a trainer that holds a batch and says nothing, `startup_timeout_s`
    for the coordinator to answer; `retain_bytes`: consumed batches held per rank for a rewind to a
    checkpoint; `fill_timeout_s`: how long one fill of the buffer waits for the source's samples before the
    round goes on with what came (a non-deterministic job).

    Raises:
        ValueError: naming the field, on a time <= 0 or `retain_bytes` < 0.
    """

    client_grace_s: float = 600.0
    trainer_timeout_s: float = 1800.0
    startup_timeout_s: float = 600.0
    retain_bytes: int = RETAIN_BYTES
    fill_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("client_grace_s", "trainer_timeout_s", "startup_timeout_s", "fill_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {name}={value}")
        if self.retain_bytes < 0:
            raise ValueError(f"retain_bytes must be >= 0, got retain_bytes={self.retain_bytes}")


class _HasSpec(Protocol):
    rank: int
    spec: JobSpec


def adopt_budget(core: _HasSpec, budget: int, whose: str) -> None:
    """Makes `budget` (0: none said) the token budget `core` plans and reports its steps at: the job's,
    lowered after an out-of-memory step (`batchd.service.coordinator._oom`), as `whose` says it."""
    if budget and budget != core.spec.token_budget:
        log.warning(
            "rank %d: the job's token budget is %d, %s (lowered after an out-of-memory step; configured %d)",
            core.rank,
            budget,
            whose,
            core.spec.token_budget,
        )
        core.spec = dataclasses.replace(core.spec, token_budget=budget)
