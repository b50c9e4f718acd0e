"""One node's view of a round's decision, and a round's vision traffic by node.

A node agent serves several ranks over one coordinator stream. Of a balanced plan it needs all of its
own ranks' steps, and of every other rank only what its ranks lend (the samples whose home is one of its
ranks: it sends their data); of a two-phase vision plan, all of its own ranks' exchanges, and of every
other rank's only the images its ranks own (their encoders fetch them). `decision_for_node` cuts a
decision down to that; pure, so the coordinator serializes the view once per node and round.

`round_exchanges` sums `exchanged` (images and embedding rows crossing a rank, intra- / cross-node)
over a round's steps: the coordinator's per-round vision metrics.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ._align import RoundDecision
from ._exchange import Exchange
from ._phases import exchanged
from ._types import Sample

_NO_EXCHANGE = ("intra_node_images", "intra_node_rows", "cross_node_images", "cross_node_rows")


def _lent(steps: Sequence[Sequence[Sample]], mine: Collection[int]) -> tuple[tuple[Sample, ...], ...]:
    """Another rank's steps, each cut to the samples whose home is one of `mine` (the step stays,
    maybe empty, so every rank keeps its step count)."""
    return tuple(tuple(s for s in group if s.home_rank in mine) for group in steps)


def _fetched(rank: int, exchanges: Sequence[Exchange], mine: Collection[int]) -> tuple[Exchange, ...]:
    """Another rank's exchanges, each cut to the images it encodes whose home is one of `mine` (only
    `encode` travels: the other rank's own LLM-side fields are none of this node's business)."""
    return tuple(
        Exchange(rank, x.world_size, tuple(im for im in x.encode if im.home_rank in mine)) for x in exchanges
    )


def decision_for_node(decision: RoundDecision, ranks: Collection[int]) -> RoundDecision:
    """`decision` as the node serving `ranks` needs it.

    Returns `decision` itself when it has no plan (a target-only decision is the same for everyone).
    Else a decision of the same round and target whose plan (and vision and audio, when set) holds every
    rank:
    the ranks in `ranks` whole; every other rank's groups (exchanges) cut to the samples (images) whose
    `home_rank` is in `ranks`, keeping each rank's step count. Invariants (tested): the union over the
    nodes of a partition of the ranks is the whole plan, and each rank's part appears whole in exactly
    its own node's view. O(samples + images); `ranks` should be a set for O(1) membership.
    """
    if decision.plan is None:
        return decision
    plan = tuple(tuple(steps) if r in ranks else _lent(steps, ranks) for r, steps in enumerate(decision.plan))
    vision, audio = (
        None
        if phase is None
        else tuple(tuple(x) if r in ranks else _fetched(r, x, ranks) for r, x in enumerate(phase))
        for phase in (decision.vision, decision.audio)
    )
    return RoundDecision(decision.round, decision.target, plan, vision, audio)


def round_exchanges(vision: Sequence[Sequence[Exchange]], topology: Sequence[int] | None) -> dict[str, int]:
    """`exchanged` summed over a round's steps (`vision[rank][step]`), every key present (zeros for a
    round without steps). `topology[r]`: the node of rank r (None: every rank its own node)."""
    total: dict[str, int] = {}
    for step in zip(*vision, strict=False):
        for key, value in exchanged(step, topology).items():
            total[key] = total.get(key, 0) + value
    return total or dict.fromkeys(_NO_EXCHANGE, 0)
