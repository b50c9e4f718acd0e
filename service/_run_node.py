"""`batchd node`: the node agent, one process per host serving all its trainer ranks (`run_node`).

Its ranks are torchrun's numbering of the node (`node_ranks`). Each rank has its own rank service core
and source (as for `batchd rank`: `_run_rank.make_source`); the agent runs one gRPC server for its
trainers and peers and one stream to the coordinator (`NodeAgent`, `_node_link`). Moved samples
between its ranks are handed over in process. It exits once every one of its trainers took the job's
last step, or the job failed (after a short linger so every trainer reads the failure message). Exit
status 0 done, 1 job failed, 130 interrupted. With `--stats-file` it writes one file per rank
(`_rank_path`), which adds the rank's moved-sample counts `fetched_local` and `fetched_remote`. While
it serves it logs its progress every $BATCHD_PROGRESS_S seconds (`_NodeProgress`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from prometheus_client import CollectorRegistry

from batchd.core import JobFailed, JobSpec
from batchd.proto import Progress, ProgressOutput

from ._metrics_http import MergedRegistry, start_metrics_server, stop_metrics_server
from ._node import NodeAgent
from ._rank_source import make_source, write_stats
from ._run_common import (
    RESTORED_LINGER_S,
    check_port_free,
    linger_until_told,
    log,
    ray_lost_at_start,
    stop_event,
    write_port_file,
)
from ._service_config import Endpoint, ServiceConfig, SourceOptions
from .preprocess import BadRecordTally, RayLost, RaySource, SharedRay, Source, job_key
from .rank import RankServiceCore, job_samples


def node_ranks(
    local_ranks: int | None = None, node_rank: int | None = None, env: Mapping[str, str] | None = None
) -> list[int]:
    """The global ranks a node agent serves: node_rank * K .. node_rank * K + K - 1, torchrun's numbering.

    K is `local_ranks`, else $LOCAL_WORLD_SIZE (torchrun's); the node rank is `node_rank`, else $GROUP_RANK
    (torchrun), else $NODE_RANK. Raises ValueError naming what is missing or bad.
    """
    environ: Mapping[str, str] = os.environ if env is None else env

    def pick(value: int | None, names: tuple[str, ...], what: str) -> int:
        if value is not None:
            return value
        for name in names:
            if environ.get(name, "").strip():
                try:
                    return int(environ[name])
                except ValueError:
                    raise ValueError(f"${name}={environ[name]!r} is not an integer ({what})") from None
        raise ValueError(
            f"the node agent needs {what}: pass --{what.replace('_', '-')} or set "
            f"{' or '.join('$' + n for n in names)}"
        )

    k = pick(local_ranks, ("LOCAL_WORLD_SIZE",), "local_ranks")
    g = pick(node_rank, ("GROUP_RANK", "NODE_RANK"), "node_rank")
    if k < 1:
        raise ValueError(f"local_ranks must be >= 1, got local_ranks={k}")
    if g < 0:
        raise ValueError(f"node_rank must be >= 0, got node_rank={g}")
    return list(range(g * k, g * k + k))


def run_node(
    spec: JobSpec,
    ranks: list[int],
    coordinator: str,
    config: ServiceConfig | None = None,
    name: str | None = None,
) -> int:
    """`batchd node`: serves `ranks` (one `RankServiceCore` each, one gRPC server, one coordinator stream)
    until every one of its trainers took the job's last step, or the job failed. `config` (default
    `ServiceConfig()`): sources as for `run_rank`, one per rank (`num_actors` actors per rank);
    `stats_file` gets `{rank}` filled in or, without it, ".rank<r>" before its suffix; `endpoint.advertise`
    is the host peers on other nodes reach it at (default its host, or this machine's name when the host
    is 0.0.0.0). `name`: the agent's name in logs and failures (default: the host name)."""
    config = ServiceConfig() if config is None else config
    stats_file = config.stats_file
    return serve_ranks(
        spec, ranks, coordinator, config, name or socket.gethostname(), lambda r: _rank_path(stats_file, r)
    )


def serve_ranks(
    spec: JobSpec,
    ranks: list[int],
    coordinator: str,
    config: ServiceConfig,
    name: str,
    stats_path: Callable[[int], str | None],
) -> int:
    """Opens the sources of `ranks` and serves them as node agent `name` (`run_node`; `run_rank` is this
    with one rank); `stats_path(r)` is where rank r's source counters go (None: nowhere)."""
    _check_node_ranks(spec, ranks)
    endpoint, one = config.endpoint, len(ranks) == 1 and name == f"rank-{ranks[0]}"
    who = f"rank {ranks[0]}'s" if one else "the node agent's"
    check_port_free(endpoint.host, endpoint.port, who)  # before Ray: a second agent fails here, at once
    check_port_free(endpoint.metrics_host, endpoint.metrics_port, f"{who} metrics")
    held = _NodeSources()
    try:
        try:
            held.open(spec, ranks, config.source, job_key(coordinator, spec))
        except RayLost as lost:
            return ray_lost_at_start(coordinator, ranks, spec, config.endpoint.security, lost)
        return _serve_node(spec, coordinator, name, config, held)
    finally:
        held.close(stats_path)


def _check_node_ranks(spec: JobSpec, ranks: list[int]) -> None:
    """Raises ValueError when `ranks` is empty or holds a rank outside the job's 0..world_size-1."""
    bad = [r for r in ranks if not 0 <= r < spec.world_size]
    if not ranks or bad:
        raise ValueError(
            f"a node agent's ranks must lie in 0..{spec.world_size - 1} (world_size="
            f"{spec.world_size}), got {ranks}"
        )


class _NodeSources:
    """The node agent's sources, one per rank (`sources`), and the `SharedRay` handles they run on
    (`ray`: the first one's; every rank's source shares that Ray). `open` fills them in rank order, so a
    failure part way leaves the ones opened so far to `close`; `fetched` gets each rank's moved-sample
    counts as the agent ends (`_serve_node`), for the stats files."""

    def __init__(self) -> None:
        self.sources: dict[int, Source] = {}
        self.shared: list[SharedRay] = []
        self.fetched: dict[int, dict[str, int]] = {}

    @property
    def ray(self) -> SharedRay | None:
        return self.shared[0] if self.shared else None

    def open(self, spec: JobSpec, ranks: list[int], options: SourceOptions, job: str) -> None:
        """Opens each rank's source (`make_source`); raises `RayLost` if the Ray went away."""
        source = dict(options.source_options or {})
        source["bad_tally"] = BadRecordTally()  # the ranks judge [data] max_bad_fraction over their records
        options = dataclasses.replace(options, source_options=source)
        for r in ranks:
            self.sources[r], ray_handle = make_source(spec, r, options, job)
            if ray_handle is not None:
                self.shared.append(ray_handle)

    def close(self, stats_path: Callable[[int], str | None]) -> None:
        """Writes each rank's stats (rank r's to `stats_path(r)`: a `RaySource`'s counters, any source's
        moved-sample counts), closes the sources, then the Ray handles, even when a write fails."""
        try:
            for r, src in self.sources.items():
                try:
                    write_stats(stats_path(r), r, src, self.ray, self.fetched.get(r))
                finally:
                    if isinstance(src, RaySource):
                        src.close()
        finally:
            for handle in reversed(self.shared):  # the one that started an embedded Ray (the first) goes last
                handle.close()


def _node_ray_lost(agent: NodeAgent, lost: RayLost) -> None:
    """The node's Ray went away: every rank of the node fails, naming it (its first rank tells the
    coordinator)."""
    first = agent.ranks[0]
    for r in agent.ranks:
        agent.cores[r].set_failure(f"rank {first}: {lost}")
    agent.cores[first].coord.fail(str(lost))


def _rank_path(path: str | None, rank: int) -> str | None:
    if not path:
        return None
    if "{rank}" in path:
        return path.format(rank=rank)
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def _advertised(host: str, advertise: str | None) -> str:
    if advertise:
        return advertise
    if host in ("0.0.0.0", "::", "[::]"):
        return socket.getfqdn()
    return host


class _NodeProgress:
    """The node agent's progress: one log line every $BATCHD_PROGRESS_S seconds (30) with the samples of
    every rank made into this epoch's steps, out of the job's total, and the steps (as seen by `core`,
    the node's first rank: every rank makes the same steps). Always log lines, never a bar: an agent
    runs in the background, beside the trainers' own progress."""

    def __init__(self, name: str, core: RankServiceCore) -> None:
        self.name, self.core = name, core
        self.epoch: int | None = None
        self.bar: Progress | None = None

    def poll(self) -> None:
        core = self.core
        with core.cond:  # the epoch, its state and its count change together (`_next_epoch`)
            epoch, made, steps = core.epoch, core.samples_made, core.state.step
        if epoch != self.epoch or self.bar is None:
            self.close()
            self.epoch = epoch
            self.bar = Progress(
                f"node agent {self.name!r}: epoch {epoch + 1}/{core.spec.epochs}",
                job_samples(core) or None,
                "samples",
                output=ProgressOutput(tty=False),
            )
        self.bar.update(made - self.bar.n, steps - self.bar.steps)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _serve_node(spec: JobSpec, coordinator: str, name: str, config: ServiceConfig, held: _NodeSources) -> int:
    """Serves the ranks of `held.sources` (see `run_node`); `held.fetched` gets each rank's moved-sample
    counts at the end. `held.ray`: the Ray its sources run on, watched: once it goes away the job fails,
    naming it."""
    endpoint = config.endpoint
    agent = NodeAgent(
        spec,
        coordinator,
        name,
        held.sources,
        dataclasses.replace(endpoint, advertise=_advertised(endpoint.host, endpoint.advertise)),
        config.limits,
        config.state_dir,
        endpoint.metrics_port is not None,
    )
    cores = agent.cores
    metrics_server = _start_node_agent(agent, endpoint, held.ray)
    stop = stop_event()
    progress = _NodeProgress(name, cores[min(cores)])
    try:
        status = _wait_node(agent, stop, progress, config.limits.client_grace_s)
    finally:
        progress.close()
        agent.stop()
        held.fetched.update((r, dict(core.fetched)) for r, core in cores.items())
        if metrics_server is not None:
            stop_metrics_server(metrics_server)
    if stop.is_set() and not all(c.finished for c in cores.values()) and status == 0:
        return 130
    if status == 1:
        raise JobFailed(agent.failure or "the job failed")
    return status


def _start_node_agent(agent: NodeAgent, endpoint: Endpoint, shared: SharedRay | None) -> Any:
    """Starts `agent` with its ranks' merged metrics (when it keeps metrics), watches its Ray (`shared`),
    writes the port file and logs where it serves; returns the metrics server, or None."""
    metrics_server = metrics_bound = None
    if agent.metrics and endpoint.metrics_port is not None:
        registry = MergedRegistry([m.registry for m in agent.metrics.values()])
        metrics_server, metrics_bound = start_metrics_server(
            cast(CollectorRegistry, registry), endpoint.metrics_host, endpoint.metrics_port
        )
        log.info(
            "node agent %r: Prometheus metrics on http://%s:%d/metrics",
            agent.name,
            endpoint.metrics_host,
            metrics_bound,
        )
    agent.start()
    if shared is not None:
        shared.watch(lambda lost: _node_ray_lost(agent, lost))
    bound = agent.port
    write_port_file(endpoint.port_file, bound, metrics_bound)
    log.info(
        "node agent %r serving ranks %s on %s:%d (peers reach it at %s; %s)",
        agent.name,
        agent.ranks,
        endpoint.host,
        bound,
        agent.address,
        endpoint.security.describe() if endpoint.security else "plaintext",
    )
    return metrics_server


def _wait_node(
    agent: NodeAgent, stop: threading.Event, progress: _NodeProgress, client_grace_s: float
) -> int:
    """Polls `agent` every 0.2 s (logging `progress`) until the job failed (then lingers until every
    trainer heard why: status 1), every trainer finished (status 0; a restored agent that had already
    finished waits RESTORED_LINGER_S for a trainer asking for that end again), or `stop` is set (0)."""
    finished_at = None
    while not stop.wait(0.2):
        progress.poll()
        if agent.failure is not None:
            linger_until_told(list(agent.cores.values()), stop, client_grace_s)
            return 1
        if agent.finished:
            finished_at = finished_at or time.monotonic()
            if not agent.restored_finished or time.monotonic() - finished_at >= RESTORED_LINGER_S:
                break
        else:
            finished_at = None
    return 0
