"""`batchd rank`: one rank service in its own process (`run_rank`): the node agent's path with one rank.

A rank service serves its trainer until the trainer has taken the last batch of the last epoch (it then
tells the coordinator: `Finish`), or the job failed (after a short linger so its trainer reads the
failure message). Exit status 0 done, 1 job failed, 130 interrupted. With a state dir it journals its
state (the rank journal, `service/rank/_journal.py`, as every rank service core writes it) and a restart
with the same command resumes.

It is `_run_node.serve_ranks` with one rank (its sources: `_rank_source`), as node agent "rank-<r>": a
name of its own, so the coordinator sees each rank service as a node of its own (node-blind, as one-rank
processes always were) and takes a restarted one for the same party. Where it differs from `batchd node
--local-ranks 1`: it registers at its own host (0.0.0.0 stays 0.0.0.0, as before: no other address is
looked up), and its stats file is the path given (`{rank}` filled in), without the ".rank<r>" a node agent
adds.
"""

from __future__ import annotations

import dataclasses

from batchd.core import JobSpec

from ._run_node import serve_ranks
from ._service_config import ServiceConfig


def run_rank(spec: JobSpec, rank: int, coordinator: str, config: ServiceConfig | None = None) -> int:
    """`batchd rank`: serves rank `rank` of the job whose coordinator is at `coordinator` (module docstring)
    until its trainer took the job's last step, or the job failed; returns the exit status. `config`
    (default `ServiceConfig()`): its source, endpoint, limits, state dir and stats file."""
    config = ServiceConfig() if config is None else config
    endpoint = config.endpoint
    if endpoint.advertise is None:  # peers reach a rank service where it listens, as they always did
        config = dataclasses.replace(config, endpoint=dataclasses.replace(endpoint, advertise=endpoint.host))
    stats_file = config.stats_file
    return serve_ranks(
        spec,
        [rank],
        coordinator,
        config,
        f"rank-{rank}",
        lambda r: stats_file.format(rank=r) if stats_file and "{rank}" in stats_file else stats_file,
    )
