"""`batchd rank`: one rank service in its own process (`run_rank`), and the sources a rank reads.

A rank service serves its trainer until the trainer has taken the last batch of the last epoch (it then
tells the coordinator: `Finish`), or the job failed (after a short linger so its trainer reads the
failure message). Exit status 0 done, 1 job failed, 130 interrupted. With `--state-dir` it journals its
state and a restart with the same command resumes.

A rank reads from one of three sources (`make_source`): `--lengths` (synthetic tokenized samples),
`--dataset` (records preprocessed by a Ray actor pool: `RaySource`, `make_ray_source`; it joins
`--ray-address` (`auto`: the Ray already running on this host), else its own job's Ray on this host,
else starts an embedded one that the job's next rank services on this host join; never a Ray another
job started. A Ray that goes away under a running service fails the job at once, naming it
(`SharedRay.watch`, `RayLost`)) or neither (producers push samples through `Ingest`). With
`--stats-file`, a rank service reading a dataset writes its source's counters (samples, quarantined,
records read, samples/s, actor busy time, the Ray node of each actor) there as JSON when it exits
(`write_stats`; with `ray_address`, the GCS address of the Ray it ran on).
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

from batchd.core import JobFailed, JobSpec, Sample, max_fitting_length
from batchd.proto import Security

from ._coord_client import CoordinatorClient
from ._metrics import RankMetrics
from ._metrics_http import stop_metrics_server
from ._run_common import (
    RESTORED_LINGER_S,
    check_port_free,
    linger_until_told,
    log,
    ray_lost_at_start,
    start_metrics,
    stop_event,
    write_port_file,
)
from .preprocess import (
    IngestSource,
    RayLost,
    RaySource,
    RecordDataset,
    SharedRay,
    Source,
    SyntheticSource,
    default_stages,
    job_key,
    share_ray,
)
from .rank import RETAIN_BYTES, RankServiceCore, create_rank_server


def make_ray_source(
    spec: JobSpec,
    rank: int,
    dataset: str,
    tokenizer: str | None = None,
    num_actors: int = 2,
    ray_address: str | None = None,
    quarantine: str | None = None,
    cutoff: int | None = None,
    pipeline: dict | None = None,
    source_options: dict | None = None,
    job: str | None = None,
) -> tuple[RaySource, SharedRay]:
    """Rank `rank`'s `RaySource` over `dataset` with `default_stages(tokenizer)`, in the job's sampler view,
    and the `SharedRay` it runs on: `(source, shared_ray)`; the caller closes both, the source first.

    The dataset (files, schema, at least one record) and the tokenizer are checked before Ray is touched,
    so a bad input fails in a second with an error naming the file. Ray: `ray_address` ("auto": the Ray
    already running on this host), else this job's Ray on this host (`job`, `job_key`), else an embedded
    one (`share_ray`) with `num_actors * world_size` logical CPUs (at least the host's cores), room for
    every rank service of the job on this host; never a Ray another job started.

    The chain's cutoff is at most the longest length a lone sample may have under the job's budget and
    cost (`max_fitting_length`), so no sample ever reaches the rank's own truncation, which could not
    cut pixel values consistently (the Truncate stage drops whole images). `source_options`: more
    `RaySource` keywords ([data] `memory_budget`, `max_bad_fraction`).
    """
    limit = max_fitting_length(spec.token_budget, spec.cost_model())
    cutoff = limit if cutoff is None else min(cutoff, limit)
    records = RecordDataset(dataset)
    stages = default_stages(tokenizer, cutoff=cutoff, **(pipeline or {}))
    # An embedded Ray gets logical CPUs for every rank service of the job to run its actors on this host
    # (each actor reserves one), at least the host's cores: the services started together share it.
    shared = share_ray(
        ray_address,
        num_cpus=max(os.cpu_count() or 1, num_actors * spec.world_size),
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
            stages=stages,
            num_actors=num_actors,
            quarantine=quarantine,
            wrap=spec.mode == "non-join",
            **(source_options or {}),
        )
    except BaseException:
        shared.close()
        raise
    source.longest = cutoff  # `Source.longest`: the chain's Truncate stage cuts every sample to it
    return source, shared


def write_stats(
    path: str | None,
    rank: int,
    source: RaySource,
    ray_address: str | None = None,
    fetched: dict[str, int] | None = None,
    ray_gone: bool = False,
) -> None:
    """Writes `source`'s counters (`Source.stats()`), its view's size, this process's peak resident memory
    (`peak_rss_bytes`: a node agent's, all its ranks together), its pool's actor time, the Ray node each
    actor runs on (`actor_nodes`) and each actor's peak resident memory to `path` as JSON; a node agent
    adds its rank's moved-sample counts (`fetched`: `fetched_local`, `fetched_remote`, as RankStatus
    reports them).

    Only a `RaySource` has a view of known size and actors; the actor counters are best effort (a dead
    Ray is logged, not raised; a Ray known to be gone, `ray_gone`, is not asked), the sample counts are exact.
    """
    if not path:
        return
    stats = {
        "rank": rank,
        **source.stats(),
        "view": len(source),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if ray_address is not None:
        stats["ray_address"] = ray_address
    for kind, n in (fetched or {}).items():
        stats[f"fetched_{kind}"] = n
    try:
        if ray_gone:
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


def make_source(
    spec: JobSpec,
    rank: int,
    lengths: list[int] | list[Sample] | None,
    vocab_size: int,
    dataset: str | None,
    tokenizer: str | None,
    num_actors: int,
    ray_address: str | None,
    quarantine: str | None,
    cutoff: int | None,
    pipeline: dict | None,
    source_options: dict | None = None,
    job: str | None = None,
) -> tuple[Source, SharedRay | None]:
    """Rank `rank`'s source (module docstring: a dataset through Ray, synthetic lengths, or Ingest pushes)
    and, for a dataset, the `SharedRay` it runs on (the caller closes both, the source first)."""
    if dataset is not None:
        return make_ray_source(
            spec,
            rank,
            dataset,
            tokenizer,
            num_actors,
            ray_address,
            quarantine,
            cutoff,
            pipeline,
            source_options,
            job,
        )
    if lengths is None:
        return IngestSource(spec.window), None
    images = audio = None
    if lengths and isinstance(lengths[0], Sample):  # a multimodal workload: synthetic images (clips) too
        images = [s.images for s in lengths]
        audio = [s.audio for s in lengths] if any(s.audio for s in lengths) else None
        lengths = [s.length for s in lengths]
    return SyntheticSource(
        lengths,
        rank,
        spec.world_size,
        spec.seed,
        0,
        spec.shuffle,
        vocab_size,
        wrap=spec.mode == "non-join",
        images=images,
        audio=audio,
    ), None


def run_rank(
    spec: JobSpec,
    rank: int,
    coordinator: str,
    lengths: list[int] | None,
    host: str = "127.0.0.1",
    port: int = 0,
    port_file: str | None = None,
    state_dir: str | None = None,
    client_grace_s: float = 600.0,
    vocab_size: int = 512,
    dataset: str | None = None,
    tokenizer: str | None = None,
    num_actors: int = 2,
    ray_address: str | None = None,
    quarantine: str | None = None,
    stats_file: str | None = None,
    pipeline: dict | None = None,
    cutoff: int | None = None,
    security: Security | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    trainer_timeout_s: float = 1800.0,
    startup_timeout_s: float = 600.0,
    source_options: dict | None = None,
    retain_bytes: int = RETAIN_BYTES,
) -> int:
    if lengths is not None and dataset is not None:
        raise ValueError("give either lengths (synthetic samples) or a dataset, not both")
    check_port_free(host, port, f"rank {rank}'s")  # before Ray: a second service fails here, at once
    check_port_free(metrics_host, metrics_port, f"rank {rank}'s metrics")
    try:
        source, shared = make_source(
            spec,
            rank,
            lengths,
            vocab_size,
            dataset,
            tokenizer,
            num_actors,
            ray_address,
            quarantine,
            cutoff,
            pipeline,
            source_options,
            job_key(coordinator, spec),
        )
    except RayLost as lost:
        return ray_lost_at_start(coordinator, [rank], spec, security, lost)
    ray_source = source if isinstance(source, RaySource) else None
    try:
        return _serve_rank(
            spec,
            rank,
            coordinator,
            source,
            host,
            port,
            port_file,
            state_dir,
            client_grace_s,
            security,
            metrics_port,
            metrics_host,
            trainer_timeout_s,
            startup_timeout_s,
            shared,
            retain_bytes,
        )
    finally:
        if ray_source is not None:
            try:
                write_stats(stats_file, rank, ray_source, shared.address, ray_gone=shared.lost is not None)
                ray_source.close()
            finally:
                shared.close()  # stops only a Ray this service started, once no other service uses it


def _serve_rank(
    spec: JobSpec,
    rank: int,
    coordinator: str,
    source: Source,
    host: str,
    port: int,
    port_file: str | None,
    state_dir: str | None,
    client_grace_s: float,
    security: Security | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    trainer_timeout_s: float = 1800.0,
    startup_timeout_s: float = 600.0,
    shared: SharedRay | None = None,
    retain_bytes: int = RETAIN_BYTES,
) -> int:
    """Serves one rank until its trainer took the job's last step (and left), or the job failed.

    A service restored from a journal written after its trainer took the last step lingers up to
    RESTORED_LINGER_S for a trainer that lost that end and asks for it again."""
    coord = CoordinatorClient(coordinator, rank, spec, startup_timeout_s=startup_timeout_s, security=security)
    metrics = RankMetrics(rank) if metrics_port is not None else None
    core = RankServiceCore(
        rank,
        spec,
        coord,
        source,
        state_dir=state_dir,
        client_grace_s=client_grace_s,
        trainer_timeout_s=trainer_timeout_s,
        security=security,
        metrics=metrics,
        retain_bytes=retain_bytes,
    )
    server, bound = create_rank_server(f"{host}:{port}", core, security)
    metrics_server, metrics_bound = start_metrics(metrics, metrics_host, metrics_port, f"rank {rank}")
    server.start()
    core.start(f"{host}:{bound}")
    if shared is not None:
        shared.watch(core.fail_ray)  # a Ray gone under an idle service fails the job too
    write_port_file(port_file, bound, metrics_bound)
    log.info(
        "rank %d service listening on %s:%d (%s)",
        rank,
        host,
        bound,
        security.describe() if security else "plaintext",
    )
    stop = stop_event()
    status = 0
    finished_at = None
    try:
        while not stop.wait(0.2):
            with core.cond:
                failed = core.failure is not None
                finished = core.finished and core.delivery.holder is None
            if failed:
                status = 1
                linger_until_told([core], stop, client_grace_s)
                break
            if finished:
                finished_at = finished_at or time.monotonic()
                if not core.restored_finished or time.monotonic() - finished_at >= RESTORED_LINGER_S:
                    break
            else:
                finished_at = None
    finally:
        core.stop()
        coord.close()
        server.stop(1.0).wait()
        if metrics_server is not None:
            stop_metrics_server(metrics_server)
    if stop.is_set() and not core.finished and status == 0:
        return 130
    if status == 1:
        raise JobFailed(core.failure or "the job failed")
    return status
