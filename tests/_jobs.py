"""One in-process batchd job for the tests: a real gRPC coordinator and N rank services on loopback.

`InProcessJob` starts a coordinator (`create_server`) and one `RankServiceCore` + rank server per rank,
all in this process, bound to 127.0.0.1 port 0, optionally under TLS / token (`security=`) and with
Prometheus metrics served over HTTP (`metrics=True`). Trainers are real `BatchClient`s (`client`,
`drain`). `job_pool()` makes jobs and always stops them, for pytest fixtures:

    @pytest.fixture
    def job_factory():
        with job_pool() as make:
            yield make

Trade-offs: everything shares one process and the GIL, so timings are not those of a deployment (the
multi-process tests cover that); in exchange a job starts in milliseconds and the tests can inspect the
coordinator's and the rank services' state (`state`, `cores`) directly.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from batchd.client import BatchClient, ClientOptions
from batchd.core import JobSpec
from batchd.proto import Security
from batchd.service import (
    CoordinatorClient,
    CoordinatorMetrics,
    Limits,
    RankMetrics,
    RankServiceCore,
    create_rank_server,
    create_server,
    start_metrics_server,
    stop_metrics_server,
)
from batchd.service.preprocess import SyntheticData, SyntheticSource, synthetic_payload

HOST = "127.0.0.1"


def drain_clients(
    client: Callable[[int], BatchClient],
    world_size: int,
    epochs: int = 1,
    limit_s: float = 60.0,
    project: Callable[[dict, Any], Any] | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> list[list[list[Any]]]:
    """Consumes every rank's stream through epochs 0..epochs-1 (`set_epoch` before each), one trainer thread
    per rank over `client(rank)`; per rank, per epoch, the projected steps (by default (batch, info)).
    `on_step(rank, n)` runs after each rank's n-th step of the epoch. Asserts no trainer raised and all
    finished within `limit_s` each."""

    def consume(r: int) -> list[list[Any]]:
        with client(r) as c:
            out = []
            for e in range(epochs):
                c.set_epoch(e)
                steps: list = []
                for b, info in c:
                    steps.append((b, info) if project is None else project(b, info))
                    if on_step is not None:
                        on_step(r, len(steps))
                out.append(steps)
            return out

    return per_rank(consume, world_size, limit_s)


def per_rank(work: Callable[[int], Any], world_size: int, limit_s: float = 60.0) -> list[Any]:
    """`work(r)` for every rank r, each in a trainer thread of its own; their results by rank. Asserts that
    none raised and that all finished within `limit_s` each."""
    results: list = [None] * world_size
    errors: list = []

    def run(r: int) -> None:
        try:
            results[r] = work(r)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append((r, exc))

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit_s)
    assert not errors, errors
    assert all(r is not None for r in results), "a trainer did not finish"
    return results


class InProcessJob:
    """A coordinator and `spec.world_size` rank services in this process; `stop()` (or `with`) ends them.

    Attributes:
        spec, lengths: The job and the synthetic sample lengths (None when `sources` are given).
        server, port, state: The coordinator's gRPC server, its port and its `CoordinatorState`.
        cores, servers, ports: Per rank: the `RankServiceCore`, its gRPC server and its port.
        cmetrics, rmetrics, http: With metrics: the coordinator's and the ranks' metrics and the HTTP
            servers as (server, port), the coordinator's first.
        t_created, t_started: `time.monotonic()` right before the first rank service was made and
            right after the last one started.
    """

    def __init__(
        self,
        spec: JobSpec,
        lengths: Sequence[int] | None = None,
        *,
        lease_s: float = 10.0,
        startup_timeout_s: float = 60.0,
        sources: Sequence[Any] | None = None,
        grace: float = 30.0,
        security: Security | None = None,
        metrics: bool = False,
        coordinator_metrics: CoordinatorMetrics | None = None,
        connect_timeout_s: float = 5.0,
        vocab_size: int = 512,
        trainer_timeout_s: float = 1800.0,
        coordinator_state_dir: str | None = None,
        rank_state_dir: str | os.PathLike | None = None,
        resize: bool = False,
        retain_bytes: int | None = None,
    ) -> None:
        """Starts the job.

        Args:
            spec: The job.
            lengths: Realized sample lengths of a `SyntheticSource` per rank (a wrapping view in
                non-join mode); needed unless `sources` are given.
            lease_s: The coordinator's heartbeat lease.
            startup_timeout_s: How long the coordinator waits for every rank to register.
            sources: One sample source per rank instead of the synthetic ones.
            grace: Each rank service's `client_grace_s` (how long it waits for a gone trainer).
            security: TLS / token of the coordinator, the rank services and their channels.
            metrics: Give every service its own registry, served over HTTP on a free port.
            coordinator_metrics: The coordinator's `CoordinatorMetrics` (implies `metrics`); by
                default one for `spec`.
            connect_timeout_s: The rank services' coordinator connect timeout.
            vocab_size: Token ids of the synthetic payloads lie in [1, vocab_size).
            trainer_timeout_s: Each rank service's wait for a trainer that has not connected.
            coordinator_state_dir: The coordinator's journal (`restart_coordinator` resumes from it).
            rank_state_dir: The rank services' journals (`restart_rank` resumes from them).
            resize: The coordinator resizes the job journaled in `coordinator_state_dir` (`--resize`).
            retain_bytes: Each rank service's memory for consumed batches held for a rewind (None: its
                default).
        """
        if lengths is None and sources is None:
            raise ValueError(f"give lengths or sources, got {lengths=} and {sources=}")
        if sources is not None and len(sources) != spec.world_size:
            raise ValueError(f"one source per rank: {len(sources)=} for world_size={spec.world_size}")
        self.spec, self.lengths, self.vocab_size = (
            spec,
            None if lengths is None else list(lengths),
            vocab_size,
        )
        self.security, self.trainer_timeout_s = security, trainer_timeout_s
        self.lease_s, self.startup_timeout_s = lease_s, startup_timeout_s
        self.coordinator_state_dir, self.rank_state_dir = coordinator_state_dir, rank_state_dir
        self.grace, self.connect_timeout_s = grace, connect_timeout_s
        self.retain = {} if retain_bytes is None else {"retain_bytes": retain_bytes}
        self.cores: list[RankServiceCore] = []
        self.servers: list = []
        self.ports: list[int] = []
        self.rmetrics: list[RankMetrics] = []
        self.http: list[tuple[Any, int]] = []
        self.server = self.state = None
        self._stopped = False
        metrics = metrics or coordinator_metrics is not None
        self.cmetrics = (
            coordinator_metrics or CoordinatorMetrics(spec.world_size, spec.cost_model()) if metrics else None
        )
        try:
            self.server, self.port, self.state = create_server(
                f"{HOST}:0",
                spec,
                lease_s,
                startup_timeout_s,
                security=security,
                metrics=self.cmetrics,
                state_dir=coordinator_state_dir,
                resize=resize,
            )
            self.server.start()
            if metrics:
                self.http.append(start_metrics_server(self.cmetrics.registry))
            self.t_created = time.monotonic()
            for r in range(spec.world_size):
                self._start_rank(
                    r, sources[r] if sources is not None else None, grace, metrics, connect_timeout_s
                )
            self.t_started = time.monotonic()
        except BaseException:
            self.stop()
            raise

    def _start_rank(self, r: int, source: Any, grace: float, metrics: bool, connect_timeout_s: float) -> None:
        m = RankMetrics(r) if metrics else None
        core, server, port = self._serve_rank(r, source, m)
        self.cores.append(core)
        self.servers.append(server)
        self.ports.append(port)
        if m is not None:
            self.rmetrics.append(m)
            self.http.append(start_metrics_server(m.registry))

    def _serve_rank(
        self, r: int, source: Any, m: RankMetrics | None, port: int = 0
    ) -> tuple[RankServiceCore, Any, int]:
        """Rank `r`'s core (restored from `rank_state_dir` when it holds its journal), its server on `port`
        (0: a free one), started: (core, server, port)."""
        spec = self.spec
        if source is None:
            source = SyntheticSource(
                SyntheticData(self.lengths, self.vocab_size),
                r,
                spec.world_size,
                spec.seed,
                0,
                spec.shuffle,
                wrap=spec.mode == "non-join",
            )
        coord = CoordinatorClient(
            self.address, r, spec, startup_timeout_s=self.connect_timeout_s, security=self.security
        )
        try:
            core = RankServiceCore(
                r,
                spec,
                coord,
                source,
                state_dir=self.rank_state_dir,
                limits=Limits(
                    client_grace_s=self.grace, trainer_timeout_s=self.trainer_timeout_s, **self.retain
                ),
                security=self.security,
                metrics=m,
            )
        except BaseException:
            coord.close()
            raise
        server, bound = create_rank_server(f"{HOST}:{port}", core)  # the core's security
        server.start()
        core.start(f"{HOST}:{bound}")
        return core, server, bound

    def restart_rank(
        self, r: int, source: Any = None, before_start: Callable[[], None] | None = None
    ) -> RankServiceCore:
        """Kills rank `r`'s service abruptly (its loop stops, its server drops every call; nothing is
        written beyond what its journal already holds), calls `before_start` (e.g. to edit the journal),
        and starts a new one on the same port from its journal in `rank_state_dir`, reading `source`
        (by default a fresh synthetic one). Returns the new core."""
        if self.rank_state_dir is None:
            raise ValueError(f"restart_rank needs the job's rank_state_dir, got {self.rank_state_dir=}")
        old = self.cores[r]
        old.stop()
        old.join(10)
        old.coord.close()
        self.servers[r].stop(0)
        if before_start is not None:
            before_start()
        core, server, port = self._serve_rank(r, source, old.metrics, self.ports[r])
        assert port == self.ports[r]
        self.cores[r], self.servers[r] = core, server
        return core

    @property
    def address(self) -> str:
        """The coordinator's "host:port"."""
        return f"{HOST}:{self.port}"

    def rank_address(self, r: int) -> str:
        """Rank `r`'s service "host:port"."""
        return f"{HOST}:{self.ports[r]}"

    @property
    def coordinator_metrics_port(self) -> int:
        """The coordinator's metrics HTTP port (with metrics)."""
        return self.http[0][1]

    def rank_metrics_port(self, r: int) -> int:
        """Rank `r`'s metrics HTTP port (with metrics)."""
        return self.http[1 + r][1]

    def client(self, r: int = 0, reconnect_timeout_s: float = 5, **kwargs: Any) -> BatchClient:
        """A trainer client of rank `r` (`ClientOptions(reconnect_timeout_s=...)` unless `options` is given);
        `kwargs` go to `BatchClient`."""
        kwargs.setdefault("options", ClientOptions(reconnect_timeout_s=reconnect_timeout_s))
        return BatchClient(self.rank_address(r), r, self.spec.world_size, **kwargs)

    def payload(self, sample_id: int) -> dict[str, np.ndarray]:
        """The synthetic payload of `sample_id`, as the rank services produce it."""
        return synthetic_payload(sample_id, self.lengths[sample_id], self.spec.seed, self.vocab_size)

    def drain(
        self, limit_s: float = 60.0, project: Callable[[dict, Any], Any] | None = None, **client_kwargs: Any
    ) -> list[list[Any]]:
        """Consumes every rank's stream to its end, one trainer thread per rank.

        Args:
            limit_s: How long to wait for each trainer thread.
            project: Maps each received (batch, info) to what is kept; by default the pair itself.
            **client_kwargs: Passed to `client` (e.g. `security=`).

        Returns:
            Per rank, the projected steps in order. Asserts that no trainer raised and all finished.
        """
        return [epochs[0] for epochs in self.drain_epochs(1, limit_s, project, **client_kwargs)]

    def drain_epochs(
        self,
        epochs: int,
        limit_s: float = 60.0,
        project: Callable[[dict, Any], Any] | None = None,
        **client_kwargs: Any,
    ) -> list[list[list[Any]]]:
        """Like `drain`, through epochs 0..epochs-1 (`set_epoch` before each); per rank, per epoch,
        the steps."""
        return drain_clients(
            lambda r: self.client(r, **client_kwargs), self.spec.world_size, epochs, limit_s, project
        )

    def restart_coordinator(self) -> None:
        """Kills the coordinator abruptly (its server drops every call; nothing is flushed beyond what its
        journal already holds) and starts a new one on the same port from the same journal."""
        self.server.stop(0)
        self.state.close()
        self.server, port, self.state = create_server(
            self.address,
            self.spec,
            self.lease_s,
            self.startup_timeout_s,
            security=self.security,
            state_dir=self.coordinator_state_dir,
        )
        assert port == self.port
        self.server.start()

    def wait_state(self, state: str, limit_s: float = 30.0) -> None:
        """Waits until the coordinator's state is `state` ("done": every rank's trainer took its last step
        and the rank told the coordinator); fails naming what it saw instead."""
        deadline = time.monotonic() + limit_s
        while self.state.state != state:
            assert time.monotonic() < deadline, (
                f"the coordinator did not reach state {state!r} within {limit_s:g}s: "
                f"it is {self.state.state!r} ({self.state.failure or 'no failure'}; "
                f"finished ranks {sorted(self.state.liveness.finished)})"
            )
            time.sleep(0.05)

    def stop(self) -> None:
        """Stops the rank services, then the coordinator, then the metrics servers; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for core in self.cores:
            core.stop()
            core.coord.close()
        for s in self.servers:
            s.stop(0)
        if self.state is not None:
            self.state.close()
        if self.server is not None:
            self.server.stop(0)
        for srv, _ in self.http:
            stop_metrics_server(srv)

    def __enter__(self) -> InProcessJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def job_pool(**defaults: Any) -> Iterator[Callable[..., InProcessJob]]:
    """Yields `make(spec, lengths, **kwargs) -> InProcessJob` (`defaults` under `kwargs`); stops every job
    made on exit, also when the body raised."""
    made: list[InProcessJob] = []

    def make(*args: Any, **kwargs: Any) -> InProcessJob:
        made.append(InProcessJob(*args, **{**defaults, **kwargs}))
        return made[-1]

    try:
        yield make
    finally:
        for job in made:
            job.stop()
