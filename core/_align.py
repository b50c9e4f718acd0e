"""DGAP alignment: the round messages, the target rules and the coordinator's state machine.

A round has two barriers (one RPC each in the daemon, plain calls in the simulator):

    ranks --RankReport-->  Coordinator.decide  --RoundDecision(T)-->  ranks
    ranks --RankCommit-->  Coordinator.commit  --RoundTotals------->  ranks -> T' steps each

`decide` fixes the number of steps T every rank emits this round; `commit` learns the exact token
counts of what each rank emitted (after splits) so every step carries exact loss-scale totals, and it
closes the epoch: join mode when every rank is exhausted and empty, non-join mode when the cumulative
sample count reaches the quota (the last step is cut so the count is exact).

Target rules. Each rank r reports C_r (free output slots), B_r (buffered samples) and G_r (candidate
groups); "active" ranks hold at least one group. Whatever the rule, every rank emits exactly T steps,
IDLE ones when it has no group left.

- `odb` (`align = "odb"`; the `odb` policy always uses it) is ODB's max-target protocol, the rule of
  the ODB package (online-dynamic-batching 0.1.2, `odb.grouping`), which batchd offers as is:

      T = max(1, min(max G_r, min positive C_r, min positive B_r))

  and no step at all (T = 0) in a round where some rank has no free slot. It is the seed paper's
  bidirectional max-based alignment: T starts from the largest group count; ranks with fewer groups
  split toward singletons, ranks with more overflow into the next round. The paper's prose gives the
  target as max(min positive C_r, min positive B_r); read literally, that exceeds every rank's output
  capacity whenever buffers hold more samples than output queues have slots, and the package caps it
  as above. One difference of setting, not of rule: the package takes min C_r over the ranks still
  iterating (a drained rank stops, and the user wraps training in `Join`); batchd takes it over every
  rank, since a drained batchd rank emits IDLE steps. Properties (tested): capacity: T <= C_r for
  every rank; split feasibility: T <= B_r for every active rank, so a rank below T can split up to T.
- `min` (batchd's default): T = min(min over active ranks of G_r, min over all ranks of C_r).
  It differs from ODB's rule on purpose:
  - no splits: every active rank has >= T groups, so no rank ever splits (a split turns a group into
    under-full steps that waste the token budget); ranks with more groups overflow, which only defers
    samples into the next window;
  - equal token rate per rank: every rank emits T full groups per round, so ranks consume their
    streams at the same token rate and finish together, the best any policy that keeps samples on
    their rank can do;
  - capacity bound by construction: T <= C_r for every rank, drained ones included (they emit IDLE
    steps, so no trainer needs `Join`); a rank with no free slot makes T = 0 by itself, where ODB's
    rule needs a skip test on top of its floor of 1.
  Properties (tested): capacity as above; progress: T >= 1 whenever some rank holds data and every
  C_r >= 1, so each such round emits >= 1 sample per active rank and an epoch of n samples takes at
  most max_r n_r rounds and max_r n_r steps per rank (join); equal steps: every rank emits exactly T.
- `balanced` plans the round itself (`plan_round`, no target rule) and keeps the same bound: each
  round of T steps emits >= min(T, B_r) of every rank's buffered samples, and T never exceeds the
  window, so a join epoch takes at most max_r n_r steps (proof in docs/design/balancing.md; tested).

Measured steps, splits and IDLE steps under both rules: docs/benchmarks.md (Batching quality, config B).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._encoders import EncoderCost
from ._exchange import Exchange
from ._ledger import StepLedger
from ._phases import plan_vision_round
from ._plan import PlanInputs, plan_round
from ._plan_moves import check_nodes
from ._policy import Entry
from ._state import (
    K_BUDGET,
    K_EMITTED,
    K_EPOCH,
    K_MODE,
    K_POLICY,
    K_QUOTA,
    K_ROUND,
    K_SEED,
    K_VERSION,
    K_WORLD,
    STATE_VERSION,
    check_state,
)
from ._types import Sample, check_int

# plans one round's exchange of an encoder phase: (plan[rank][step], its cost, nodes) -> [rank][step]
PhasePlanner = Callable[
    [Sequence[Sequence[Sequence[Sample]]], EncoderCost, Sequence[int] | None],
    tuple[tuple[Exchange, ...], ...],
]

if TYPE_CHECKING:
    from ._resize import ResumePoint
    from ._spec import JobSpec


class ProtocolError(ValueError):
    """A message that breaks the round protocol (wrong round, missing or duplicate rank, bad phase)."""


@dataclasses.dataclass(frozen=True)
class RankReport:
    """What a rank tells the coordinator at the start of a round.

    Attributes:
        rank: The reporting rank.
        round: The round it reports for.
        capacity: Free output slots (steps it can queue for its trainer now).
        buffered: Samples in its window.
        groups: Candidate groups it formed from the window.
        exhausted: Its source has no more samples this epoch.
        pool: `balanced` only: its buffered samples and their arrival rounds.
        unread: Samples its source still holds this epoch, not yet in its window (None: unknown, e.g.
            non-join mode's endless views); node-local rounds share out the nodes' remaining work by it.
    """

    rank: int
    round: int
    capacity: int
    buffered: int
    groups: int
    exhausted: bool
    pool: tuple[tuple[Sample, int], ...] = ()
    unread: int | None = None


@dataclasses.dataclass(frozen=True)
class RoundDecision:
    """The coordinator's answer: T steps this round, and for `balanced` the whole plan[rank][step]; with
    `phases=2` also vision[rank][step], each rank's part of the step's vision exchange (`plan_vision`),
    and when some sample of the round has audio clips audio[rank][step], the audio encoder's exchange
    (`plan_phase` with `AudioCost`; None: no clip in the round, every rank encodes nothing)."""

    round: int
    target: int
    plan: tuple[tuple[tuple[Sample, ...], ...], ...] | None = None
    vision: tuple[tuple[Exchange, ...], ...] | None = None
    audio: tuple[tuple[Exchange, ...], ...] | None = None

    @functools.cached_property
    def planned_ids(self) -> frozenset[int]:
        """The ids of every sample in `plan` (empty without one), computed once per decision: each rank
        (a node agent holds several) removes its planned samples in O(its buffer), not O(plan)."""
        if self.plan is None:
            return frozenset()
        return frozenset(s.id for steps in self.plan for group in steps for s in group)


@dataclasses.dataclass(frozen=True)
class RankCommit:
    """What a rank emitted this round: per step, the (length, loss_tokens) of each sample (IDLE: ()),
    and `ids`, per step the samples' ids in the same order (for the coordinator's `StepLedger`; empty
    from a peer that does not send them: the ledger then cannot serve a resize)."""

    rank: int
    round: int
    steps: tuple[tuple[tuple[int, int], ...], ...]
    remaining: int
    exhausted: bool
    ids: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class RoundTotals:
    """Closes a round: the steps every rank keeps (T' <= T), per-step global totals, and termination.

    `keep_last[r]`, when set, is how many samples rank r keeps in its last step (non-join quota cut).
    `update_first`, `update_open_steps`, `update_end`, `update_loss_tokens`: where the epoch's
    optimizer updates end (`UpdateEnds`; with `tokens_per_update` / `samples_per_update`); empty
    tuples, from a peer or a journal that predates them, mean every step ends an update with its own
    loss tokens.
    """

    round: int
    steps: int
    step_samples: tuple[int, ...]
    step_tokens: tuple[int, ...]
    step_loss_tokens: tuple[int, ...]
    done: bool
    keep_last: tuple[int, ...] | None = None
    update_first: int = 0
    update_open_steps: int = 0
    update_end: tuple[bool, ...] = ()
    update_loss_tokens: tuple[int, ...] = ()

    def ends(self, j: int) -> tuple[bool, int]:
        """Step j's (update ends here, the ended update's global loss tokens)."""
        if not self.update_end:
            return True, self.step_loss_tokens[j]
        return self.update_end[j], self.update_loss_tokens[j]


def target_min(reports: Sequence[RankReport]) -> int:
    """batchd's rule (module docstring); 0 means "no step this round"."""
    active = [r.groups for r in reports if r.groups > 0]
    if not active:
        return 0
    return max(min(min(active), min(r.capacity for r in reports)), 0)


def target_odb(reports: Sequence[RankReport]) -> int:
    """ODB 0.1.2's rule (module docstring); 0 means "skip": some considered rank has no free slot."""
    active = [r for r in reports if r.groups > 0]
    if not active:
        return 0
    if min(r.capacity for r in reports) <= 0:
        return 0
    caps = [r.capacity for r in reports if r.capacity > 0]
    bufs = [r.buffered for r in active if r.buffered > 0]
    return max(1, min(max(r.groups for r in active), min(caps), min(bufs)))


_RULES = {"min": target_min, "odb": target_odb}


def _unread(reports: Sequence[RankReport]) -> tuple[int, ...] | None:
    """Per rank (rank order) the samples its source still holds; None unless every rank knows it."""
    if any(r.unread is None for r in reports):
        return None
    return tuple(int(r.unread) for r in reports)  # type: ignore[arg-type]


class Coordinator:
    """The alignment coordinator's pure state machine for one epoch (see module docstring)."""

    def __init__(
        self,
        spec: JobSpec,
        epoch: int = 0,
        nodes: Sequence[int] | None = None,
        vision_nodes: Sequence[int] | None = None,
    ) -> None:
        """`nodes[r]`: the node index of rank r (`balanced` plans node-aware, `plan_round`); None plans
        node-blind. `vision_nodes` (phases=2; default `nodes`): the topology the vision plan keeps
        embeddings inside (`plan_vision`), which does not change the LLM plan. The topology is not part
        of `state_dict` (the daemon owns it). Raises ValueError on a `nodes` or `vision_nodes` without one
        int >= 0 per rank.

        `vision_planner` and `audio_planner` (attributes; default `plan_vision_round` with the spec's
        `phases.exact_nodes`) plan a round's exchange of the vision phase and, when the round has clips, of
        the audio phase (each phase on its own, N-phase balancing); the simulator wraps the vision one to
        time it."""
        spec.check_daemon()
        exact_nodes = spec.phases.exact_nodes
        if exact_nodes:
            try:
                import scipy.optimize  # noqa: F401  (the exact option's solver, imported on first use)
            except ImportError as exc:
                raise ValueError(
                    f"phases.exact_nodes={exact_nodes} needs scipy: pip install 'batchd[exact]'"
                ) from exc
        planner: PhasePlanner = functools.partial(plan_vision_round, exact_nodes=exact_nodes)
        self.vision_planner: PhasePlanner = planner
        self.audio_planner: PhasePlanner = planner
        self.plan_stats: dict[str, int] = {}  # node-aware planning counts (`plan_round`'s `stats`)
        self.spec = spec
        self.world_size, self.policy, self.token_budget = (
            spec.world_size,
            spec.policy_object(),
            spec.token_budget,
        )
        self.nodes: list[int] | None = None
        self.vision_nodes: list[int] | None = None
        # The vision phase keeps images on their owner's node whenever the topology is known, node-aware
        # LLM planning or not (an exchange inside a node is cheap, across nodes it is not).
        self.set_topology(nodes, vision_nodes if vision_nodes is not None else nodes)
        self.cost = spec.cost_model()
        self.vision_cost = spec.vision_cost() if spec.phases.count == 2 else None
        self.audio_cost = spec.audio_cost() if spec.phases.count == 2 else None
        self.mode, self.seed, self.epoch = spec.mode, spec.seed, epoch
        self.quota = spec.quota if spec.mode == "non-join" else None
        self.round = 0
        self.emitted = 0
        self.done = False
        self.windows = spec.update_windows()
        self.ledger = StepLedger(epoch)
        self.ledger_complete = True  # every committed step's ids are in the ledger
        self._decided: RoundDecision | None = None

    def set_topology(self, nodes: Sequence[int] | None, vision_nodes: Sequence[int] | None) -> None:
        """Sets the topology the next `decide` plans with (the daemon learns it as node agents register):
        `nodes` for the LLM plan (None: node-blind), `vision_nodes` for the vision plan (None: none),
        each validated (`check_nodes`: one int >= 0 per rank) before either is set. Raises ValueError
        naming the bad value. O(world_size)."""
        checked = check_nodes(nodes, self.world_size) if nodes is not None else None
        vision = check_nodes(vision_nodes, self.world_size) if vision_nodes is not None else None
        self.nodes, self.vision_nodes = checked, vision

    # -- validation ---------------------------------------------------------------------------------
    def _check(self, msgs: Sequence[Any], what: str) -> list[Any]:
        if self.done:
            raise ProtocolError(
                f"epoch {self.epoch} is already complete; got a {what} for round {self.round}"
            )
        by_rank: dict[int, Any] = {}
        for m in msgs:
            if not 0 <= m.rank < self.world_size:
                raise ProtocolError(f"{what} from rank {m.rank} outside world_size={self.world_size}")
            if m.rank in by_rank:
                raise ProtocolError(f"duplicate {what} from rank {m.rank} in round {self.round}")
            if m.round != self.round:
                raise ProtocolError(
                    f"{what} from rank {m.rank} is for round {m.round}, expected {self.round}"
                )
            by_rank[m.rank] = m
        missing = [r for r in range(self.world_size) if r not in by_rank]
        if missing:
            raise ProtocolError(f"round {self.round} is missing the {what} of rank(s) {missing}")
        return [by_rank[r] for r in range(self.world_size)]

    # -- phase 1 -------------------------------------------------------------------------------------
    def decide(self, reports: Sequence[RankReport]) -> RoundDecision:
        """Fixes this round's step count T (and the plan, for `balanced`)."""
        if self._decided is not None:
            raise ProtocolError(f"round {self.round} was already decided; waiting for commits")
        reports = self._check(reports, "report")
        for r in reports:
            check_int(f"capacity of rank {r.rank}", r.capacity, lo=0)
            check_int(f"buffered of rank {r.rank}", r.buffered, lo=0)
            check_int(f"groups of rank {r.rank}", r.groups, lo=0)
            if r.unread is not None:
                check_int(f"unread of rank {r.rank}", r.unread, lo=0)
        if self.policy.pooled:
            decision = self._plan(reports)
        else:
            decision = RoundDecision(self.round, _RULES[self.policy.align](reports))
        self._decided = decision
        return decision

    def _plan(self, reports: Sequence[RankReport]) -> RoundDecision:
        pool = [Entry(s, a) for r in reports for s, a in r.pool]
        seen: set[int] = set()
        for e in pool:
            if e.sample.id in seen:
                raise ProtocolError(f"sample id {e.sample.id} reported by two ranks in round {self.round}")
            seen.add(e.sample.id)
        final = self.mode == "join" and all(r.exhausted for r in reports)
        planned = plan_round(
            PlanInputs(
                pool=pool,
                world_size=self.world_size,
                capacity=min(r.capacity for r in reports),
                final=final,
                token_budget=self.token_budget,
                cost=self.cost,
                now=self.round,
                max_wait=self.policy.max_wait,
                seed=f"plan:{self.seed}:{self.epoch}:{self.round}",
                refine=self.policy.refine,
                level_rows=self.spec.policy.level_rows,
                nodes=self.nodes,
                node_plan=self.spec.policy.nodes,
                unread=_unread(reports),
                mix=self.spec.updates.enabled,
            )
        )
        for key, count in planned.stats.items():
            self.plan_stats[key] = self.plan_stats.get(key, 0) + count
        plan = planned.plan
        target = len(plan[0]) if plan else 0
        vision = audio = None
        if self.vision_cost is not None:
            vision = self.vision_planner(plan, self.vision_cost, self.vision_nodes)
        if self.audio_cost is not None and any(s.audio for steps in plan for g in steps for s in g):
            audio = self.audio_planner(plan, self.audio_cost, self.vision_nodes)
        return RoundDecision(self.round, target, tuple(tuple(p) for p in plan), vision, audio)

    # -- phase 2 -------------------------------------------------------------------------------------
    def commit(
        self, commits: Sequence[RankCommit], sums: Mapping[int, Sequence[tuple[int, int, int]]] | None = None
    ) -> RoundTotals:
        """Sums what the ranks emitted, applies the non-join quota cut, and decides termination.

        `sums` (optional, a caller's shortcut): rank -> per committed step of its commit, (samples,
        tokens, loss tokens), summed by the caller (the gRPC coordinator sums them off the wire without
        building per-sample pairs). They must agree with `commits`; they stand in for summing the steps
        where no quota cut applies (a cut sums what it keeps). Raises ProtocolError on a rank's sums of
        another step count than its commit."""
        if self._decided is None:
            raise ProtocolError(f"commit for round {self.round} before its decision")
        commits = self._check(commits, "commit")
        target = self._decided.target
        for c in commits:
            if len(c.steps) != target:
                raise ProtocolError(
                    f"rank {c.rank} committed {len(c.steps)} steps in round {self.round}, expected {target}"
                )
        per_step: list[list[Sequence[tuple[int, int]]]] = [
            [c.steps[s] for c in commits] for s in range(target)
        ]
        quota = self.quota
        steps, per_step, keep_last = self._quota_cut(per_step, len(commits))
        if sums is not None and keep_last is None:
            rows = [sums[c.rank] for c in commits]
            for c, sum_row in zip(commits, rows, strict=False):
                if len(sum_row) != len(c.steps):
                    raise ProtocolError(
                        f"rank {c.rank}: sums of {len(sum_row)} steps for a commit of {len(c.steps)}"
                    )
            step_samples = tuple(sum(row[s][0] for row in rows) for s in range(steps))
            step_tokens = tuple(sum(row[s][1] for row in rows) for s in range(steps))
            step_loss = tuple(sum(row[s][2] for row in rows) for s in range(steps))
        else:
            step_samples = tuple(sum(len(x) for x in row) for row in per_step)
            step_tokens = tuple(sum(n for x in row for n, _ in x) for row in per_step)
            step_loss = tuple(sum(m for x in row for _, m in x) for row in per_step)
        self.emitted += sum(step_samples)
        drained = all(c.exhausted and c.remaining == 0 for c in commits)
        done = keep_last is not None or drained or (quota is not None and self.emitted >= quota)
        id_rows = self._ledger_rows(commits, steps, keep_last)
        if self.windows.closing_step(steps, done):  # the open update needs a step to end on
            steps, step_samples, step_tokens, step_loss = 1, (0,), (0,), (0,)
            id_rows = [[]]
        self.ledger.add(id_rows, step_loss)
        ends = self.windows.close(step_samples, step_loss, done)
        totals = RoundTotals(
            self.round,
            steps,
            step_samples,
            step_tokens,
            step_loss,
            done,
            keep_last,
            ends.first,
            ends.open_steps,
            ends.ends,
            ends.loss_tokens,
        )
        self.round += 1
        self.done = done
        self._decided = None
        return totals

    def _quota_cut(
        self, per_step: list[list[Sequence[tuple[int, int]]]], ranks: int
    ) -> tuple[int, list[list[Sequence[tuple[int, int]]]], tuple[int, ...] | None]:
        """Non-join mode: the round's steps cut where the epoch's quota is reached (steps, per-step
        rows kept, `keep_last`: how many samples each rank keeps in its last step; None: no cut)."""
        if self.quota is None:  # only non-join mode has a quota (__init__)
            return len(per_step), per_step, None
        left = self.quota - self.emitted
        if left <= 0:
            return 0, [], tuple(0 for _ in range(ranks))
        for s, row in enumerate(per_step):
            n = sum(len(x) for x in row)
            if n >= left:
                keep, budget_left = [], left
                for x in row:
                    k = min(len(x), budget_left)
                    keep.append(k)
                    budget_left -= k
                cut = per_step[: s + 1]
                cut[s] = [x[:k] for x, k in zip(row, keep, strict=False)]
                return s + 1, cut, tuple(keep)
            left -= n
        return len(per_step), per_step, None

    def _ledger_rows(
        self, commits: Sequence[RankCommit], steps: int, keep_last: tuple[int, ...] | None
    ) -> list[list[int]]:
        """Per kept step, the ids every rank kept (the quota cut keeps a prefix of the last step)."""
        rows: list[list[int]] = [[] for _ in range(steps)]
        for r, c in enumerate(commits):
            if len(c.ids) != len(c.steps):
                self.ledger_complete = self.ledger_complete and not any(c.steps[:steps])
                continue
            for s in range(steps):
                cut = keep_last[r] if keep_last is not None and s == steps - 1 else None
                rows[s].extend(c.ids[s][:cut])
        return rows

    def resume_at(self, point: ResumePoint, round_: int, ledger: StepLedger) -> None:
        """Starts this fresh coordinator (its spec at the new world size) mid-epoch after a resize
        (`batchd.core._resize`): at round `round_` (past every round of the epoch before the resize),
        with the update windows and the emitted count of `point`, and `ledger`, the epoch's steps,
        cut to those before `point.step` (the later ones are dealt again). Raises ProtocolError on a
        coordinator that already ran a round, ValueError on a ledger of another epoch or shorter than
        `point.step`."""
        if self.round or self.done or self._decided is not None:
            raise ProtocolError(
                f"resume_at on a coordinator already at round {self.round} of epoch {self.epoch}"
            )
        if ledger.epoch != self.epoch or ledger.steps < point.step:
            raise ValueError(
                f"a ledger of epoch {ledger.epoch} with {ledger.steps} steps cannot resume epoch "
                f"{self.epoch} at step {point.step}"
            )
        check_int("round", round_, lo=0)
        ledger.truncate(point.step)
        self.round, self.emitted, self.ledger = round_, point.emitted, ledger
        self.windows.load_state_dict(point.windows)

    # -- state ---------------------------------------------------------------------------------------
    def resume_decided(self, decision: RoundDecision) -> None:
        """Restores a decision taken before a restart (journaled) for the current round: the round then
        waits for its commits, as if `decide` had just returned `decision`."""
        if self.done or self._decided is not None or decision.round != self.round:
            raise ProtocolError(
                f"cannot resume a decision of round {decision.round}: the coordinator is at "
                f"round {self.round} ({'done' if self.done else 'running'})"
            )
        self._decided = decision

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state at a round boundary."""
        if self._decided is not None:
            raise ProtocolError(f"state_dict() in the middle of round {self.round}; take it between rounds")
        return {
            K_VERSION: STATE_VERSION,
            K_WORLD: self.world_size,
            K_SEED: self.seed,
            K_EPOCH: self.epoch,
            K_MODE: self.mode,
            K_POLICY: self.policy.name,
            K_BUDGET: self.token_budget,
            K_QUOTA: self.quota,
            K_ROUND: self.round,
            K_EMITTED: self.emitted,
            "done": self.done,
            **self._update_fields(),
            **self.windows.state_dict(),
        }

    def _update_fields(self) -> dict[str, Any]:
        """The update settings a state must match (the rule only where updates are counted: a state
        saved before the settings existed has neither, and matches a job without them)."""
        updates = self.spec.updates
        out: dict[str, Any] = {
            "tokens_per_update": updates.tokens_per_update,
            "samples_per_update": updates.samples_per_update,
        }
        if updates.enabled:
            out["update_rule"] = updates.update_rule
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a `state_dict()`; refuses one taken with another world size, seed, epoch, mode, policy,
        token budget, quota or update settings (ValueError naming each field that differs)."""
        expect = {
            K_WORLD: self.world_size,
            K_SEED: self.seed,
            K_EPOCH: self.epoch,
            K_MODE: self.mode,
            K_POLICY: self.policy.name,
            K_BUDGET: self.token_budget,
            K_QUOTA: self.quota,
            **self._update_fields(),
        }
        check_state(state, expect, "Coordinator")
        self.epoch = state[K_EPOCH]
        self.round, self.emitted, self.done = state[K_ROUND], state[K_EMITTED], state["done"]
        self.windows.load_state_dict(state)
        self._decided = None
