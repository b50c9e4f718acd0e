"""The coordinator process of benchmarks/node_latency.py: the real gRPC server, its `Node` handler wrapped
to timestamp each message as the handler takes it and as it hands the reply back; and `baseline_tree`,
another revision's package for a `--before` run (put first on that process's sys.path before batchd is
imported, so batchd is imported inside the functions here)."""

from __future__ import annotations

import inspect
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _node_sim import cpu_s, job_spec
from _report import REPO, format_profile, merged_stats


def _profile_threads(profiles: list) -> None:
    """From now on, each new thread of the process runs under its own cProfile (appended to `profiles`)."""
    import cProfile

    def install(frame, event, arg):  # first event of a new thread: hand over to a C profiler
        prof = cProfile.Profile(time.thread_time)
        profiles.append(prof)
        prof.enable()

    threading.setprofile(install)


class _Timings:
    """Per message on the Node streams: (kind, round, t_taken, t_replied); and the CPU time when the
    warm-up's last (`warmup` - 1) and the last measured (`total` - 1) round's totals leave."""

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup, self.total = warmup, total
        self.events: list[tuple] = []
        self.cpu_marks: dict[str, tuple[float, float]] = {}

    def record(self, kind, rnd, t_in) -> None:
        t_out = time.perf_counter()
        self.events.append((kind, rnd, t_in, t_out))
        if kind == "commit":
            mark = "start" if rnd == self.warmup - 1 else "end" if rnd == self.total - 1 else None
            if mark is not None and mark not in self.cpu_marks:
                self.cpu_marks[mark] = (cpu_s(), t_out)

    @staticmethod
    def taken_at(req) -> tuple:
        kind = req.WhichOneof("kind")
        rnd = req.align.round if kind == "align" else req.commit.round if kind == "commit" else -1
        return (kind, rnd, time.perf_counter())

    def wrap(self, orig_node):
        """`CoordinatorServicer.Node` timed: an async generator, or a sync one for an older revision."""
        record, taken_at = self.record, self.taken_at
        if inspect.isasyncgenfunction(orig_node):  # grpc.aio coordinator

            async def node(self, request_iterator, context):
                taken: list = [None]

                async def requests():
                    async for req in request_iterator:
                        taken[0] = taken_at(req)
                        yield req

                async for reply in orig_node(self, requests(), context):
                    record(*taken[0])
                    yield reply

            return node

        def sync_node(self, request_iterator, context):  # sync gRPC (an older revision, before/after runs)
            taken: list = [None]

            def requests():
                for req in request_iterator:
                    taken[0] = taken_at(req)
                    yield req

            for reply in orig_node(self, requests(), context):
                record(*taken[0])
                yield reply

        return sync_node


def _serve(conn, state) -> None:
    """Answers `status` on `conn` (round, CPU s, clock, latencies) until `stop`."""
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        if msg == "status":
            conn.send(
                {
                    "round": state.core.round,
                    "cpu_s": cpu_s(),
                    "t": time.perf_counter(),
                    "latencies_ms": list(state.latencies_ms),
                }
            )


def coordinator_main(
    conn, world_size: int, warmup: int, total: int, profile: bool, base: str | None = None
) -> None:
    """Runs the coordinator server until told to stop; records per-message times on the Node streams.
    `base`: a directory holding another revision's `batchd` package (`baseline_tree`) to run instead."""
    if base is not None:  # before anything imports batchd: this tree wins over the editable install
        sys.path.insert(0, base)
    import batchd.service as co
    from batchd.service import create_server

    profiles: list = []
    if profile:
        _profile_threads(profiles)
    timings = _Timings(warmup, total)
    co.CoordinatorServicer.Node = timings.wrap(co.CoordinatorServicer.Node)
    server, port, state = create_server(
        "127.0.0.1:0", job_spec(world_size), lease_s=120.0, startup_timeout_s=600.0
    )
    server.start()
    conn.send(port)
    _serve(conn, state)
    result: dict[str, Any] = {
        "latencies_ms": list(state.latencies_ms),
        "events": timings.events,
        "cpu_marks": timings.cpu_marks,
        "threads": threading.active_count(),
    }
    if profiles:
        threading.setprofile(None)
        stats = merged_stats(profiles)
        result["profile"] = format_profile(stats, 16) if stats is not None else ""
        result["profiled_threads"] = len(profiles)
    conn.send(result)
    state.close()
    server.stop(0)


def baseline_tree(rev: str) -> str:
    """Exports revision `rev` of this repository to a temporary directory laid out as the installed
    package (`batchd`, with `core`, `service`, `proto`, `client` inside); returns the directory to put
    first on sys.path (the coordinator process of `run_nodes(..., base=)`). Removed at exit."""
    import atexit
    import shutil
    import subprocess
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="node-latency-base-"))
    atexit.register(shutil.rmtree, root, True)
    src = root / "src"
    src.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True, timeout=60)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True, timeout=60)
    pkg = root / "pkg" / "batchd"
    shutil.copytree(src / "batchd", pkg)
    for sub in ("core", "service", "proto", "client"):
        (pkg / sub).symlink_to(src / sub, target_is_directory=True)
    return str(root / "pkg")
