"""A plan's topology: node indices per rank, a sample's bytes, and the moves a plan makes.

Shared by the planners (`_plan_blind`, `_plan_nodes`), the coordinator (`_align`), the simulator and
the daemon's metrics. Pure functions; no planning here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._types import Sample, check_int

if TYPE_CHECKING:
    from ._step import Step


def sample_bytes(sample: Sample) -> int:
    """Bytes a sample carries when it moves: its `nbytes` if known (> 0), else 8 x length (int32
    input_ids + labels)."""
    return sample.nbytes if sample.nbytes > 0 else 8 * sample.length


def check_nodes(nodes: Sequence[int], world_size: int) -> list[int]:
    """Returns `nodes` as a list if it holds one node index (an int >= 0) per rank; ValueError otherwise.

    Node indices need not be contiguous or start at 0 (`[5, 5, 2, 2]` is two nodes). O(world_size).
    """
    if isinstance(nodes, str | bytes) or not isinstance(nodes, Sequence):
        raise ValueError(f"nodes must be a sequence of node indices, one per rank, got {nodes=!r}")  # noqa: TRY004
    if len(nodes) != world_size:
        raise ValueError(f"nodes must hold one node index per rank ({world_size=}), got {len(nodes)=}")
    for r, v in enumerate(nodes):
        check_int(f"nodes[{r}]", v, lo=0)
    return list(nodes)


def plan_moves(
    plan: Sequence[Sequence[Sequence[Sample]]], nodes: Sequence[int] | None = None
) -> dict[str, int]:
    """Counts the samples (and their bytes, `sample_bytes`) a plan places off their home rank.

    `plan[rank][step]` is a group of samples (empty = IDLE), as `plan_round` returns it; `nodes[r]` is
    the node of rank r (None: every rank is its own node, so every move is cross-node). A sample placed
    on a rank other than its home rank moves intra-node when both ranks share a node, cross-node
    otherwise (a home rank outside the plan's ranks counts as cross-node). O(samples in the plan).

    Returns:
        {"intra_node_samples", "intra_node_bytes", "cross_node_samples", "cross_node_bytes"}.
    """
    n = len(plan)
    where = check_nodes(nodes, n) if nodes is not None else list(range(n))
    intra = intra_bytes = cross = cross_bytes = 0
    for rank, steps in enumerate(plan):
        node = where[rank]
        for group in steps:
            for s in group:
                home = s.home_rank
                if home == rank:
                    continue
                if home < n and where[home] == node:
                    intra += 1
                    intra_bytes += sample_bytes(s)
                else:
                    cross += 1
                    cross_bytes += sample_bytes(s)
    return {
        "intra_node_samples": intra,
        "intra_node_bytes": intra_bytes,
        "cross_node_samples": cross,
        "cross_node_bytes": cross_bytes,
    }


def step_fetches(step: Sequence[Step], nodes: Sequence[int] | None = None) -> dict[str, int]:
    """Counts the payloads the ranks of one aligned step fetch from other ranks (`step[rank]`): per rank,
    the distinct samples of `Step.payload_refs` whose home is another rank: the LLM samples moved to it
    and, two-phase, the samples of the images and clips it encodes for another rank. Intra-node when the
    home rank shares the rank's node (`nodes` as in `plan_moves`), cross-node otherwise. O(refs).

    Returns:
        {"intra_node_fetched", "cross_node_fetched"}.
    """
    n = len(step)
    where = check_nodes(nodes, n) if nodes is not None else list(range(n))
    intra = cross = 0
    for rank, s in enumerate(step):
        homes = {i: home for i, home in s.payload_refs() if home != rank}
        for home in homes.values():
            if home < n and where[home] == where[rank]:
                intra += 1
            else:
                cross += 1
    return {"intra_node_fetched": intra, "cross_node_fetched": cross}
