"""The simulator: N virtual ranks and the coordinator, driven through the same core the daemon runs.

Each round every rank refills its window from its sampler view, then the round runs exactly as in the
daemon (report -> decide -> apply -> commit -> finalize). Steps are consumed one global step at a
time (one `Step` per rank), so the simulator can be checkpointed and resumed between any two steps:
its state is the coordinator's, every rank's and every view's state at the last round boundary plus
the steps of the current round not yet consumed.

Metrics (see `SimMetrics.result`): padding efficiency = real / materialized tokens; step efficiency =
real / (steps x N x L); compute_vs_limit = sum over steps of the slowest rank's cost / (real / N), i.e.
how far the straggler-bound compute is from a perfectly packed, perfectly balanced run (1.0).

Topology (`local_ranks` = K): rank r sits on node r // K. The result then splits `moved` into
intra-node and cross-node samples and bytes (`plan_moves`: `nbytes`, else 8 x length), totals and
means per round; `balanced` plans as the job's `policy.nodes` says: `aware` node-aware
(`PlanInputs.nodes`), `local` (the default) node-local rounds where they cost as node-blind (additive
costs), and otherwise (`blind`, or padded cost) the plan stays node-blind and only the counts use the
topology. K = 1 or None: every rank is its own node and the plan is node-blind, as
without topology.

Multimodal workloads: `lengths` may be `Sample`s (ids 0..n-1 in order, e.g. from `parse_workload`)
whose `images` carry (patches, tokens) per image. The result then adds per-phase balance (`PhaseMetrics`):
for every step, max / mean of the ranks' loads in the LLM phase (the job's `CostModel` on each rank's
group) and in the vision phase (`VisionCost` on each rank's encoded images), the latter both for the
single-phase plan (`single_phase`: every rank encodes its own) and, with `spec.phases == 2`, for the
two-phase plan (`Step.exchange`); means over steps, steps without vision cost skipped for the vision
means. Also two per-step lower bounds of the vision phase's max / mean: max(C / N, max c) / (C / N) and
the tighter `vision_bound` / (C / N) (an image is not split: pigeonhole), the embeddings
exchanged per step (`exchanged`, intra-/cross-node under `local_ranks`) and the wall time of
`plan_vision_round` per round (timed around the coordinator's `vision_planner`; the plan is unchanged).
With `local_ranks` the vision plan keeps embeddings inside nodes (`Coordinator`'s `vision_nodes`)
whether or not the LLM plan is node-aware.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ._align import Coordinator
from ._delivery import report_capacity
from ._encoders import EncoderCost
from ._exchange import Exchange
from ._rank import RankState
from ._resize import Remainder, ResumePoint, resume_point
from ._sim_metrics import SimMetrics
from ._source import ViewSource
from ._spec import JobSpec
from ._step import Step
from ._types import Sample, check_int


class Simulator:
    """Runs one epoch of `spec` over `lengths` (sample id = index): ints, or `Sample`s with `id` == index
    (their modality counts and images are kept; home rank and loss tokens are the simulator's).

    `local_ranks` (K >= 1, or None): ranks per node, rank r on node r // K (module docstring); with
    K > 1, `balanced` plans as `spec.policy.nodes` says (node-blind ones count their moves under the
    topology).
    """

    def __init__(
        self,
        lengths: Sequence[int] | Sequence[Sample],
        spec: JobSpec,
        epoch: int = 0,
        local_ranks: int | None = None,
    ) -> None:
        if local_ranks is not None:
            check_int("local_ranks", local_ranks, lo=1)
        self.local_ranks, self.node_plan = local_ranks, spec.policy.nodes
        self.records: list[Sample] | None = None
        if lengths and isinstance(lengths[0], Sample):
            records: list[Sample] = []
            for i, x in enumerate(lengths):
                if not isinstance(x, Sample) or x.id != i:
                    raise ValueError(
                        f"lengths[{i}] must be a Sample with id {i} (like every entry), got {x!r}"
                    )
                records.append(x)
            self.records = records
            lengths = [x.length for x in records]
        self.lengths: list[int] = []
        for i, n in enumerate(lengths):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"lengths[{i}] must be a positive int, got {n!r}")
            self.lengths.append(n)
        if spec.mode == "non-join" and spec.quota is None:  # the simulator's default quota: every sample
            spec = spec.replace(quota=len(self.lengths))
        self.epoch = epoch
        self.cost = spec.cost_model()
        self.vision_plan_s: list[float] = []  # wall seconds of each round's vision plan (phases=2)
        self.plan_s = 0.0  # time spent in the coordinator's decide (the plan, for `balanced`)
        self.rounds = 0
        self.taken = 0  # steps consumed (`next_step`) this epoch
        self.update_open = False  # the last consumed step did not end an optimizer update
        self.remainder: Remainder | None = None  # the last resize's (`resize`)
        self._start(spec)

    def _start(self, spec: JobSpec, point: ResumePoint | None = None) -> None:
        """(Re)builds the parties for `spec`: at the epoch's start, or after a resize at `point` (the
        remainder in `self.remainder`, the old coordinator's ledger and round carried over)."""
        c, epoch, rem = spec, self.epoch, self.remainder
        k = self.local_ranks or 1
        self.nodes = [r // k for r in range(c.world_size)]
        wrap = c.mode == "non-join"
        self.sources = [
            ViewSource(len(self.lengths), r, c.world_size, c.seed, epoch, c.shuffle, wrap, rem)
            for r in range(c.world_size)
        ]
        old = getattr(self, "coordinator", None)
        self.coordinator = Coordinator(
            c,
            epoch,
            self.nodes if k > 1 and self.node_plan != "blind" else None,
            self.nodes if k > 1 else None,
        )
        self._time_vision_plan()
        self.ranks = [RankState(c, r, epoch) for r in range(c.world_size)]
        if point is not None and old is not None:
            self.coordinator.resume_at(point, old.round, old.ledger)
            for rank in self.ranks:
                rank.start_at(old.round, point.step)
        self.spec = c
        self.pending: list[collections.deque[Step]] = [collections.deque() for _ in range(c.world_size)]
        self._idle_rounds = 0

    def resize(self, world_size: int) -> Remainder:
        """Goes on at `world_size` ranks from the next step S = `taken` (`batchd.core._resize`): the
        steps made but not consumed are dropped, the ids no step before S held are dealt to the new
        ranks' views, the update windows go on where they stood. Returns the remainder.

        Raises:
            ValueError: S inside an optimizer update (`update_open`), or a ledger without every id.
        """
        check_int("world_size", world_size, lo=1)
        coord = self.coordinator
        if not coord.ledger_complete:
            raise ValueError("cannot resize: the coordinator's ledger lacks the ids of some step")
        point = resume_point(coord.ledger, self.taken, self.spec.update_windows())
        generation = self.remainder.generation + 1 if self.remainder is not None else 1
        self.remainder = Remainder(
            self.epoch, self.taken, world_size, generation, coord.ledger.consumed(self.taken)
        )
        self._start(self.spec.replace(world_size=world_size), point)
        return self.remainder

    def _time_vision_plan(self) -> None:
        planner = self.coordinator.vision_planner

        def timed(
            plan: Sequence[Sequence[Sequence[Sample]]], cost: EncoderCost, nodes: Sequence[int] | None = None
        ) -> tuple[tuple[Exchange, ...], ...]:
            t0 = time.perf_counter()
            out = planner(plan, cost, nodes)
            self.vision_plan_s.append(time.perf_counter() - t0)
            return out

        self.coordinator.vision_planner = timed

    @property
    def multimodal(self) -> bool:
        """True when some sample carries images or audio clips."""
        return self.records is not None and any(x.images or x.audio for x in self.records)

    @property
    def has_audio(self) -> bool:
        """True when some sample carries audio clips."""
        return self.records is not None and any(x.audio for x in self.records)

    @property
    def planned_by_node(self) -> bool:
        """True when the coordinator plans node-aware (K > 1 and `policy.nodes` aware)."""
        return self.node_plan == "aware" and (self.local_ranks or 1) > 1

    @property
    def done(self) -> bool:
        return self.coordinator.done and not self.pending[0]

    def _fill(self) -> None:
        for rank, src in zip(self.ranks, self.sources, strict=False):
            attempts = 0
            while rank.room > 0 and not rank.exhausted and attempts < len(src):
                i = src.peek()
                if i is None:
                    break
                if rank.holds(i):  # non-join wrap-around: the id's previous pass is still buffered
                    break
                src.next()
                attempts += 1
                if rank.was_rejected(i):  # non-join wrap-around: quarantined on an earlier pass
                    continue
                if self.records is None:
                    rank.push(Sample(i, self.lengths[i], -1, rank.rank))
                else:
                    x = self.records[i]
                    fields = (x.modality_tokens, x.nbytes, x.images, x.audio)
                    rank.push(Sample(i, x.length, -1, rank.rank, *fields))
            if not rank.exhausted and (src.exhausted() or rank.rejected_all(len(src))):
                rank.mark_exhausted()
            elif not rank.exhausted:
                rank.set_unread(src.unread())

    def run_round(self) -> int:
        """Runs one alignment round; returns the steps it added per rank."""
        self._fill()
        depth = self.spec.policy.depth
        # A round runs once the steps of the last one were taken (`next_step`): every slot is free. In
        # deterministic mode the ranks report the daemon's fixed capacity (`report_capacity`), as they do.
        reports = [
            r.report(report_capacity(depth - len(q), depth, self.spec.deterministic) or 0)
            for r, q in zip(self.ranks, self.pending, strict=False)
        ]
        t0 = time.perf_counter()
        decision = self.coordinator.decide(reports)
        self.plan_s += time.perf_counter() - t0
        commits = [r.apply(decision) for r in self.ranks]
        totals = self.coordinator.commit(commits)
        for r, q in zip(self.ranks, self.pending, strict=False):
            q.extend(r.finalize(totals))
        self.rounds += 1
        return totals.steps

    def next_step(self) -> tuple[Step, ...] | None:
        """The next global step (one `Step` per rank), or None at the end of the epoch."""
        while not self.pending[0]:
            if self.coordinator.done:
                return None
            if self.run_round() == 0:
                self._idle_rounds += 1
                if self._idle_rounds > 3:
                    raise RuntimeError(
                        f"alignment stalled at round {self.coordinator.round}: no step in 4 rounds"
                    )
            else:
                self._idle_rounds = 0
        step = tuple(q.popleft() for q in self.pending)
        self.taken += 1
        self.update_open = not step[0].info.update_end
        return step

    def __iter__(self) -> Iterator[tuple[Step, ...]]:
        while (step := self.next_step()) is not None:
            yield step

    # -- state ---------------------------------------------------------------------------------------
    def _topology(self) -> dict[str, Any] | None:
        return (
            None if self.local_ranks is None else {"local_ranks": self.local_ranks, "nodes": self.node_plan}
        )

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state between any two steps (with `topology` only when `local_ranks` is set)."""
        topology = self._topology()
        return {
            **({"topology": topology} if topology is not None else {}),
            "config": self.spec.keys(),
            "epoch": self.epoch,
            "coordinator": self.coordinator.state_dict(),
            "ranks": [r.state_dict() for r in self.ranks],
            "sources": [s.state_dict() for s in self.sources],
            "pending": [[s.to_json() for s in q] for q in self.pending],
            "rounds": self.rounds,
            "taken": self.taken,
            "update_open": self.update_open,
            "ledger": self.coordinator.ledger.state_dict(),
            "remainder": self.remainder.to_json() if self.remainder is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a `state_dict()` taken with the same spec and data (after a resize: the state's
        remainder rebuilds the parties at its world size first)."""
        rem = Remainder.from_json(state["remainder"]) if state.get("remainder") else None
        if rem is not None and rem != self.remainder:
            self.remainder = rem
            self._start(self.spec.replace(world_size=rem.world_size))
        saved = dict(state["config"])
        if saved != self.spec.keys():
            diff = {k: (saved.get(k), v) for k, v in self.spec.keys().items() if saved.get(k) != v}
            raise ValueError(f"simulator state was saved with another config (saved, current): {diff}")
        if state.get("topology") != self._topology():
            raise ValueError(
                f"simulator state was saved with another topology: saved {state.get('topology')!r}, "
                f"current {self._topology()!r}"
            )
        self.coordinator.load_state_dict(state["coordinator"])
        for r, s in zip(self.ranks, state["ranks"], strict=True):
            r.load_state_dict(s)
        for src, s in zip(self.sources, state["sources"], strict=True):
            src.load_state_dict(s)
        self.pending = [collections.deque(Step.from_json(s) for s in q) for q in state["pending"]]
        self.rounds = state["rounds"]
        self.taken, self.update_open = state.get("taken", 0), state.get("update_open", False)
        if "ledger" in state:
            self.coordinator.ledger.load_state_dict(state["ledger"])


def simulate(
    lengths: Sequence[int] | Sequence[Sample],
    spec: JobSpec,
    on_step: Callable[[tuple[Step, ...]], None] | None = None,
    local_ranks: int | None = None,
    resize: Sequence[tuple[int, int]] = (),
    around: int = 8,
) -> dict[str, Any]:
    """Runs one epoch and returns the metrics dict `batchd simulate --json` prints.

    `lengths`: ints, or `Sample`s with images (`parse_workload`; the result then adds `PhaseMetrics`).
    `on_step` (e.g. a progress bar) sees each aligned step (one `Step` per rank) as it is emitted.
    `local_ranks`: the topology (`Simulator`; `spec.policy.nodes` says how `balanced` plans with it).
    `resize`: (step, world size) changes (`Simulator.resize`), each made at the first step at or after
    its step that starts an optimizer update; the result then adds `segments` (each world size's
    first step and steps per rank) and `resizes`: per change the step it was made at (None if the
    epoch ended first), the world sizes, and the padding efficiency and compute_vs_limit of the
    `around` steps after it, beside those of the same steps of the epoch run without any change.
    """
    changes = sorted(resize)
    for step_at, world in changes:
        check_int("resize step", step_at, lo=0)
        check_int("resize world size", world, lo=1)
    t0 = time.perf_counter()
    sim = Simulator(lengths, spec, local_ranks=local_ranks)
    metrics = SimMetrics(len(lengths), spec, sim.nodes)
    made: list[dict[str, Any]] = [{"asked": a, "step": None, "from": None, "to": w} for a, w in changes]
    pending = list(range(len(changes)))
    while True:
        while pending and sim.taken >= changes[pending[0]][0] and not sim.update_open and not sim.done:
            k = pending.pop(0)
            made[k].update(step=sim.taken, **{"from": sim.spec.world_size})
            sim.resize(changes[k][1])
            metrics.start_segment(sim.spec.world_size, sim.nodes)
        step = sim.next_step()
        if step is None:
            break
        metrics.add(step)
        if on_step is not None:
            on_step(step)
    out = metrics.result(sim, time.perf_counter() - t0)
    if changes:
        base = SimMetrics(len(lengths), spec)
        for step in Simulator(lengths, spec, local_ranks=local_ranks):
            base.add(step)
        starts = [m["step"] for m in made if m["step"] is not None]
        for m in made:
            if m["step"] is not None:  # the `around` steps after it, at most up to the next change
                nxt = min([s for s in starts if s > m["step"]], default=metrics.steps_taken)
                steps = min(around, nxt - m["step"])
                m["after"] = metrics.window_quality(m["step"], steps)
                m["without"] = base.window_quality(m["step"], steps)
        out["segments"] = metrics.segments
        out["resizes"] = made
    return out
