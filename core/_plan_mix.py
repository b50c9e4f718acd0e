"""Mixing a round for optimizer updates of several steps: steps that hold what the sampler's stream holds.

With `JobSpec.tokens_per_update` an optimizer update spans a few consecutive steps and holds about G
loss tokens. Fixed batching's update is a random draw of the stream (B x K x N samples); a
token-budget plan is not, on its own: best-fit decreasing fills its first groups with the long
samples, the ranking emits complete groups first and holds the short samples back until they
complete a group or reach `max_wait`, so one update may hold a few dozen samples and the next well
over a hundred short ones, and the held-out loss after an epoch moves with that make-up
(docs/benchmarks.md, "update-replay"). Two pure steps give the updates the stream's make-up without
costing the round's balance:

- `mix_groups` (additive cost models): the round's `slots` groups filled from the pool's oldest
  samples (arrival round, then a seeded hash of the id: the stream's order, not the ranks'), taken
  while they fit in the round's `slots` x L, then longest processing time first: each sample,
  longest first, joins the least loaded group (ties: the group with fewer samples). Long samples land
  in different groups and the short ones fill around them. If that breaks a rule of the plan or
  costs balance or fill (below), the samples the plan chose are regrouped the same way instead, and
  if that fails too, the plan's own groups stay.
- `mix_order`: orders the round's rows (already shuffled) so that the running count of samples tracks
  the round's mean per step, so any run of consecutive steps holds about its share of them, whatever
  the number of steps an update takes. Rows are reordered, never changed. (Padded groups must stay
  length-homogeneous, so for the padded cost this is all the mixing there is.)

A mixed round is kept only if its steps leave at most `IDLE_SLACK` of their compute idle beyond the
unmixed plan's idle compute and hold at least (1 - `FILL_SLACK`) of its cost; a `final` round leaves
no sample the unmixed plan takes; every rank r gets at least its quota q_r of its own samples.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Mapping, Sequence

from ._cost import CostModel
from ._plan_inputs import PlanInputs
from ._policy import Entry, Group

_ORDER = operator.attrgetter("order")
IDLE_SLACK = 0.005  # the share of a round's compute mixing may leave idle beyond the unmixed plan's
FILL_SLACK = 0.01  # the share of the unmixed round's cost a mixed round may leave for later rounds
_HASH = 0x9E3779B1  # Knuth's multiplicative hash: a seeded, uniform order of ids within an arrival round


def stream_order(pool: Sequence[Entry], salt: int) -> list[Entry]:
    """The pool oldest first (`Entry.arrival`); within an arrival round by a hash of the id salted by
    `salt`, so that no rank's samples go first. O(P log P)."""
    return sorted(pool, key=lambda e: (e.arrival, ((e.sample.id ^ salt) * _HASH) & 0xFFFFFFFF, e.sample.id))


def mix_groups(
    inputs: PlanInputs,
    chosen: Sequence[Group],
    slots: int,
    quota: Mapping[int, int],
    salt: int = 0,
) -> list[Group] | None:
    """The round's groups mixed (module docstring): from the pool's oldest samples (`inputs.pool`),
    else from the samples of `chosen` (the unmixed plan's `slots` groups), each regrouped longest
    processing time first into exactly `slots` groups; None (keep `chosen`) when neither is kept or
    mixing does not apply (a non-additive `inputs.cost`, fewer samples than `slots`, a sample over
    `inputs.token_budget`). A `final` round keeps every sample of `chosen`. Deterministic. O(P log P)
    for P pooled samples."""
    pool, token_budget, cost = inputs.pool, inputs.token_budget, inputs.cost
    final, world_size = inputs.final, inputs.world_size
    if not cost.additive or slots < 1:
        return None
    base = [e for g in chosen for e in g]
    if len(base) < slots or any(cost.item(e.sample.length) > token_budget for e in pool):
        return None
    base_waste, _ = round_waste(chosen, world_size, cost)
    base_cost = sum(cost.item(e.sample.length) for e in base)
    for entries in (_fill(stream_order(pool, salt), slots * token_budget, cost), base):
        groups = lpt_groups(entries, slots, token_budget, cost)
        taken = [e for g in groups for e in g]
        if final and len(taken) < len(base):
            continue
        if len(taken) < slots or not _meets(taken, quota):
            continue
        waste, compute = round_waste(groups, world_size, cost)
        if waste > base_waste + IDLE_SLACK * compute:
            continue
        if sum(cost.item(e.sample.length) for e in taken) < (1 - FILL_SLACK) * base_cost:
            continue
        return groups
    return None


def _fill(ordered: Sequence[Entry], room: float, cost: CostModel) -> list[Entry]:
    """`ordered`'s entries, in order, each taken if it still fits in what is left of `room`. O(P)."""
    out: list[Entry] = []
    for e in ordered:
        c = cost.item(e.sample.length)
        if c <= room:
            out.append(e)
            room -= c
    return out


def _meets(entries: Sequence[Entry], quota: Mapping[int, int]) -> bool:
    kept = dict.fromkeys(quota, 0)
    for e in entries:
        if e.sample.home_rank in kept:
            kept[e.sample.home_rank] += 1
    return all(kept[r] >= q for r, q in quota.items())


def lpt_groups(entries: Sequence[Entry], slots: int, token_budget: int, cost: CostModel) -> list[Group]:
    """`entries` in exactly `slots` groups, longest processing time first: each sample, longest first,
    joins the least loaded group (ties: fewer samples, then lower index) if it fits under
    `token_budget`, else it is left out. Each group longest first. O(P log P)."""
    groups: list[Group] = [[] for _ in range(slots)]
    heap = [(0.0, 0, g) for g in range(slots)]  # (load, samples, group index)
    for e in sorted(entries, key=_ORDER):
        c = cost.item(e.sample.length)
        load, count, g = heap[0]
        if load + c <= token_budget:
            heapq.heapreplace(heap, (load + c, count + 1, g))
            groups[g].append(e)
    return groups


def mix_order(counts: Sequence[int]) -> list[int]:
    """A permutation of range(len(counts)) such that the prefix sums of `counts` in that order stay
    close to k x mean: at each position, the row that brings the running deviation nearest 0 (the
    earliest in the given order among ties, so the given seeded shuffle breaks them). O(R^2) for R
    rows (R <= the round's capacity)."""
    n = len(counts)
    if n < 3:
        return list(range(n))
    mean = sum(counts) / n
    left = list(range(n))
    out: list[int] = []
    dev = 0.0
    while left:
        best = min(range(len(left)), key=lambda j: (abs(dev + counts[left[j]] - mean), j))
        i = left.pop(best)
        dev += counts[i] - mean
        out.append(i)
    return out


def round_waste(groups: Sequence[Group], world_size: int, cost: CostModel) -> tuple[float, float]:
    """`rows_waste` of the round's steps when `groups` are sorted by cost and cut into rows of
    `world_size` (the plan's deal). O(G log G)."""
    ordered = sorted(groups, key=lambda g: -cost.cost([e.sample.length for e in g]))
    rows = [ordered[i : i + world_size] for i in range(0, len(ordered), world_size)]
    return rows_waste(rows, world_size, cost)


def rows_waste(rows: Sequence[Sequence[Group]], world_size: int, cost: CostModel) -> tuple[float, float]:
    """(idle, compute) of steps dealt as `rows`: compute, the sum over rows of `world_size` x the row's
    costliest group; idle, compute minus every group's cost. O(G)."""
    costs = [[cost.cost([e.sample.length for e in g]) for g in row] for row in rows]
    compute = sum(world_size * max(c) for c in costs if c)
    return compute - sum(c for row in costs for c in row), compute
