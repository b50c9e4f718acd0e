"""What the three process entry points (`_run_coordinator`, `_run_rank`, `_run_node`) share.

Each entry point binds port 0 when asked (tests, the demo) and writes the bound port (and the metrics
port) to its port file (`write_port_file`: JSON, replaced atomically). It serves Prometheus metrics when
given a metrics port (`start_metrics`), stops on SIGTERM or SIGINT (`stop_event`), and exits on its
own once its job is done or failed. After a failure it lingers (`LINGER_S`, `linger_until_told`) so
every party reads the failure message; a Ray lost while the sources start fails the job at once
(`ray_lost_at_start`). For all three: they return 0 when done, 130 when interrupted (the coordinator 143 on
SIGTERM), and raise `JobFailed` naming the reason when the job failed (`batchd CMD: the job failed: ...`,
exit 1).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from batchd.core import JobFailed, JobSpec
from batchd.proto import Security

from ._coord_client import CoordinatorClient
from ._metrics_http import start_metrics_server
from .preprocess import RayLost

if TYPE_CHECKING:
    from ._metrics import CoordinatorMetrics, RankMetrics
    from .rank import RankServiceCore

log = logging.getLogger("batchd")
LINGER_S = 2.0
RESTORED_LINGER_S = 10.0


def write_port_file(path: str | os.PathLike[str] | None, port: int, metrics_port: int | None = None) -> None:
    """Writes `{"port", "pid"}` (and `"metrics_port"` when given) as JSON to `path`, when given: to a
    temporary file first, then renamed over `path`, so a reader never sees it half written."""
    if path:
        p = Path(path)
        tmp = p.with_suffix(p.suffix + ".tmp")
        info: dict[str, int] = {"port": port, "pid": os.getpid()}
        if metrics_port is not None:
            info["metrics_port"] = metrics_port
        tmp.write_text(json.dumps(info))
        os.replace(tmp, p)


def check_port_free(host: str, port: int | None, what: str) -> None:
    """Raises OSError naming `what`, host:port and the process that listens there (Linux: from /proc) when
    the port cannot be bound; nothing for port 0 or None (any free port). A service calls it before it
    starts or joins Ray: a second agent started on a running job's config fails at once on its port, instead
    of joining that job's Ray and waiting for actors its CPUs cannot hold."""
    if not port:
        return
    bind_host = host.strip("[]") or "0.0.0.0"
    family = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no owner
        try:
            probe.bind((bind_host, port))
        except OSError as exc:
            holder = port_holder(port)
            by = f" by {holder}" if holder else ""
            raise OSError(
                f"{what} port {port} on {host} is in use{by} ({exc.strerror}): is a service of this job "
                f"already running? Stop it, or give this one another port"
            ) from None


def port_holder(port: int) -> str | None:
    """'pid N (its command line)' of the process listening on TCP `port` (Linux /proc; None when unknown,
    e.g. another user's process or no /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table, encoding="ascii") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                    inodes.add(f"socket:[{cols[9]}]")  # 0A: LISTEN
    for pid in (p for p in os.listdir("/proc") if p.isdigit()) if inodes else ():
        with contextlib.suppress(OSError):
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                return f"pid {pid} ({cmd})" if cmd else f"pid {pid}"
    return None


def start_metrics(
    metrics: RankMetrics | CoordinatorMetrics | None, host: str, port: int | None, who: str
) -> tuple[Any, int | None]:
    """Serves `metrics.registry` on host:port (0 = a free port) when `port` (and `metrics`) is given:
    (server, bound), else (None, None)."""
    if port is None or metrics is None:
        return None, None
    server, bound = start_metrics_server(metrics.registry, host, port)
    log.info("%s: Prometheus metrics on http://%s:%d/metrics", who, host, bound)
    return server, bound


class StopEvent(threading.Event):
    """Set by SIGTERM or SIGINT (`stop_event`); `signum` is the first of them that came (None before)."""

    def __init__(self) -> None:
        super().__init__()
        self.signum: int | None = None

    def stop(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
        self.set()


def stop_event() -> StopEvent:
    """An event that SIGTERM and SIGINT set (the handlers are this process's from now on): the serving
    loops poll it and exit with status 130 when it was set before their job ended."""
    stop = StopEvent()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.stop(signum))
    return stop


def linger_until_told(cores: Sequence[RankServiceCore], stop: threading.Event, grace_s: float) -> None:
    """After the job failed: stays LINGER_S, then until every rank's trainer heard why (ABORTED, or a
    RankStatus that said it), at most `grace_s`: a trainer still starting when the job failed would find
    no service and wait out its start-up timeout instead of failing with the message that names the
    cause."""
    deadline = time.monotonic() + max(grace_s, LINGER_S)
    stop.wait(LINGER_S)
    while not all(c.failure_told for c in cores) and time.monotonic() < deadline and not stop.wait(0.2):
        pass


def ray_lost_at_start(
    coordinator: str, ranks: list[int], spec: JobSpec, security: Security | None, lost: RayLost
) -> NoReturn:
    """The Ray went away while the ranks' sources were starting: tells the coordinator (so the other ranks
    and the trainers learn at once, naming it) and raises `JobFailed` naming it (a failed job, status 1)."""
    client = CoordinatorClient(coordinator, ranks[0], spec, security=security)
    try:
        client.fail(str(lost))
    finally:
        client.close()
    raise JobFailed(f"rank {ranks[0]}: {lost}")
