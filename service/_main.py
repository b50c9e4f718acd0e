"""Process entry points: `batchd coordinator` and `batchd rank` (one process each).

Both bind port 0 when asked (tests, the demo), print/write the bound port, and exit on their own:
the coordinator once the epoch is done or the job failed, a rank service once its trainer has taken
the last batch or the job failed (after a short linger so every party reads the failure message).
Exit status: 0 done, 1 job failed, 130 interrupted.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from ._coord_client import CoordinatorClient
from ._coordinator import create_server
from ._rank_service import RankServiceCore, create_rank_server
from ._sources import IngestSource, SyntheticSource
from ._spec import JobSpec

log = logging.getLogger("batchd")
LINGER_S = 2.0


def write_port_file(path: str | os.PathLike | None, port: int) -> None:
    if path:
        p = Path(path)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
        os.replace(tmp, p)


def _stop_event() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def run_coordinator(spec: JobSpec, host: str = "127.0.0.1", port: int = 0, port_file: str | None = None,
                    lease_s: float = 30.0, round_timeout_s: float = 120.0) -> int:
    server, bound, state = create_server(f"{host}:{port}", spec, lease_s, round_timeout_s)
    server.start()
    write_port_file(port_file, bound)
    log.info("coordinator listening on %s:%d for %d ranks", host, bound, spec.world_size)
    stop = _stop_event()
    try:
        while not stop.wait(0.2):
            if state.state in ("done", "failed"):
                time.sleep(LINGER_S)
                break
    finally:
        state.close()
        server.stop(1.0).wait()
    if stop.is_set() and state.state == "running":
        return 130
    return 0 if state.state == "done" else 1


def run_rank(spec: JobSpec, rank: int, coordinator: str, lengths: list[int] | None, host: str = "127.0.0.1",
             port: int = 0, port_file: str | None = None, state_dir: str | None = None,
             client_grace_s: float = 30.0, vocab_size: int = 512) -> int:
    if lengths is None:
        source = IngestSource(spec.window)
    else:
        source = SyntheticSource(lengths, rank, spec.world_size, spec.seed, 0, spec.shuffle, vocab_size,
                                 wrap=spec.mode == "non-join")
    coord = CoordinatorClient(coordinator, rank, spec)
    core = RankServiceCore(rank, spec, coord, source, state_dir=state_dir, client_grace_s=client_grace_s)
    server, bound = create_rank_server(f"{host}:{port}", core)
    server.start()
    core.start(f"{host}:{bound}")
    write_port_file(port_file, bound)
    log.info("rank %d service listening on %s:%d", rank, host, bound)
    stop = _stop_event()
    status = 0
    try:
        while not stop.wait(0.2):
            with core.cond:
                failed = core.failure is not None
                drained = core.done and core.delivered_end and core._clients == 0
            if failed:
                status = 1
                time.sleep(LINGER_S)
                break
            if drained:
                break
    finally:
        core.stop()
        coord.close()
        server.stop(1.0).wait()
    if stop.is_set() and not core.done:
        return 130
    return status
