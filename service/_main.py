"""Process entry points: `batchd coordinator`, `batchd rank` and `batchd node` (one process each).

`batchd node` is the node agent: one process per host serving all its trainer ranks (`run_node`), each
with its own rank service core and source, one gRPC server for its trainers and peers, and one stream
to the coordinator (`_node_link`). Moved samples between its ranks are handed over in process.

Both bind port 0 when asked (tests, the demo), print/write the bound port, and exit on their own:
a rank service once its trainer has taken the last batch of the last epoch (it then tells the
coordinator: `Finish`), the coordinator once every rank finished; either once the job failed (after a
short linger so every party reads the failure message). Exit status: 0 done, 1 job failed, 130
interrupted. With `--state-dir`, each journals its state and a restart with the same command resumes.

`batchd rank` reads from one of three sources: `--lengths` (synthetic tokenized samples), `--dataset`
(records preprocessed by a Ray actor pool: `RaySource`; it joins `--ray-address` (`auto`: the Ray
already running on this host), else its own job's Ray on this host, else starts an embedded one that
the job's next rank services on this host join; never a Ray another job started). A Ray that goes
away under a running service fails the job at once, naming it (`SharedRay.watch`, `RayLost`))
or neither (producers push samples through `Ingest`). With `--stats-file`, a rank service reading a
dataset writes its source's counters (samples, quarantined, records read, samples/s, actor busy time,
the Ray node of each actor) there as JSON when it exits (with `ray_address`, the GCS address of the Ray
it ran on; a node agent, one file per rank, adds the rank's moved-sample counts `fetched_local` and
`fetched_remote`).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import socket
import threading
import time
from pathlib import Path

from batchd.core import JobSpec, Sample, max_fitting_length
from batchd.proto import Progress, Security

from ._coord_client import CoordinatorClient
from ._coordinator import create_server
from ._metrics import (
    CoordinatorMetrics,
    MergedRegistry,
    RankMetrics,
    start_metrics_server,
    stop_metrics_server,
)
from ._node import NodeAgent
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
from .rank import RankServiceCore, create_rank_server, job_samples

log = logging.getLogger("batchd")
LINGER_S = 2.0
RESTORED_LINGER_S = 10.0


def write_port_file(path: str | os.PathLike | None, port: int, metrics_port: int | None = None) -> None:
    if path:
        p = Path(path)
        tmp = p.with_suffix(p.suffix + ".tmp")
        info = {"port": port, "pid": os.getpid()}
        if metrics_port is not None:
            info["metrics_port"] = metrics_port
        tmp.write_text(json.dumps(info))
        os.replace(tmp, p)


def _start_metrics(metrics, host: str, port: int | None, who: str):
    """Serves `metrics.registry` on host:port (0 = a free port) when `port` is given: (server, bound) or (None, None)."""
    if port is None:
        return None, None
    server, bound = start_metrics_server(metrics.registry, host, port)
    log.info("%s: Prometheus metrics on http://%s:%d/metrics", who, host, bound)
    return server, bound


def _stop_event() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _linger_until_told(cores, stop: threading.Event, grace_s: float) -> None:
    """After the job failed: stays LINGER_S, then until every rank's trainer heard why (ABORTED, or a
    RankStatus that said it), at most `grace_s`: a trainer still starting when the job failed would find
    no service and wait out its start-up timeout instead of failing with the message that names the cause."""
    deadline = time.monotonic() + max(grace_s, LINGER_S)
    stop.wait(LINGER_S)
    while not all(c.failure_told for c in cores) and time.monotonic() < deadline and not stop.wait(0.2):
        pass


def run_coordinator(
    spec: JobSpec,
    host: str = "127.0.0.1",
    port: int = 0,
    port_file: str | None = None,
    lease_s: float = 60.0,
    startup_timeout_s: float = 600.0,
    security: Security | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    state_dir: str | None = None,
) -> int:
    metrics = CoordinatorMetrics(spec.world_size, spec.cost_model()) if metrics_port is not None else None
    server, bound, state = create_server(
        f"{host}:{port}",
        spec,
        lease_s,
        startup_timeout_s,
        security=security,
        metrics=metrics,
        state_dir=state_dir,
    )
    if state.job_done:
        log.warning(
            "the job in %s already finished; nothing to do (remove the state dir to run it again)", state_dir
        )
        state.close()
        return 0
    try:
        metrics_server, metrics_bound = _start_metrics(metrics, metrics_host, metrics_port, "coordinator")
    except OSError:
        state.close()
        raise
    server.start()
    write_port_file(port_file, bound, metrics_bound)
    log.info(
        "coordinator listening on %s:%d for %d ranks (%s)%s",
        host,
        bound,
        spec.world_size,
        security.describe() if security else "plaintext",
        f", journal in {state_dir}" if state_dir else "",
    )
    stop = _stop_event()
    try:
        while not stop.wait(0.2):
            if state.state == "done":
                stop.wait(LINGER_S)
                break
            if (
                state.state == "failed"
            ):  # stay until every rank heard why (they tell their trainers), <= a lease
                deadline = time.monotonic() + max(lease_s, LINGER_S)
                stop.wait(LINGER_S)
                while not state.all_informed() and time.monotonic() < deadline and not stop.wait(0.2):
                    pass
                break
    finally:
        state.close()
        server.stop(1.0).wait()
        if metrics_server is not None:
            stop_metrics_server(metrics_server)
    if state.state == "running":
        return 130
    return 0 if state.state == "done" else 1


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
    return source, shared


def _write_stats(
    path: str | None,
    rank: int,
    source: RaySource,
    ray_address: str | None = None,
    fetched: dict[str, int] | None = None,
    ray_gone: bool = False,
) -> None:
    """Writes `source`'s counters (`Source.stats()`), its view's size, this process's peak resident memory
    (`peak_rss_bytes`: a node agent's, all its ranks together), its pool's actor time, the Ray node each
    actor runs on (`actor_nodes`) and each actor's peak resident memory to `path` as JSON; a node agent adds its rank's moved-sample
    counts (`fetched`: `fetched_local`, `fetched_remote`, as RankStatus reports them).

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


def _make_source(
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
    images = None
    if lengths and isinstance(lengths[0], Sample):  # a multimodal workload: synthetic images too
        images = [s.images for s in lengths]
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
    client_grace_s: float = 30.0,
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
) -> int:
    if lengths is not None and dataset is not None:
        raise ValueError("give either lengths (synthetic samples) or a dataset, not both")
    try:
        source, shared = _make_source(
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
        return _ray_lost_at_start(coordinator, [rank], spec, security, lost)
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
        )
    finally:
        if ray_source is not None:
            try:
                _write_stats(stats_file, rank, ray_source, shared.address, ray_gone=shared.lost is not None)
                ray_source.close()
            finally:
                shared.close()  # stops only a Ray this service started, once no other service uses it


def _ray_lost_at_start(
    coordinator: str, ranks: list[int], spec: JobSpec, security: Security | None, lost: RayLost
) -> int:
    """The Ray went away while the ranks' sources were starting: tells the coordinator (so the other ranks
    and the trainers learn at once, naming it) and returns the failed-job status 1."""
    log.error("rank %d: job failed: %s", ranks[0], lost)
    client = CoordinatorClient(coordinator, ranks[0], spec, security=security)
    try:
        client.fail(str(lost))
    finally:
        client.close()
    return 1


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
    )
    server, bound = create_rank_server(f"{host}:{port}", core, security)
    metrics_server, metrics_bound = _start_metrics(metrics, metrics_host, metrics_port, f"rank {rank}")
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
    stop = _stop_event()
    status = 0
    finished_at = None
    try:
        while not stop.wait(0.2):
            with core.cond:
                failed = core.failure is not None
                finished = core.finished and core.delivery.holder is None
            if failed:
                status = 1
                _linger_until_told([core], stop, client_grace_s)
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
    return status


def node_ranks(
    local_ranks: int | None = None, node_rank: int | None = None, env: dict[str, str] | None = None
) -> list[int]:
    """The global ranks a node agent serves: node_rank * K .. node_rank * K + K - 1, torchrun's numbering.

    K is `local_ranks`, else $LOCAL_WORLD_SIZE (torchrun's); the node rank is `node_rank`, else $GROUP_RANK
    (torchrun), else $NODE_RANK. Raises ValueError naming what is missing or bad.
    """
    env = os.environ if env is None else env

    def pick(value: int | None, names: tuple[str, ...], what: str) -> int:
        if value is not None:
            return value
        for name in names:
            if env.get(name, "").strip():
                try:
                    return int(env[name])
                except ValueError:
                    raise ValueError(f"${name}={env[name]!r} is not an integer ({what})") from None
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
    lengths: list[int] | None,
    name: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise: str | None = None,
    port_file: str | None = None,
    state_dir: str | None = None,
    client_grace_s: float = 30.0,
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
) -> int:
    """`batchd node`: serves `ranks` (one `RankServiceCore` each, one gRPC server, one coordinator stream)
    until every one of its trainers took the job's last step, or the job failed. Sources as for
    `run_rank`, one per rank (`num_actors` actors per rank; `stats_file` gets `{rank}` filled in or, without
    it, ".rank<r>" before its suffix). `advertise` is the host peers on other nodes reach it at (default
    `host`, or this machine's name when `host` is 0.0.0.0)."""
    if lengths is not None and dataset is not None:
        raise ValueError("give either lengths (synthetic samples) or a dataset, not both")
    bad = [r for r in ranks if not 0 <= r < spec.world_size]
    if not ranks or bad:
        raise ValueError(
            f"a node agent's ranks must lie in 0..{spec.world_size - 1} (world_size="
            f"{spec.world_size}), got {ranks}"
        )
    name = name or socket.gethostname()
    sources: dict[int, Source] = {}
    shared: list[SharedRay] = []
    fetched: dict[int, dict[str, int]] = {}  # per rank, filled in by _serve_node as it ends: for the stats
    job = job_key(coordinator, spec)
    try:
        try:
            for r in ranks:
                sources[r], ray_handle = _make_source(
                    spec,
                    r,
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
                    job,
                )
                if ray_handle is not None:
                    shared.append(ray_handle)
        except RayLost as lost:
            return _ray_lost_at_start(coordinator, ranks, spec, security, lost)
        return _serve_node(
            spec,
            ranks,
            coordinator,
            name,
            sources,
            host,
            port,
            advertise,
            port_file,
            state_dir,
            client_grace_s,
            security,
            metrics_port,
            metrics_host,
            trainer_timeout_s,
            startup_timeout_s,
            fetched,
            shared[0] if shared else None,
        )
    finally:
        try:
            for r, src in sources.items():
                if isinstance(src, RaySource):
                    path = _rank_path(stats_file, r)
                    try:
                        _write_stats(
                            path,
                            r,
                            src,
                            shared[0].address if shared else None,
                            fetched.get(r),
                            ray_gone=bool(shared) and shared[0].lost is not None,
                        )
                    finally:
                        src.close()
        finally:
            for handle in reversed(shared):  # the one that started an embedded Ray (the first) goes last
                handle.close()


def _node_ray_lost(agent: NodeAgent, lost: RayLost) -> None:
    """The node's Ray went away: every rank of the node fails, naming it (its first rank tells the coordinator)."""
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
                tty=False,
            )
        self.bar.update(made - self.bar.n, steps - self.bar.steps)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _serve_node(
    spec: JobSpec,
    ranks: list[int],
    coordinator: str,
    name: str,
    sources: dict[int, Source],
    host: str,
    port: int,
    advertise: str | None,
    port_file: str | None,
    state_dir: str | None,
    client_grace_s: float,
    security: Security | None,
    metrics_port: int | None,
    metrics_host: str,
    trainer_timeout_s: float,
    startup_timeout_s: float,
    fetched: dict[int, dict[str, int]] | None = None,
    shared: SharedRay | None = None,
) -> int:
    """Serves the node's ranks (see `run_node`); `fetched` gets each rank's moved-sample counts at the end.
    `shared`: the Ray its sources run on, watched: once it goes away the job fails, naming it."""
    agent = NodeAgent(
        spec,
        coordinator,
        name,
        sources,
        host,
        port,
        _advertised(host, advertise),
        state_dir,
        client_grace_s,
        security,
        metrics_port is not None,
        trainer_timeout_s,
        startup_timeout_s,
    )
    cores = agent.cores
    metrics_server = metrics_bound = None
    if agent.metrics:
        metrics_server, metrics_bound = start_metrics_server(
            MergedRegistry([m.registry for m in agent.metrics.values()]), metrics_host, metrics_port
        )
    agent.start()
    if shared is not None:
        shared.watch(lambda lost: _node_ray_lost(agent, lost))
    bound = agent.port
    write_port_file(port_file, bound, metrics_bound)
    log.info(
        "node agent %r serving ranks %s on %s:%d (peers reach it at %s; %s)",
        name,
        agent.ranks,
        host,
        bound,
        agent.address,
        security.describe() if security else "plaintext",
    )
    stop = _stop_event()
    status = 0
    finished_at = None
    progress = _NodeProgress(name, cores[min(cores)])
    try:
        while not stop.wait(0.2):
            progress.poll()
            if agent.failure is not None:
                status = 1
                _linger_until_told(list(agent.cores.values()), stop, client_grace_s)
                break
            if agent.finished:
                finished_at = finished_at or time.monotonic()
                if not agent.restored_finished or time.monotonic() - finished_at >= RESTORED_LINGER_S:
                    break
            else:
                finished_at = None
    finally:
        progress.close()
        agent.stop()
        if fetched is not None:
            fetched.update((r, dict(core.fetched)) for r, core in cores.items())
        if metrics_server is not None:
            stop_metrics_server(metrics_server)
    if stop.is_set() and not all(c.finished for c in cores.values()) and status == 0:
        return 130
    return status
