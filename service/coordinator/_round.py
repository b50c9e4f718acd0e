"""The round in progress at the coordinator: its messages until its barriers complete, and those barriers.

The seam with `CoordinatorState`: the state decides what a message means (epoch, round, replay, order)
and journals; `RoundInbox` only holds the current round's reports and commits (with their step sums),
when its first report came, and the pending barriers keyed ("align" | "commit", epoch, round), each
completed exactly once. It is used under the state's lock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from batchd.core import ProtocolError, RankCommit, RankReport, RoundDecision, RoundTotals

from ._barrier import Barrier

Sums = tuple[tuple[int, int, int], ...]  # per step of one commit: (samples, tokens, loss tokens)
BarrierKey = tuple[str, int, int]  # ("align" | "commit", epoch, round)


def one_round(msgs: Sequence[RankReport] | Sequence[RankCommit], what: str) -> int:
    """The one round of a message's reports / commits; ProtocolError on two rounds or a rank twice."""
    rounds = {m.round for m in msgs}
    if len(rounds) != 1:
        raise ProtocolError(
            f"one {what} message holds rounds {sorted(rounds)} of ranks "
            f"{sorted(m.rank for m in msgs)}; a message carries one round"
        )
    ranks = [m.rank for m in msgs]
    if len(set(ranks)) != len(ranks):
        raise ProtocolError(f"one {what} message names a rank twice: {sorted(ranks)}")
    return rounds.pop()


class RoundInbox:
    """The current round's messages by rank and the pending barriers (module docstring)."""

    def __init__(self) -> None:
        self.reports: dict[int, RankReport] = {}
        self.commits: dict[int, RankCommit] = {}
        self.sums: dict[int, Sums] = {}  # rank -> its commit's steps' sums, when it sent them
        self.started: float | None = None  # time.perf_counter() of the round's first report
        self._barriers: dict[BarrierKey, Barrier] = {}

    def clear(self) -> None:
        """Drops the messages (a new epoch, or a resize); the barriers stay."""
        self.reports.clear()
        self.commits.clear()
        self.sums.clear()

    def add_reports(self, reports: Sequence[RankReport]) -> None:
        if not self.reports:
            self.started = time.perf_counter()
        for report in reports:
            self.reports[report.rank] = report

    def add_commits(self, commits: Sequence[RankCommit], sums: Sequence[Sums] | None) -> None:
        for i, commit in enumerate(commits):
            self.commits[commit.rank] = commit
            if sums is not None:
                self.sums[commit.rank] = sums[i]
            else:
                self.sums.pop(commit.rank, None)

    def all_sums(self) -> dict[int, Sums] | None:
        """The commits' step sums when every commit came with them, else None (the core adds samples)."""
        return self.sums if len(self.sums) == len(self.commits) else None

    def barrier(self, key: BarrierKey) -> Barrier:
        """The pending barrier of `key` (made on first use)."""
        barrier = self._barriers.get(key)
        if barrier is None:
            barrier = self._barriers[key] = Barrier(key)
        return barrier

    def complete(self, key: BarrierKey, result: RoundDecision | RoundTotals) -> None:
        barrier = self._barriers.pop(key, None)
        if barrier is not None:
            barrier.complete(result)

    def complete_all(self, error: tuple[type[Exception], str]) -> None:
        """Completes every pending barrier with `error` (the job failed, or the coordinator closes)."""
        for barrier in self._barriers.values():
            barrier.complete(error=error)
        self._barriers.clear()
