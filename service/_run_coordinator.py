"""`batchd coordinator`: the process around the alignment coordinator (`run_coordinator`).

It serves the coordinator's gRPC service (and its metrics, when asked) until every rank finished
(`Finish`), or the job failed: then it stays until every rank heard why, at most a lease. It returns 0
when done, 130 when interrupted by SIGINT and 143 by SIGTERM, and raises `JobFailed` naming the reason
when the job failed (`batchd coordinator: the job failed: ...`, exit 1). With `--state-dir` it journals
its state and a restart with the same command resumes; a journal of a finished job makes it exit 0 at once.
"""

from __future__ import annotations

import signal
import time

from batchd.core import JobFailed, JobSpec

from ._metrics import CoordinatorMetrics
from ._metrics_http import stop_metrics_server
from ._run_common import LINGER_S, log, start_metrics, stop_event, write_port_file
from ._service_config import Endpoint
from .coordinator import create_server


def run_coordinator(
    spec: JobSpec,
    endpoint: Endpoint | None = None,
    lease_s: float = 60.0,
    startup_timeout_s: float = 600.0,
    state_dir: str | None = None,
    resize: bool = False,
) -> int:
    """Serves `spec`'s coordinator at `endpoint` (host, port, port file, metrics, security; `advertise`
    unused) until the job ends, and returns the exit status (module docstring). `lease_s`: a party silent
    this long is gone; `startup_timeout_s`: how long it waits for every rank to register; `state_dir`: its
    journal; `resize`: resume the journal's job at `spec`'s world size. Raises ValueError naming the
    value on `resize` without `state_dir` or an `endpoint` that is not an `Endpoint`."""
    endpoint = Endpoint() if endpoint is None else endpoint
    if not isinstance(endpoint, Endpoint):
        raise ValueError(f"endpoint must be an Endpoint, got {endpoint=!r}")
    host, port, security = endpoint.host, endpoint.port, endpoint.security
    if resize and not state_dir:
        raise ValueError("--resize needs --state-dir: the journal of the job to resize")
    metrics = (
        CoordinatorMetrics(spec.world_size, spec.cost_model()) if endpoint.metrics_port is not None else None
    )
    server, bound, state = create_server(
        f"{host}:{port}",
        spec,
        lease_s,
        startup_timeout_s,
        security=security,
        metrics=metrics,
        state_dir=state_dir,
        resize=resize,
    )
    if state.job_done:
        log.warning(
            "the job in %s already finished; nothing to do (remove the state dir to run it again)", state_dir
        )
        state.close()
        return 0
    try:
        metrics_server, metrics_bound = start_metrics(
            metrics, endpoint.metrics_host, endpoint.metrics_port, "coordinator"
        )
    except OSError:
        state.close()
        raise
    stop = stop_event()  # before the port file says it serves: a signal then is a clean stop, never a kill
    server.start()
    write_port_file(endpoint.port_file, bound, metrics_bound)
    log.info(
        "coordinator listening on %s:%d for %d ranks (%s)%s",
        host,
        bound,
        spec.world_size,
        security.describe() if security else "plaintext",
        f", journal in {state_dir}" if state_dir else "",
    )
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
        return 143 if stop.signum == signal.SIGTERM else 130
    if state.state != "done":
        raise JobFailed(state.failure or "the job failed")
    return 0
