"""The node agent (`batchd node`): the rank services of one host's trainer ranks in one process.

`NodeAgent` holds one `RankServiceCore` per local rank (each with its own round loop, journal, delivery
and trainer stream, exactly as a one-rank service), one gRPC server for all of them (requests name their
rank), and one `NodeLink`: the stream to the coordinator that carries all its ranks' reports and commits.
Samples a balanced plan moves between two of its ranks are handed over in process (`local_peers`); only
moves to other nodes are fetched over gRPC. `service._run_node.run_node` is the process around it (sources,
Ray, signals, exit status); tests build it in process.
"""

from __future__ import annotations

import os

from batchd.core import JobSpec
from batchd.proto import Security

from ._metrics import RankMetrics
from ._node_link import NodeLink
from .preprocess import Source
from .rank import RETAIN_BYTES, RankServiceCore, create_rank_server


class NodeAgent:
    """Serves the ranks of `sources` ({rank: its source}) as node agent `name` (see module docstring).

    `advertise` is the host peers reach it at (default `host`). `start()` starts the server, the link and
    the ranks' loops; `port` is then the bound port; `stop()` ends them all.
    """

    def __init__(
        self,
        spec: JobSpec,
        coordinator: str,
        name: str,
        sources: dict[int, Source],
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        state_dir: str | os.PathLike | None = None,
        client_grace_s: float = 600.0,
        security: Security | None = None,
        metrics: bool = False,
        trainer_timeout_s: float = 1800.0,
        startup_timeout_s: float = 600.0,
        retain_bytes: int = RETAIN_BYTES,
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
        self.spec, self.coordinator, self.name, self.ranks = spec, coordinator, name, ranks
        self.host, self.advertise, self.security = host, advertise, security
        self.startup_timeout_s = startup_timeout_s
        self.metrics = {r: RankMetrics(r) for r in ranks} if metrics else {}
        self.cores: dict[int, RankServiceCore] = {
            r: RankServiceCore(
                r,
                spec,
                None,
                sources[r],
                state_dir=state_dir,
                client_grace_s=client_grace_s,
                trainer_timeout_s=trainer_timeout_s,
                security=security,
                metrics=self.metrics.get(r),
                retain_bytes=retain_bytes,
            )
            for r in ranks
        }
        for core in self.cores.values():
            core.local_peers = {r: c for r, c in self.cores.items() if r != core.rank}
        self.server, self.port = create_rank_server(f"{host}:{port}", self.cores, security)
        self.address = f"{advertise or host}:{self.port}"
        self.link = NodeLink(
            coordinator,
            name,
            ranks,
            spec,
            self.address,
            startup_timeout_s=startup_timeout_s,
            security=security,
            journaled=all(core.journal is not None for core in self.cores.values()),
        )
        for r, core in self.cores.items():
            core.coord = self.link.client(r)
            if core.finished:  # restored after its trainer took the job's last step: it calls no more
                self.link.retire(r)

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
        then the ranks' loops and the link."""
        done = self.server.stop(grace)
        for core in self.cores.values():
            core.stop()
        self.link.close()
        done.wait()
