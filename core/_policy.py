"""Grouping policies: how one rank turns its buffered window into candidate groups.

A policy answers three questions for the rank state machine (`RankState`):
- `candidates`: the groups it would form from the window, most worth emitting first;
- `fit`: given the round's target T, which T groups leave now (overflow: the rest recirculate into the
  buffer) or, if it has fewer than T, how to split (only the `odb` alignment rule ever asks for more);
- `shuffle`: whether the emitted groups leave in a seeded random order (no length curriculum).

Policies:
- `odb`: ODB 0.1.2, faithful: its grouping rule, its overflow choice (keep the groups with the most
  samples), its split (peel the longest sample off the last multi-sample group) and its target rule.
- `local`: never moves a sample off its rank. Count-optimal grouping for the cost model, then it emits
  the groups closest to the best group their length class allows (`CostModel.quality`) and keeps the
  worst ones back so new arrivals can complete them; a sample that has waited `max_wait` rounds leaves
  first; complete groups leave in seeded random order. Paired with the `min` rule, it never splits.
- `balanced`: groups are planned by the coordinator over every rank's window (`batchd.core.plan_round`);
  ranks only ship metadata and emit the plan.
- `fixed` / `sorted`: fixed batch size B baselines, in arrival order or length-sorted within the window.
"""

from __future__ import annotations

import dataclasses
import operator
import random
from collections.abc import Sequence

from ._choices import ALIGN_RULES, POLICIES
from ._cost import CostModel
from ._grouping import (
    best_fit_decreasing,
    contiguous_greedy,
    fixed_chunks,
    odb_greedy,
    odb_split,
    split_largest,
)
from ._types import Sample, check_choice, check_int


class Entry:
    """A buffered sample and the round it arrived in (its age drives `max_wait`).

    `order` is the longest-first sort key, computed once on arrival (windows are re-sorted each round).
    """

    __slots__ = ("sample", "arrival", "order")

    def __init__(self, sample: Sample, arrival: int) -> None:
        self.sample = sample
        self.arrival = arrival
        self.order = (-sample.length, sample.id)

    def __repr__(self) -> str:
        return f"Entry({self.sample!r}, {self.arrival})"


Group = list[Entry]
_ORDER = operator.attrgetter("order")
_ARRIVAL = operator.attrgetter("arrival")


def _desc(entries: Sequence[Entry]) -> list[Entry]:
    return sorted(entries, key=_ORDER)


def form_groups(entries: Sequence[Entry], token_budget: int, cost: CostModel) -> list[Group]:
    """Count-optimal groups of `entries` under `token_budget` for `cost`, each listed longest first."""
    ordered = _desc(entries)
    lengths = [e.sample.length for e in ordered]
    if cost.additive:
        idx = best_fit_decreasing([cost.item(n) for n in lengths], token_budget)
    else:
        idx = contiguous_greedy(lengths, token_budget)
    return [[ordered[i] for i in g] for g in idx]


def group_lengths(group: Sequence[Entry]) -> list[int]:
    return [e.sample.length for e in group]


@dataclasses.dataclass(frozen=True)
class Policy:
    """A grouping policy (see module docstring), built from the job's `PolicySpec` (whose fields hold
    the defaults).

    Attributes:
        name: One of `POLICIES`.
        batch_size: B of the `fixed` and `sorted` baselines.
        max_wait: Rounds after which a buffered sample leaves with the next emitted groups.
        align: Target rule: `min` (batchd's) or `odb` (ODB 0.1.2's); `odb` policy forces `odb`.
        refine: `balanced` only: shrink the capacity of the round's groups by binary search so they cost
            about the same (lowers the slowest rank's cost per step).
    """

    name: str
    batch_size: int
    max_wait: int
    align: str
    refine: bool

    def __post_init__(self) -> None:
        check_choice("policy", self.name, POLICIES)
        check_int("batch_size", self.batch_size, lo=1)
        check_int("max_wait", self.max_wait, lo=1)
        check_choice("align", self.align, ALIGN_RULES)
        if self.name == "odb" and self.align != "odb":
            object.__setattr__(self, "align", "odb")

    @property
    def pooled(self) -> bool:
        """True when the coordinator plans the groups from every rank's window (`balanced`)."""
        return self.name == "balanced"

    @property
    def shuffle(self) -> bool:
        """Emitted groups leave in a seeded random order (all but `fixed`, whose stream is random)."""
        return self.name != "fixed"

    @property
    def enforces_budget(self) -> bool:
        return self.name not in ("fixed", "sorted")

    def candidates(
        self,
        entries: Sequence[Entry],
        token_budget: int,
        cost: CostModel,
        now: int,
        rng: random.Random,
        exhausted: bool = False,
    ) -> list[Group]:
        """Candidate groups of a window, most worth emitting first (`rng` breaks ties, seeded per round).

        `exhausted`: no sample will arrive any more, so holding incomplete groups back gains nothing.
        """
        if not entries:
            return []
        if self.name == "fixed":
            ordered = sorted(entries, key=lambda e: e.arrival)  # stable: arrival, then buffer order
            return [[ordered[i] for i in g] for g in fixed_chunks(len(ordered), self.batch_size)]
        if self.name == "sorted":
            ordered = _desc(entries)
            groups = [[ordered[i] for i in g] for g in fixed_chunks(len(ordered), self.batch_size)]
            rng.shuffle(groups)  # like length-grouped samplers: batches of similar length, random order
            return sorted(groups, key=lambda g: min(e.arrival for e in g))  # stable: oldest first
        if self.name == "odb":
            ordered = _desc(entries)
            costs = [cost.item(e.sample.length) for e in ordered]
            groups = [[ordered[i] for i in g] for g in odb_greedy(costs, token_budget)]
            groups.reverse()  # ODB's own order: shortest group first
            return groups
        groups = form_groups(entries, token_budget, cost)
        return rank_groups(groups, token_budget, cost, now, self.max_wait, rng, exhausted)

    def fit(self, groups: list[Group], target: int, cost: CostModel) -> tuple[list[Group], list[Entry]]:
        """Chooses the `target` groups to emit; returns (emitted groups, recirculated entries)."""
        if len(groups) < target:
            return self._split(groups, target, cost), []
        if self.name == "odb":
            # ODB keeps the groups with the most samples; ties go to earlier (shorter) groups.
            keep = set(sorted(range(len(groups)), key=lambda j: (-len(groups[j]), j))[:target])
            emit = [g for j, g in enumerate(groups) if j in keep]
            rest = [e for j, g in enumerate(groups) if j not in keep for e in g]
            return emit, rest
        return groups[:target], [e for g in groups[target:] for e in g]

    def _split(self, groups: list[Group], target: int, cost: CostModel) -> list[Group]:
        if self.name == "odb":
            idx = odb_split(_index_groups(groups), target)
            flat = [e for g in groups for e in g]
            return [[flat[i] for i in g] for g in idx]
        idx_groups = _index_groups(groups)
        flat = [e for g in groups for e in g]
        idx = split_largest(idx_groups, target, key=lambda g: cost.cost([flat[i].sample.length for i in g]))
        return [[flat[i] for i in g] for g in idx]


def _index_groups(groups: Sequence[Group]) -> list[list[int]]:
    """Re-expresses groups as index lists into their flattened concatenation (each longest first)."""
    out, i = [], 0
    for g in groups:
        out.append(list(range(i, i + len(g))))
        i += len(g)
    return out


def rank_groups(
    groups: list[Group],
    token_budget: int,
    cost: CostModel,
    now: int,
    max_wait: int,
    rng: random.Random,
    exhausted: bool = False,
) -> list[Group]:
    """Orders groups for emission.

    1. groups holding a sample that has waited `max_wait` rounds, oldest first (bounded latency);
    2. complete groups (`CostModel.complete`: waiting cannot improve them) in seeded random order,
       so the order of steps does not follow length (no length curriculum);
    3. incomplete groups, best `CostModel.quality` first: these are the ones worth holding back, since
       new arrivals may complete them. Once the source is `exhausted` nothing will arrive, and they
       count as complete (holding them back would only push short tails to the end of the epoch).
    """
    tiebreak = list(range(len(groups)))
    rng.shuffle(tiebreak)
    # Ages only matter when the window's oldest sample has waited max_wait rounds (rare): skip them.
    check_age = bool(groups) and now - min(min(map(_ARRIVAL, g)) for g in groups) >= max_wait
    padded = cost.name == "padded"

    def key(j: int) -> tuple[int, float, int]:
        g = groups[j]
        if check_age:
            age = now - min(map(_ARRIVAL, g))
            if age >= max_wait:
                return (0, -age, tiebreak[j])
        if exhausted:
            return (1, 0.0, tiebreak[j])
        if padded:  # groups are longest first: rows == floor(L / longest) means complete
            longest = g[0].sample.length
            if longest > token_budget or len(g) >= token_budget // longest:
                return (1, 0.0, tiebreak[j])
            return (2, -cost.quality(group_lengths(g), token_budget), tiebreak[j])
        lengths = group_lengths(g)
        if cost.complete(lengths, token_budget):
            return (1, 0.0, tiebreak[j])
        return (2, -cost.quality(lengths, token_budget), tiebreak[j])

    return [groups[j] for j in sorted(range(len(groups)), key=key)]
