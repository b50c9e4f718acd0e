"""`RaySource`'s options, grouped at its seams: how it builds its own actor pool (`PoolOptions`) and how it
streams (`StreamOptions`: backpressure, order, the view's wrap, bad records, memory). Frozen dataclasses
that validate in `__post_init__`, naming the bad value; the defaults live here, once."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from batchd.core import parse_bytes

from ._quarantine import BadRecordTally, Quarantine

DEFAULT_MEMORY_BUDGET = 2 << 30
DEFAULT_MAX_BAD_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """How a `RaySource` builds its own `PreprocessPool` (ignored when it is given a shared one).

    stages: The chain (None = `default_stages()`). num_actors: Its actors. ray_address, actor_num_cpus:
    see `PreprocessPool`. node_id: Where its actors run, softly (see `PreprocessPool`): None (default) =
    the node of this process, so a node agent's actors land on its own node; a hex node id = that node;
    "" = anywhere (Ray's placement).
    """

    stages: Sequence[Any] | None = None
    num_actors: int = 2
    ray_address: str | None = None
    actor_num_cpus: float = 1.0
    node_id: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_actors, bool) or self.num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got num_actors={self.num_actors!r}")
        if not self.actor_num_cpus > 0:
            raise ValueError(f"actor_num_cpus must be > 0, got actor_num_cpus={self.actor_num_cpus!r}")


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """How a `RaySource` streams its view.

    max_in_flight: Samples requested but not yet returned by poll (backpressure); None (or 0) = 4 x
        actors x chunk_size.
    chunk_size: Samples per actor task (amortizes Ray's per-task cost: see docs/benchmarks.md).
    ordered: Emit in view order (deterministic; default) or in completion order (no head-of-line wait;
        not with `wrap`).
    wrap: The view wraps around (non-join mode: `batchd.core.BlockView`).
    quarantine: A Quarantine, a JSONL path for one, or None (counts only).
    max_attempts: Actor deaths a sample may see before it is quarantined as `worker_crashed`.
    payload: "ref" (default: an ObjectRef to the payload dict) or "dict" (the dict, fetched).
    memory_budget: Bytes (or a size like "1GiB") bounding what the source holds: blocks are read in
        windows of at most a quarter of it, and at most half of it is held (`_ray_source`).
    max_bad_fraction: The share of bad records read above which `poll` raises `TooManyBadRecords` (0..1;
        1 never fails), of the records of every source sharing `bad_tally`.
    bad_tally: The `BadRecordTally` shared by the sources whose bad records are judged together (a node
        agent's ranks); None: the source's own.
    """

    max_in_flight: int | None = None
    chunk_size: int = 8
    ordered: bool = True
    wrap: bool = False
    quarantine: Quarantine | str | os.PathLike[str] | None = None
    max_attempts: int = 3
    payload: str = "ref"
    memory_budget: int | str = DEFAULT_MEMORY_BUDGET
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION
    bad_tally: BadRecordTally | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.payload not in ("ref", "dict"):
            raise ValueError(f"payload must be 'ref' or 'dict', got payload={self.payload!r}")
        if self.wrap and not self.ordered:
            raise ValueError(
                "wrap=True (non-join mode) needs ordered=True: peek_id must name the next sample, got "
                f"wrap={self.wrap} ordered={self.ordered}"
            )
        if self.chunk_size < 1 or self.max_attempts < 1:
            raise ValueError(
                f"chunk_size and max_attempts must be >= 1, got chunk_size={self.chunk_size} "
                f"max_attempts={self.max_attempts}"
            )
        if self.max_in_flight is not None and self.max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 1 (or None), got max_in_flight={self.max_in_flight}")
        fraction = self.max_bad_fraction
        if isinstance(fraction, bool) or not 0.0 <= float(fraction) <= 1.0:
            raise ValueError(f"max_bad_fraction must be in [0, 1], got max_bad_fraction={fraction!r}")
        parse_bytes(self.memory_budget)  # raises ValueError naming a bad size

    @property
    def budget_bytes(self) -> int:
        """`memory_budget` in bytes."""
        return parse_bytes(self.memory_budget)
