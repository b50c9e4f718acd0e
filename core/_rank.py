"""The per-rank DGAP state machine: buffer, grouping, split/overflow/recirculation, IDLE, step info.

Life of a round on one rank (the coordinator side is `batchd.core.Coordinator`):

    push(sample)*  ->  report(capacity)  ->  apply(decision)  ->  finalize(totals)  ->  [Step] * T'

- `push` admits a sample into the window (at most `window` samples). A sample whose lone cost exceeds
  L_max follows the over-budget policy: `singleton` (default; it forms a group alone and is counted),
  `truncate` (cut to the longest length that fits, counted) or `reject` (not admitted; kept in
  `rejected` with a reason). None of them raises or drops silently.
- `report` forms candidate groups with the policy and says how many it has.
- `apply` takes the decision's T: keeps the policy's top T groups (overflow recirculates, i.e. simply
  stays in the window for the next round), splits if it has fewer (only under the `odb` rule), and
  pads with IDLE. For `balanced` it emits the coordinator's plan and drops its own samples that the
  plan placed anywhere. The emitted groups are shuffled with a generator seeded by
  (seed, epoch, round, rank): the order of steps never follows length.
- `finalize` turns groups into `Step`s with exact global totals and the loss scale, after the
  non-join quota cut (cut samples return to the window).

`state_dict()` is JSON-safe, taken between rounds, and stores rank, world size, seed and epoch; loading
a state from another rank, world size, seed, epoch, policy or token budget fails with a message that says
which.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from ._align import ProtocolError, RankCommit, RankReport, RoundDecision, RoundTotals
from ._cost import CostModel
from ._exchange import Exchange
from ._loss import loss_scale
from ._policy import Entry, Group
from ._state import (
    K_BUDGET,
    K_BUFFER,
    K_COUNTERS,
    K_EPOCH,
    K_EXHAUSTED,
    K_POLICY,
    K_RANK,
    K_REJECTED,
    K_ROUND,
    K_SEED,
    K_STEP,
    K_VERSION,
    K_WORLD,
    STATE_VERSION,
    check_state,
)
from ._step import Step, StepInfo
from ._types import Sample, check_int
from ._updates import update_scale

if TYPE_CHECKING:
    from ._spec import JobSpec


def max_fitting_length(token_budget: int, cost: CostModel) -> int:
    """The longest length whose lone cost is within `token_budget` (the `truncate` target)."""
    if cost.name != "attention":
        return token_budget
    q = cost.quadratic
    n = int((-q + math.sqrt(q * q + 4 * q * token_budget)) / 2)  # n + n^2/q <= token_budget
    while n > 1 and cost.item(n) > token_budget:
        n -= 1
    while cost.item(n + 1) <= token_budget:
        n += 1
    return max(n, 1)


def fill_may_stop(
    room: int, exhausted: bool, buffered: int, deterministic: bool, past_deadline: bool
) -> bool:
    """Whether a rank may stop filling its window and report, at a moment its source has no sample ready.

    Always once the window is full (`room == 0`) or its source is exhausted. Otherwise, by default, once
    it holds a sample or the fill's deadline passed: the window is whatever the source had ready, so it
    follows the speed of preprocessing. In deterministic mode (`JobSpec.deterministic`) never: the rank
    waits for the source (liveness, a failure or a stop, ends the wait; a speed deadline does not), so
    the window's content is a function of the source's order alone.
    """
    if room <= 0 or exhausted:
        return True
    return not deterministic and (buffered > 0 or past_deadline)


class RankState:
    """One rank's side of the protocol (see module docstring).

    Args:
        spec: The job (world size, policy, token budget, cost model, window, over-budget policy, seed).
        rank: This rank.
        epoch: The epoch (also seeds the emission order).
    """

    def __init__(self, spec: JobSpec, rank: int, epoch: int = 0) -> None:
        check_int("rank", rank, lo=0, hi=spec.world_size - 1)
        self.spec = spec
        self.rank, self.world_size, self.policy = rank, spec.world_size, spec.policy_object()
        self.token_budget = spec.token_budget
        self.cost = spec.cost_model()
        self.window, self.over_budget = spec.policy.window, spec.policy.over_budget
        self.seed, self.epoch = spec.seed, epoch
        self._truncate_to = max_fitting_length(self.token_budget, self.cost)
        self.buffer: list[Entry] = []
        self._ids: set[int] = set()
        self.round = 0
        self.step = 0
        self.exhausted = False
        self.unread: int | None = None  # samples the source still holds this epoch (`set_unread`)
        self.rejected: list[tuple[int, str]] = []
        self._rejected_ids: set[int] = set()
        self.counters = {"admitted": 0, "over_budget": 0, "truncated": 0, "rejected": 0, "moved_in": 0}
        self._candidates: list[Group] | None = None
        self._emitted: list[list[Sample]] | None = None
        self.phases = spec.phases.count
        self._vision: list[Exchange] | None = None  # this round's exchanges (phases=2), one per emitted step
        self._audio: list[Exchange] | None = None  # the same for the audio phase, when the round has clips
        self.update_denominator = spec.update_denominator()  # D of the loss scale (`_updates`), or None

    def start_at(self, round_: int, step: int) -> None:
        """Starts this fresh rank mid-epoch after a resize (`batchd.core._resize`): its first round is
        `round_` and its first step `step` (S), with an empty window. Raises ProtocolError on a rank
        that already took part in a round or holds samples."""
        if self.round or self.step or self.buffer or self._candidates is not None:
            raise ProtocolError(f"rank {self.rank}: start_at on a rank already at round {self.round}")
        check_int("round", round_, lo=0)
        check_int("step", step, lo=0)
        self.round, self.step = round_, step

    # -- input ---------------------------------------------------------------------------------------
    @property
    def truncate_length(self) -> int:
        """The length a sample is cut to under the `truncate` policy."""
        return self._truncate_to

    @property
    def room(self) -> int:
        """Free places in the window."""
        return self.window - len(self.buffer)

    def push(self, sample: Sample, truncated_loss_tokens: int | None = None) -> str:
        """Admits one sample; returns "ok", "over_budget" (singleton), "truncated" or "rejected".

        Under `truncate`, the sample keeps its first `truncate_length` tokens; pass the loss tokens of
        that prefix as `truncated_loss_tokens` when the caller knows them (the daemon recounts them
        from the truncated labels); otherwise min(loss_tokens, new length) is assumed.
        """
        if (
            self._candidates is not None
            or self.exhausted
            or len(self.buffer) >= self.window
            or sample.id in self._ids
        ):
            self._refuse(sample)
        outcome = "ok"
        if sample.length > self._truncate_to:  # cheaper than cost.item() for the common case
            if self.over_budget == "reject":
                reason = (
                    f"length {sample.length} costs {self.cost.item(sample.length):g} "
                    f"> token_budget {self.token_budget}"
                )
                self.rejected.append((sample.id, reason))
                self._rejected_ids.add(sample.id)
                self.counters["rejected"] += 1
                return "rejected"
            if self.over_budget == "truncate":
                n = self._truncate_to
                k = min(sample.loss_tokens, n) if truncated_loss_tokens is None else truncated_loss_tokens
                sample = Sample(sample.id, n, k, sample.home_rank, sample.modality_tokens)
                self.counters["truncated"] += 1
                outcome = "truncated"
            else:
                self.counters["over_budget"] += 1
                outcome = "over_budget"
        self.buffer.append(Entry(sample, self.round))
        self._ids.add(sample.id)
        self.counters["admitted"] += 1
        return outcome

    def was_rejected(self, sample_id: int) -> bool:
        """True when `sample_id` was quarantined by the `reject` policy this epoch."""
        return sample_id in self._rejected_ids

    def rejected_all(self, view_size: int) -> bool:
        """True when every id of a view of `view_size` distinct ids has been rejected."""
        return len(self._rejected_ids) >= view_size

    def holds(self, sample_id: int) -> bool:
        """True when `sample_id` is in the window."""
        return sample_id in self._ids

    def _refuse(self, sample: Sample) -> None:
        if self._candidates is not None:
            raise ProtocolError(f"rank {self.rank}: push during round {self.round}; push between rounds")
        if self.exhausted:
            raise ProtocolError(
                f"rank {self.rank}: push of sample {sample.id} after its source was exhausted"
            )
        if len(self.buffer) >= self.window:
            raise ProtocolError(f"rank {self.rank}: window of {self.window} samples is full")
        raise ProtocolError(f"rank {self.rank}: sample id {sample.id} is already buffered")

    def mark_exhausted(self) -> None:
        """The source has no more samples for this epoch."""
        self.exhausted = True
        self.unread = 0

    def set_unread(self, unread: int | None) -> None:
        """How many samples the source still holds this epoch beyond the window (None: unknown), sent
        with the next report: node-local rounds share out the nodes' remaining work by it."""
        if unread is not None:
            check_int("unread", unread, lo=0)
        self.unread = unread

    # -- round ---------------------------------------------------------------------------------------
    def report(self, capacity: int) -> RankReport:
        """Forms candidate groups and reports them (phase 1)."""
        check_int("capacity", capacity, lo=0)
        if self._emitted is not None:
            raise ProtocolError(f"rank {self.rank}: report before round {self.round} was finalized")
        if self.policy.pooled:
            self._candidates = []
            pool = tuple((e.sample, e.arrival) for e in self.buffer)
            groups = 1 if self.buffer else 0
        else:
            rng = random.Random(f"rank:{self.seed}:{self.epoch}:{self.round}:{self.rank}")
            self._candidates = self.policy.candidates(
                self.buffer, self.token_budget, self.cost, self.round, rng, self.exhausted
            )
            pool, groups = (), len(self._candidates)
        return RankReport(
            self.rank, self.round, capacity, len(self.buffer), groups, self.exhausted, pool, self.unread
        )

    def apply(self, decision: RoundDecision) -> RankCommit:
        """Emits the decision's T groups (overflow recirculates, splits if needed, IDLE pads)."""
        if self._candidates is None:
            raise ProtocolError(f"rank {self.rank}: decision for round {decision.round} before a report")
        if decision.round != self.round:
            raise ProtocolError(
                f"rank {self.rank}: decision for round {decision.round}, expected {self.round}"
            )
        target = decision.target
        if self.policy.pooled:
            if decision.plan is None or len(decision.plan) != self.world_size:
                raise ProtocolError(
                    f"rank {self.rank}: balanced round {self.round} needs a plan for every rank"
                )
            self._remove(decision.planned_ids)
            emitted = [list(g) for g in decision.plan[self.rank]]
            self.counters["moved_in"] += sum(s.home_rank != self.rank for g in emitted for s in g)
            for name, phase in (("vision", decision.vision), ("audio", decision.audio)):
                if phase is not None and (
                    len(phase) != self.world_size or len(phase[self.rank]) != len(emitted)
                ):
                    raise ProtocolError(
                        f"rank {self.rank}: round {self.round}'s {name} plan does not match its "
                        f"plan (one exchange per rank and step)"
                    )
            if decision.vision is not None:
                self._vision = list(decision.vision[self.rank])
            if decision.audio is not None:
                self._audio = list(decision.audio[self.rank])
        else:
            groups, _rest = self.policy.fit(self._candidates, target, self.cost) if target else ([], [])
            if self.policy.shuffle:
                random.Random(f"emit:{self.seed}:{self.epoch}:{self.round}:{self.rank}").shuffle(groups)
            emitted = [[e.sample for e in g] for g in groups[:target]]
            self._remove({s.id for g in emitted for s in g})
        emitted += [[] for _ in range(target - len(emitted))]
        self._emitted = emitted
        if self._vision is None and self.phases == 2:
            raise ProtocolError(f"rank {self.rank}: a two-phase round {self.round} without a vision plan")
        self._candidates = None
        steps = tuple(tuple((s.length, s.loss_tokens) for s in g) for g in emitted)
        ids = tuple(tuple(s.id for s in g) for g in emitted)
        return RankCommit(self.rank, self.round, steps, len(self.buffer), self.exhausted, ids)

    def finalize(self, totals: RoundTotals) -> list[Step]:
        """Builds the round's steps with exact totals and loss scales (phase 2)."""
        if self._emitted is None or totals.round != self.round:
            raise ProtocolError(f"rank {self.rank}: totals for round {totals.round} out of order")
        emitted = self._emitted
        kept = emitted[: totals.steps]
        back = [s for g in emitted[totals.steps :] for s in g]
        if totals.keep_last is not None and kept:
            k = totals.keep_last[self.rank]
            back += kept[-1][k:]
            kept[-1] = kept[-1][:k]
        for s in back:  # quota cut: the samples return to the window
            self.buffer.append(Entry(s, self.round))
            self._ids.add(s.id)
        # An epoch's closing IDLE step (`UpdateWindows.closing_step`): more steps than were emitted.
        kept += [[] for _ in range(totals.steps - len(kept))]
        denom = self.update_denominator
        update, update_step = totals.update_first, totals.update_open_steps
        out = []
        for j, group in enumerate(kept):
            lengths = [s.length for s in group]
            tokens = sum(lengths)
            loss_tokens = sum(s.loss_tokens for s in group)
            end, window_loss = totals.ends(j)
            info = StepInfo(
                rank=self.rank,
                step=self.step,
                round=self.round,
                is_idle=not group,
                local_samples=len(group),
                local_tokens=tokens,
                local_loss_tokens=loss_tokens,
                global_samples=totals.step_samples[j],
                global_tokens=totals.step_tokens[j],
                global_loss_tokens=totals.step_loss_tokens[j],
                loss_scale=(
                    loss_scale(loss_tokens, totals.step_loss_tokens[j], self.world_size)
                    if denom is None
                    else self.world_size * loss_tokens / denom
                ),
                cost=self.cost.cost(lengths),
                update=update,
                update_step=update_step,
                update_end=end,
                update_scale=update_scale(denom, window_loss) if end else 1.0,
                update_loss_tokens=window_loss if end else 0,
                token_budget=self.spec.token_budget,
            )
            out.append(
                Step(
                    tuple(group),
                    info,
                    self._step_exchange(self._vision, j),
                    self._step_exchange(self._audio, j),
                )
            )
            update, update_step = (update + 1, 0) if end else (update, update_step + 1)
            self.step += 1
        self._emitted = None
        self._vision = self._audio = None
        self.round += 1
        return out

    def _step_exchange(self, phase: list[Exchange] | None, j: int) -> Exchange | None:
        if phase is None:
            return None
        return phase[j] if j < len(phase) else Exchange(self.rank, self.world_size)

    def _remove(self, ids: AbstractSet[int]) -> None:
        """Drops the buffered samples whose id is in `ids`. O(buffer)."""
        if ids:
            kept = [e for e in self.buffer if e.sample.id not in ids]
            if len(kept) != len(self.buffer):
                self._ids.difference_update(e.sample.id for e in self.buffer if e.sample.id in ids)
                self.buffer = kept

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state between rounds."""
        if self._candidates is not None or self._emitted is not None:
            raise ProtocolError(
                f"rank {self.rank}: state_dict() inside round {self.round}; take it between rounds"
            )
        return {
            K_VERSION: STATE_VERSION,
            K_RANK: self.rank,
            K_WORLD: self.world_size,
            K_SEED: self.seed,
            K_EPOCH: self.epoch,
            K_POLICY: self.policy.name,
            K_BUDGET: self.token_budget,
            K_ROUND: self.round,
            K_STEP: self.step,
            K_EXHAUSTED: self.exhausted,
            K_BUFFER: [[e.sample.to_json(), e.arrival] for e in self.buffer],
            K_REJECTED: [list(r) for r in self.rejected],
            K_COUNTERS: dict(self.counters),
        }

    @staticmethod
    def budget_in(state: Mapping[str, Any]) -> int:
        """The token budget a `state_dict()` was made under."""
        return int(state[K_BUDGET])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a `state_dict()`; refuses a state of another rank, world size, seed, epoch, policy or
        token_budget (ValueError naming each field that differs)."""
        expect = {
            K_RANK: self.rank,
            K_WORLD: self.world_size,
            K_SEED: self.seed,
            K_EPOCH: self.epoch,
            K_POLICY: self.policy.name,
            K_BUDGET: self.token_budget,
        }
        check_state(state, expect, f"RankState(rank={self.rank})")
        self.epoch, self.round, self.step = state[K_EPOCH], state[K_ROUND], state[K_STEP]
        self.exhausted = state[K_EXHAUSTED]
        self.unread = 0 if self.exhausted else None  # the source sets it again before the next report
        self.buffer = [Entry(Sample.from_json(s), a) for s, a in state[K_BUFFER]]
        self._ids = {e.sample.id for e in self.buffer}
        self.rejected = [(int(i), str(r)) for i, r in state[K_REJECTED]]
        self._rejected_ids = {i for i, _ in self.rejected}
        self.counters = dict(state[K_COUNTERS])
        self._candidates = self._emitted = None
