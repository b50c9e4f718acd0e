"""An out-of-memory step: the lowered token budget, journaled, and the restart that goes on at it.

1. A trainer whose step ran out of memory reports it (`Oom`, through its rank service). The coordinator
   lowers the job's budget (`batchd.core.lowered_budget`), journals a `budget` record naming the resize
   generation that goes on at it, and fails the job with a message that names the step and both budgets:
   a step that failed on one rank failed on every rank (their collectives cannot complete), so the ranks
   go back to the trainers' checkpoint together. The other ranks' reports of that step get the same budget.
2. The job restarts: `python -m batchd.train --elastic` under torchrun does it by itself (the worker that
   failed ends its group, torchrun starts a new one, which starts the services again); otherwise every
   party is started again with the same commands. The coordinator finds the record newer than its resize
   generation and makes the restart a resize to the same world size at the lowered budget (`_resize`):
   the trainers' checkpoint step S fixes where the epoch goes on, the steps from S on (the failed one
   among them) are dealt again at the new budget, every sample once.
3. Every rank plans and reports at the journaled budget: `RegisterReply.token_budget` carries it, each
   `StepInfo.token_budget` says it to the trainers. The journal's header keeps the configured job, so the
   same commands (their configured budget) still match it; a later resize keeps the lowered budget.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from batchd.core import JobSpec, lowered_budget

from . import _recovery as recovery


def at_budget(spec: JobSpec, budget: dict[str, Any] | None) -> JobSpec:
    """`spec` at the journaled lowered budget (`budget`, a `budget` record; None: `spec` itself)."""
    return spec if budget is None else dataclasses.replace(spec, token_budget=int(budget["token_budget"]))


def configured(spec: JobSpec, token_budget: int) -> JobSpec:
    """`spec` at the configured budget: what the parties' commands and the journal's header say."""
    return dataclasses.replace(spec, token_budget=token_budget)


def restored(spec: JobSpec, got: recovery.Recovered) -> JobSpec:
    """`spec` at the budget the journaled generation ran at (the records `got`): the lowered one, or, while
    that lowering waits for its restart, the one it was lowered from."""
    if got.budget is None:
        return spec
    generation = int(got.resize["generation"]) if got.resize is not None else 0
    key = "from" if pending(got.budget, generation) else "token_budget"
    return dataclasses.replace(spec, token_budget=int(got.budget[key]))


def pending(budget: dict[str, Any] | None, generation: int) -> bool:
    """A lowered budget no resize went on at yet (the job is at resize generation `generation`)."""
    return budget is not None and int(budget["generation"]) > generation


def report(
    budget: dict[str, Any] | None,
    spec: JobSpec,
    generation: int,
    rank: int,
    at: tuple[int, int],
    cost: float,
) -> tuple[dict[str, Any] | None, str]:
    """Rank `rank`'s step `at` (epoch, step) of planned cost `cost` ran out of memory under the job `spec`
    at resize generation `generation`, with `budget` the newest lowering: (the `budget` record to journal,
    or None when it holds already or none is possible; the job's failure message)."""
    epoch, step = at
    what = f"rank {rank}'s trainer ran out of memory on epoch {epoch} step {step} (planned cost {cost:g})"
    now = spec.token_budget
    if pending(budget, generation):  # another rank's report of the same failure lowered it already
        assert budget is not None
        return None, _message(what, int(budget["from"]), int(budget["token_budget"]))
    if cost > now:  # planned under a higher budget than the job's now: the restart re-plans it anyway
        return None, f"{what}, a step over today's token budget {now}: the job restarts at it"
    try:
        new = lowered_budget(now, cost)
    except ValueError as exc:
        return None, f"{what}: {exc}"
    return recovery.budget_record(new, now, generation + 1, rank, epoch, step, cost), _message(what, now, new)


def _message(what: str, old: int, new: int) -> str:
    return (
        f"{what}: the token budget goes from {old} to {new} for every step not yet trained; the job goes on "
        f"from the trainers' checkpoint once restarted (`python -m batchd.train --elastic` under torchrun "
        f"restarts it by itself; otherwise start every party again with the same commands)"
    )
