"""The configuration of a rank service or node agent process (`run_rank`, `run_node`), grouped at its seams.

    ServiceConfig
      source:   SourceOptions  where each rank's samples come from (`_rank_source.make_source`)
      endpoint: Endpoint       where the process serves its trainers, peers and metrics, and how securely
      limits:   Limits         how long it waits for whom, and what it holds for a rewind
      state_dir, stats_file    its journal directory and its source counters' file

Each is a frozen dataclass that validates in `__post_init__`, naming the bad value; the defaults of the
service layer live here, once. The app layer (`batchd.cli`, config files) builds a `ServiceConfig` from its
validated `Config`. `Limits` is the rank service's own (`batchd.service.rank`, what `RankServiceCore`
takes), re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from batchd.core import Sample
from batchd.proto import Security

from .preprocess import StreamOptions
from .rank import Limits


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """Where a rank's samples come from: `lengths` (synthetic samples of these lengths, or multimodal
    `Sample`s, `vocab_size` tokens), `dataset` (records preprocessed by `num_actors` Ray actors per rank with
    `default_stages(tokenizer, cutoff=cutoff, **pipeline)`, on the Ray at `ray_address`, bad records
    written to `quarantine`; `source_options`: more `StreamOptions` fields, e.g. `memory_budget`,
    `max_bad_fraction`, not `wrap` (the job's mode says) nor `quarantine`), or neither (producers push
    samples through Ingest). Not both."""

    lengths: Sequence[int] | Sequence[Sample] | None = None
    dataset: str | None = None
    tokenizer: str | None = None
    vocab_size: int = 512
    num_actors: int = 2
    ray_address: str | None = None
    quarantine: str | None = None
    cutoff: int | None = None
    pipeline: Mapping[str, Any] | None = None
    source_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.lengths is not None and self.dataset is not None:
            raise ValueError(
                "give either lengths (synthetic samples) or a dataset, not both, got "
                f"{len(self.lengths)} lengths and dataset={self.dataset!r}"
            )
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got vocab_size={self.vocab_size}")
        if self.num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got num_actors={self.num_actors}")
        if self.cutoff is not None and self.cutoff < 1:
            raise ValueError(f"cutoff must be >= 1 (or None), got cutoff={self.cutoff}")
        if self.source_options is not None:
            allowed = {f.name for f in dataclasses.fields(StreamOptions)} - {"wrap", "quarantine"}
            unknown = sorted(set(self.source_options) - allowed)
            if unknown:
                raise ValueError(
                    f"source_options has unknown key(s) {unknown} (it takes {sorted(allowed)}), got "
                    f"source_options={dict(self.source_options)}"
                )
            StreamOptions(**self.source_options)  # raises ValueError naming a bad value


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where the process serves: its gRPC server on `host:port` (0: a free port), reached by peers on
    other nodes at `advertise` (default `host`, or this machine's name when `host` is 0.0.0.0); the bound
    ports written to `port_file` as JSON; Prometheus metrics on `metrics_host:metrics_port` (None: no
    metrics; 0: a free port); `security` (None: plaintext)."""

    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None
    port_file: str | os.PathLike[str] | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    security: Security | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError(f"host must not be empty, got host={self.host!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must lie in 0..65535, got port={self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(
                f"metrics_port must lie in 0..65535 (or None), got metrics_port={self.metrics_port}"
            )
        if not self.metrics_host:
            raise ValueError(f"metrics_host must not be empty, got metrics_host={self.metrics_host!r}")
        if self.advertise is not None and not self.advertise:
            raise ValueError(f"advertise must not be empty (None: host), got advertise={self.advertise!r}")


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """A rank service's or node agent's process configuration (module docstring). `state_dir`: its
    journals (None: none; a restart cannot resume); `stats_file`: a `RaySource`'s counters, written as
    JSON when the process exits (a node agent writes one file per rank: `{rank}` filled in, else
    ".rank<r>" before the suffix)."""

    source: SourceOptions = dataclasses.field(default_factory=SourceOptions)
    endpoint: Endpoint = dataclasses.field(default_factory=Endpoint)
    limits: Limits = dataclasses.field(default_factory=Limits)
    state_dir: str | os.PathLike[str] | None = None
    stats_file: str | None = None

    def __post_init__(self) -> None:
        for name, kind in (("source", SourceOptions), ("endpoint", Endpoint), ("limits", Limits)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {name}={value!r}")
