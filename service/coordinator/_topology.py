"""Topology: which node agent serves which rank, checked as agents register, and the node index per rank.

A node agent (`batchd node`) registers all of its ranks at once (again after a restart). A rank that
another agent serves and that is still alive is refused (two agents configured with the same node
rank). Failures that name a rank name its agent ("node agent 'gpu-1' at 10.0.0.2:7100, ranks 4-7").
The plan sees the topology as a node index per rank (`node_indices`): nodes in order of their lowest
rank, a rank registered alone a node of its own; node-blind while no agent serves two ranks.

Pure functions over the coordinator's tables (`node_of`: rank -> agent name; `addresses`: rank ->
address); the caller holds its lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from batchd.core import Liveness, ProtocolError


def span(ranks: Sequence[int]) -> str:
    """ "4-7" for a contiguous run of ranks, else the list."""
    if ranks and list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return str(list(ranks))


def check_node_message(node: str, ranks: Sequence[int]) -> None:
    """Raises ValueError unless a node agent's hello names it and a non-empty set of distinct ranks."""
    if not node:
        raise ValueError("a node agent must give its name")
    if not ranks:
        raise ValueError(f"node agent {node!r} serves no rank")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"node agent {node!r} names a rank twice: {sorted(ranks)}")


def check_claim(
    node: str,
    ranks: Sequence[int],
    node_of: Mapping[int, str],
    addresses: Mapping[int, str],
    liveness: Liveness,
    now: float,
) -> None:
    """Raises ProtocolError if `node` claims a rank that another agent serves and that is alive at `now`
    (registered, unfinished, seen within its lease)."""
    for r in ranks:
        owner = node_of.get(r)
        seen = liveness.last_seen.get(r)
        if (
            owner is not None
            and owner != node
            and seen is not None
            and r not in liveness.finished
            and now - seen <= liveness.lease_s
        ):
            raise ProtocolError(
                f"node agent {node!r} claims rank {r}, which node agent {owner!r} at "
                f"{addresses.get(r)} serves and is alive: are two agents "
                f"configured with the same node rank?"
            )


def label_node(
    node: str, node_of: Mapping[int, str], addresses: Mapping[int, str], liveness: Liveness
) -> None:
    """Labels each rank `node` serves, so a failure naming one names the agent and its ranks."""
    ranks = sorted(r for r, n in node_of.items() if n == node)
    for r in ranks:
        liveness.label(r, f"node agent {node!r} at {addresses.get(r)}, ranks {span(ranks)}")


def node_indices(node_of: Mapping[int, str], world_size: int) -> list[int] | None:
    """The node index of every rank (nodes in order of their lowest rank; a rank registered alone is a
    node of its own), or None while no node agent serves two ranks (the plan is then node-blind)."""
    if not node_of or len(set(node_of.values())) == len(node_of):
        return None
    names = [node_of.get(r, f"\0rank-{r}") for r in range(world_size)]
    index: dict[str, int] = {}
    for name in names:
        index.setdefault(name, len(index))
    return [index[n] for n in names]
