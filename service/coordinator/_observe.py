"""The coordinator's per-round metrics (`batchd.service.CoordinatorMetrics`), updated once per barrier.

Metrics must never fail or stall the protocol: every update is guarded (an exception is logged, never
raised). Called under the state's lock, after the round's record is journaled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from batchd.core import RankCommit, RoundDecision, RoundTotals, plan_moves, round_exchanges

from .._metrics import CoordinatorMetrics

log = logging.getLogger("batchd.coordinator")


def _guarded(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        log.exception("metrics update failed")


def observe_decision(
    metrics: CoordinatorMetrics,
    decision: RoundDecision,
    topology: Sequence[int] | None,
    wait_s: float,
    decide_s: float,
) -> None:
    """A decided round: the wait for its reports (`wait_s`: first report -> last), the decision's time
    (`decide_s`), and for a plan the samples it moves and the images (clips) its vision (audio) plan
    exchanges, by node (`topology`, the node index per rank; None: every rank its own node)."""
    _guarded(metrics.observe_decision, wait_s, decide_s)
    if decision.plan is not None:
        plan = decision.plan
        _guarded(lambda: metrics.observe_moves(plan_moves(plan, topology)))
    if decision.vision is not None:
        vision = decision.vision
        _guarded(lambda: metrics.observe_exchanges(round_exchanges(vision, topology)))
    if decision.audio is not None:
        audio = decision.audio
        _guarded(lambda: metrics.observe_exchanges(round_exchanges(audio, topology), audio=True))


def observe_commit(
    metrics: CoordinatorMetrics, commits: Sequence[RankCommit], totals: RoundTotals, round_s: float
) -> None:
    """A committed round: what its ranks emitted, its totals, and its time (first report -> totals)."""
    _guarded(metrics.observe_commit, list(commits), totals, round_s)
