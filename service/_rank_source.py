"""The sources a rank service reads (`make_source`), and their counters' file (`write_stats`).

A rank reads from one of three sources (`SourceOptions`): `lengths` (synthetic tokenized samples),
`dataset` (records preprocessed by a Ray actor pool: `RaySource`, `make_ray_source`; it joins
`ray_address` (`auto`: the Ray already running on this host), else its own job's Ray on this host,
else starts an embedded one that the job's next rank services on this host join; never a Ray another
job started. A Ray that goes away under a running service fails the job at once, naming it
(`SharedRay.watch`, `RayLost`)) or neither (producers push samples through `Ingest`). With a stats
file, a rank service writes its counters there as JSON when it exits (`write_stats`): its moved samples
and their bytes, and reading a dataset its source's (samples, quarantined, records read, samples/s,
actor busy time, the Ray node of each actor; with a Ray address, the GCS address of the Ray it ran on).
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from batchd.core import JobSpec, Sample, max_fitting_length

from ._run_common import log
from ._service_config import SourceOptions
from .preprocess import (
    IngestSource,
    PoolOptions,
    RaySource,
    RecordDataset,
    SharedRay,
    Source,
    StreamOptions,
    SyntheticData,
    SyntheticSource,
    default_stages,
    share_ray,
)


def make_ray_source(
    spec: JobSpec, rank: int, options: SourceOptions, job: str | None = None
) -> tuple[RaySource, SharedRay]:
    """Rank `rank`'s `RaySource` over `options.dataset` with `default_stages(options.tokenizer)`, in the
    job's sampler view, and the `SharedRay` it runs on: `(source, shared_ray)`; the caller closes both,
    the source first. Raises ValueError when `options` names no dataset.

    The dataset (files, schema, at least one record) and the tokenizer are checked before Ray is touched,
    so a bad input fails in a second with an error naming the file. Ray: `options.ray_address` ("auto":
    the Ray already running on this host), else this job's Ray on this host (`job`, `job_key`), else an
    embedded one (`share_ray`) with `num_actors * world_size` logical CPUs (at least the host's cores),
    room for every rank service of the job on this host; never a Ray another job started.

    The chain's cutoff is at most the longest length a lone sample may have under the job's budget and
    cost (`max_fitting_length`), so no sample ever reaches the rank's own truncation, which could not
    cut pixel values consistently (the Truncate stage drops whole images). `options.source_options`:
    more `StreamOptions` fields ([data] `memory_budget`, `max_bad_fraction`).
    """
    if options.dataset is None:
        raise ValueError(f"a Ray source needs a dataset, got dataset={options.dataset!r}")
    limit = max_fitting_length(spec.token_budget, spec.cost_model())
    cutoff = limit if options.cutoff is None else min(options.cutoff, limit)
    records = RecordDataset(options.dataset)
    stages = default_stages(options.tokenizer, cutoff=cutoff, **(options.pipeline or {}))
    # An embedded Ray gets logical CPUs for every rank service of the job to run its actors on this host
    # (each actor reserves one), at least the host's cores: the services started together share it.
    shared = share_ray(
        options.ray_address,
        num_cpus=max(os.cpu_count() or 1, options.num_actors * spec.world_size),
        who=f"rank {rank}",
        job=job,
    )
    try:
        source = RaySource(
            records,
            rank,
            spec.world_size,
            spec.seed,
            0,
            spec.shuffle,
            pool=PoolOptions(stages=stages, num_actors=options.num_actors),
            options=StreamOptions(
                wrap=spec.mode == "non-join", quarantine=options.quarantine, **(options.source_options or {})
            ),
        )
    except BaseException:
        shared.close()
        raise
    source.longest = cutoff  # `Source.longest`: the chain's Truncate stage cuts every sample to it
    return source, shared


def make_source(
    spec: JobSpec, rank: int, options: SourceOptions, job: str | None = None
) -> tuple[Source, SharedRay | None]:
    """Rank `rank`'s source (module docstring: a dataset through Ray, synthetic lengths, or Ingest pushes)
    and, for a dataset, the `SharedRay` it runs on (the caller closes both, the source first)."""
    if options.dataset is not None:
        source, shared = make_ray_source(spec, rank, options, job)
        return cast(Source, source), shared
    lengths: Sequence[Any] | None = options.lengths
    if lengths is None:
        return IngestSource(spec.policy.window), None
    images = audio = None
    if lengths and isinstance(lengths[0], Sample):  # a multimodal workload: synthetic images (clips) too
        images = [s.images for s in lengths]
        audio = [s.audio for s in lengths] if any(s.audio for s in lengths) else None
        lengths = [s.length for s in lengths]
    data = SyntheticData(lengths, options.vocab_size, images=images, audio=audio)
    synthetic = SyntheticSource(
        data, rank, spec.world_size, spec.seed, 0, spec.shuffle, wrap=spec.mode == "non-join"
    )
    return synthetic, None


def write_stats(
    path: str | None,
    rank: int,
    source: object,
    shared: SharedRay | None = None,
    fetched: dict[str, int] | None = None,
) -> None:
    """Writes rank `rank`'s counters to `path` as JSON (nothing when `path` is empty): this process's peak
    resident memory (`peak_rss_bytes`: a node agent's, all its ranks together) and, from a node agent, its
    moved-sample counts (`fetched`: `fetched_local`, `fetched_remote` as RankStatus reports them, and
    `fetched_remote_bytes`) whatever the source; from a `RaySource` also its counters (`Source.stats()`),
    its view's size, its pool's actor time, the Ray node each actor runs on (`actor_nodes`) and each
    actor's peak resident memory, and with `shared` (the Ray it ran on) that Ray's address
    (`ray_address`).

    The actor counters are best effort (a dead Ray is logged, not raised; a Ray known to be gone,
    `shared.lost`, is not asked), the sample counts are exact.
    """
    if not path:
        return
    stats: dict[str, Any] = {
        "rank": rank,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    for kind, n in (fetched or {}).items():
        stats[f"fetched_{kind}"] = n
    if isinstance(source, RaySource):
        stats |= {**source.stats(), "view": len(source)}
        if shared is not None and shared.address is not None:
            stats["ray_address"] = shared.address
        try:
            if shared is not None and shared.lost is not None:
                raise RuntimeError("its Ray went away")
            actors = source.pool.stats(timeout=5.0)
            stats["actor_busy_s"] = sum(a["busy_s"] for a in actors)
            stats["actor_cpu_s"] = sum(a["cpu_s"] for a in actors)
            stats["actor_nodes"] = [a["node_id"] for a in actors]
            stats["actor_peak_rss_bytes"] = [a["peak_rss_bytes"] for a in actors]
        except Exception as exc:  # noqa: BLE001 - counters are best effort; the sample counts above are exact
            log.warning("rank %d: no actor stats: %s", rank, exc)
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(stats))
    os.replace(tmp, p)
