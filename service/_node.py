"""The node agent (`batchd node`): the rank services of one host's trainer ranks in one process.

`NodeAgent` holds one `RankServiceCore` per local rank (each with its own round loop, journal, delivery
and trainer stream, exactly as a one-rank service), one gRPC server for all of them (requests name their
rank), and one `NodeLink`: the stream to the coordinator that carries all its ranks' reports and commits.
Samples a balanced plan moves between two of its ranks are handed over in process (`local_peers`); only
moves to other nodes are fetched over gRPC. `service._run_node.run_node` is the process around it (sources,
Ray, signals, exit status); tests build it in process.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import cast

from batchd.core import JobSpec

from ._coord_client import CoordinatorClient
from ._metrics import RankMetrics
from ._node_link import NodeLink
from ._service_config import Endpoint
from .preprocess import Source
from .rank import Limits, RankServiceCore, create_rank_server

StateDir = str | os.PathLike[str] | None
JOIN_S = 10.0  # `NodeAgent.stop` waits this long for each of its threads (they poll every 0.5 s)
log = logging.getLogger("batchd.node")


class NodeAgent:
    """Serves the ranks of `sources` ({rank: its source}) as node agent `name` (see module docstring).

    `endpoint` (default `Endpoint()`): its host and port, `advertise` (the host peers reach it at; default
    the host) and security (its port file and metrics are the process's: `run_node`); `limits` (default
    `Limits()`) and `state_dir` (its ranks' journals) go to each rank's core; `metrics`: keep each rank's
    `RankMetrics` (`self.metrics`). `start()` starts the server, the link and the ranks' loops; `port` is
    then the bound port; `stop()` ends them all.
    """

    def __init__(
        self,
        spec: JobSpec,
        coordinator: str,
        name: str,
        sources: dict[int, Source],
        endpoint: Endpoint | None = None,
        limits: Limits | None = None,
        state_dir: StateDir = None,
        metrics: bool = False,
    ) -> None:
        ranks = sorted(sources)
        bad = [r for r in ranks if not 0 <= r < spec.world_size]
        if not ranks or bad:
            raise ValueError(
                f"a node agent's ranks must lie in 0..{spec.world_size - 1} (world_size="
                f"{spec.world_size}), got {ranks}"
            )
        if not name:
            raise ValueError(f"a node agent needs a name, got {name=}")
        endpoint = Endpoint() if endpoint is None else endpoint
        limits = Limits() if limits is None else limits
        self.spec, self.coordinator, self.name, self.ranks = spec, coordinator, name, ranks
        self.host, self.advertise, self.security = endpoint.host, endpoint.advertise, endpoint.security
        self.startup_timeout_s = limits.startup_timeout_s
        self.metrics = {r: RankMetrics(r) for r in ranks} if metrics else {}
        self.cores: dict[int, RankServiceCore] = {
            r: self._core(r, spec, sources[r], limits, state_dir) for r in ranks
        }
        for core in self.cores.values():
            core.local_peers = {r: c for r, c in self.cores.items() if r != core.rank}
        bind = f"{endpoint.host}:{endpoint.port}"
        self.server, self.port = create_rank_server(bind, self.cores, self.security)
        self.address = f"{endpoint.advertise or endpoint.host}:{self.port}"
        self.link = NodeLink(
            coordinator,
            name,
            ranks,
            spec,
            self.address,
            startup_timeout_s=limits.startup_timeout_s,
            security=self.security,
            journaled=all(core.journal is not None for core in self.cores.values()),
        )
        for r, core in self.cores.items():
            core.coord = cast(CoordinatorClient, self.link.client(r))  # the same interface, for its ranks
            if core.finished:  # restored after its trainer took the job's last step: it calls no more
                self.link.retire(r)

    def _core(
        self, rank: int, spec: JobSpec, source: Source, limits: Limits, state_dir: StateDir
    ) -> RankServiceCore:
        """Rank `rank`'s service core, its coordinator client set once the link is up (`__init__`)."""
        return RankServiceCore(
            rank,
            spec,
            cast(CoordinatorClient, None),
            source,
            state_dir=state_dir,
            limits=limits,
            security=self.security,
            metrics=self.metrics.get(rank),
        )

    def start(self) -> None:
        self.server.start()
        for core in self.cores.values():
            core.start(self.address)

    @property
    def failure(self) -> str | None:
        for core in self.cores.values():
            if core.failure is not None:
                return core.failure
        return None

    @property
    def finished(self) -> bool:
        """Every rank's trainer took the job's last step (and left)."""
        for core in self.cores.values():
            with core.cond:
                if not (core.finished and core.delivery.holder is None):
                    return False
        return True

    @property
    def restored_finished(self) -> bool:
        return all(core.restored_finished for core in self.cores.values())

    def stop(self, grace: float = 1.0) -> None:
        """Stops the server (its trainers' streams end as a disconnect: they reconnect to a restarted agent),
        then the ranks' loops and the link, and waits for their threads (up to `JOIN_S` each).

        The wait matters at exit: a thread still inside a gRPC call when the interpreter finalizes is ended
        holding that call's lock, and the call's finalizer then waits on the lock forever (a node agent
        that never exited after its job, CI)."""
        done = self.server.stop(grace)
        for core in self.cores.values():
            core.stop()
        self.link.close()
        done.wait()
        for core in self.cores.values():
            core.join(JOIN_S)
        stuck = [t.name for t in self.link.join(JOIN_S)]
        if stuck:
            log.warning("node agent %r: %s still running %gs after it stopped", self.name, stuck, JOIN_S)
        # A gRPC call raised is its own exception object: held in a traceback cycle, only the collector
        # frees it, and run at interpreter exit its finalizer can wait forever on the call's lock (held by
        # a gRPC thread the finalization ended). Collected here, gRPC's threads are still running.
        gc.collect()
