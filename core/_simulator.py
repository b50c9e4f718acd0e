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
means per round; with `node_aware` (the job's `node_aware`, or the argument) `balanced` plans
node-aware (`PlanInputs.nodes`), without it the plan stays node-blind and only the counts use the
topology. K = 1 or None: every rank is its own node and the plan is node-blind, as without topology.

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
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ._align import Coordinator
from ._delivery import report_capacity
from ._exchange import Exchange
from ._phases import (
    VisionCost,
    exchanged,
    imbalance,
    phase_loads,
    single_phase,
    vision_bound,
)
from ._plan_moves import plan_moves
from ._rank import RankState
from ._source import ViewSource
from ._spec import JobSpec
from ._step import Step
from ._types import Sample, check_bool, check_int


def synthetic_token_loss(sample_id: int) -> float:
    """The simulator's per-token loss of every token of a sample (deterministic, in [0.5, 10.5))."""
    return 0.5 + ((sample_id * 2654435761) % 1000) / 100.0


class Simulator:
    """Runs one epoch of `spec` over `lengths` (sample id = index): ints, or `Sample`s with `id` == index
    (their modality counts and images are kept; home rank and loss tokens are the simulator's).

    `local_ranks` (K >= 1, or None): ranks per node, rank r on node r // K (module docstring);
    `node_aware` (None: the job's `spec.node_aware`): with K > 1, `balanced` plans node-aware (else
    node-blind, its moves counted under the topology).
    """

    def __init__(
        self,
        lengths: Sequence[int] | Sequence[Sample],
        spec: JobSpec,
        epoch: int = 0,
        local_ranks: int | None = None,
        node_aware: bool | None = None,
    ) -> None:
        if local_ranks is not None:
            check_int("local_ranks", local_ranks, lo=1)
        node_aware = spec.node_aware if node_aware is None else node_aware
        check_bool("node_aware", node_aware)
        self.local_ranks, self.node_aware = local_ranks, node_aware
        k = local_ranks or 1
        self.nodes = [r // k for r in range(spec.world_size)]
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
        self.spec = c = spec
        self.epoch = epoch
        self.cost = spec.cost_model()
        wrap = c.mode == "non-join"
        self.sources = [
            ViewSource(len(self.lengths), r, c.world_size, c.seed, epoch, c.shuffle, wrap)
            for r in range(c.world_size)
        ]
        self.coordinator = Coordinator(
            c,
            epoch,
            self.nodes if self.planned_by_node else None,
            self.nodes if (local_ranks or 1) > 1 else None,
        )
        self.vision_plan_s: list[float] = []  # wall seconds of each round's vision plan (phases=2)
        self._time_vision_plan()
        self.ranks = [RankState(c, r, epoch) for r in range(c.world_size)]
        self.plan_s = 0.0  # time spent in the coordinator's decide (the plan, for `balanced`)
        self.pending: list[collections.deque[Step]] = [collections.deque() for _ in range(c.world_size)]
        self.rounds = 0
        self._idle_rounds = 0

    def _time_vision_plan(self) -> None:
        planner = self.coordinator.vision_planner

        def timed(
            plan: Sequence[Sequence[Sequence[Sample]]], cost: VisionCost, nodes: Sequence[int] | None = None
        ) -> tuple[tuple[Exchange, ...], ...]:
            t0 = time.perf_counter()
            out = planner(plan, cost, nodes)
            self.vision_plan_s.append(time.perf_counter() - t0)
            return out

        self.coordinator.vision_planner = timed

    @property
    def multimodal(self) -> bool:
        """True when some sample carries images."""
        return self.records is not None and any(x.images for x in self.records)

    @property
    def planned_by_node(self) -> bool:
        """True when the coordinator plans node-aware (K > 1 and `node_aware`)."""
        return self.node_aware and (self.local_ranks or 1) > 1

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
                    rank.push(Sample(i, x.length, -1, rank.rank, x.modality_tokens, x.nbytes, x.images))
            if not rank.exhausted and (src.exhausted() or rank.rejected_all(len(src))):
                rank.mark_exhausted()

    def run_round(self) -> int:
        """Runs one alignment round; returns the steps it added per rank."""
        self._fill()
        depth = self.spec.depth
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
        return tuple(q.popleft() for q in self.pending)

    def __iter__(self) -> Iterator[tuple[Step, ...]]:
        while (step := self.next_step()) is not None:
            yield step

    # -- state ---------------------------------------------------------------------------------------
    def _topology(self) -> dict[str, Any] | None:
        return (
            None
            if self.local_ranks is None
            else {"local_ranks": self.local_ranks, "node_aware": self.node_aware}
        )

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state between any two steps (with `topology` only when `local_ranks` is set)."""
        topology = self._topology()
        return {
            **({"topology": topology} if topology is not None else {}),
            "config": dataclasses.asdict(self.spec),
            "epoch": self.epoch,
            "coordinator": self.coordinator.state_dict(),
            "ranks": [r.state_dict() for r in self.ranks],
            "sources": [s.state_dict() for s in self.sources],
            "pending": [[s.to_json() for s in q] for q in self.pending],
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a `state_dict()` taken with the same spec and data."""
        saved = dict(state["config"])
        if saved != dataclasses.asdict(self.spec):
            diff = {
                k: (saved.get(k), v) for k, v in dataclasses.asdict(self.spec).items() if saved.get(k) != v
            }
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


class PhaseMetrics:
    """Per-phase balance of consumed steps (module docstring): sums of each step's max / mean rank load,
    per phase and plan, and the embeddings the two-phase plan exchanges."""

    KEYS = ("intra_node_images", "intra_node_rows", "cross_node_images", "cross_node_rows")

    def __init__(self, spec: JobSpec, nodes: Sequence[int] | None = None) -> None:
        self.vision = spec.vision_cost()
        self.nodes = nodes
        self.steps = self.llm_steps = self.vision_steps = self.two_steps = self.images = 0
        self.llm = self.single = self.two = self.bound = self.tight = 0.0
        self.moved = dict.fromkeys(self.KEYS, 0)

    def add(self, step: tuple[Step, ...]) -> None:
        self.steps += 1
        llm = imbalance([s.info.cost for s in step])
        if llm is not None:
            self.llm_steps += 1
            self.llm += llm
        row = [s.samples for s in step]
        loads = phase_loads(single_phase(row), self.vision)
        single = imbalance(loads)
        if single is None:  # no vision cost in this step
            return
        self.images += sum(len(x.images) for s in step for x in s.samples)
        self.vision_steps += 1
        self.single += single
        mean = sum(loads) / len(loads)
        costs = [self.vision.image(p) for s in step for x in s.samples for p, _ in x.images]
        self.bound += max(mean, max(costs)) / mean
        self.tight += vision_bound(costs, len(step)) / mean
        exchanges = [s.exchange for s in step if s.exchange is not None]
        if len(exchanges) == len(step):
            self.two_steps += 1
            self.two += imbalance(phase_loads(exchanges, self.vision)) or 1.0
            for k, v in exchanged(exchanges, self.nodes).items():
                self.moved[k] += v

    def result(self, sim: Simulator) -> dict[str, Any]:
        steps = max(self.steps, 1)
        plans = sim.vision_plan_s
        out: dict[str, Any] = {
            "phases": sim.spec.phases,
            "images": self.images,
            "vision_steps": self.vision_steps,
            "llm_imbalance": self.llm / self.llm_steps if self.llm_steps else None,
            "vision_imbalance_single": self.single / self.vision_steps if self.vision_steps else None,
            "vision_imbalance_two": self.two / self.two_steps if self.two_steps else None,
            "vision_bound": self.bound / self.vision_steps if self.vision_steps else None,
            "vision_bound_pigeonhole": self.tight / self.vision_steps if self.vision_steps else None,
        }
        for k in self.KEYS:
            out[f"exchanged_{k}_per_step"] = self.moved[k] / steps
        out["vision_plan_rounds"] = len(plans)
        out["vision_plan_per_round_s"] = sum(plans) / len(plans) if plans else 0.0
        return out


class SimMetrics:
    """Accumulates the `batchd simulate` metrics from consumed steps (with a multimodal workload or
    phases=2, also `PhaseMetrics`)."""

    def __init__(self, num_samples: int, spec: JobSpec, nodes: Sequence[int] | None = None) -> None:
        self.n, self.c = num_samples, spec
        self.nodes = nodes
        self.moves = dict.fromkeys(
            ("intra_node_samples", "intra_node_bytes", "cross_node_samples", "cross_node_bytes"), 0
        )
        self.cost = spec.cost_model()
        self.counts = [0] * num_samples
        self.steps = [0] * spec.world_size
        self.idle = self.emitted = self.moved = self.real = self.padded = self.over_budget = 0
        self.slowest = 0.0
        self.loss_err = 0.0
        # The open optimizer update: scaled rank means and the window's loss sums / tokens so far.
        self._w_num, self._w_den = 0.0, 0
        self._w_sums: list[float] = []
        self.update_tokens: list[int] = []  # per ended update, its global loss tokens
        self.phases = PhaseMetrics(spec, nodes)

    def add(self, step: tuple[Step, ...]) -> None:
        c = self.c
        slowest, num, den = 0.0, 0.0, 0
        rank_sums: list[float] = []
        for k, v in plan_moves([[s.samples] for s in step], self.nodes).items():
            self.moves[k] += v
        for rank, s in enumerate(step):
            self.steps[rank] += 1
            if s.info.is_idle:
                self.idle += 1
                continue
            lengths = [x.length for x in s.samples]
            self.emitted += len(lengths)
            for x in s.samples:
                self.counts[x.id] += 1
                self.moved += x.home_rank != rank
            self.real += sum(lengths)
            self.padded += self.cost.materialized_tokens(lengths)
            cost = s.info.cost
            slowest = max(slowest, cost)
            if cost > c.token_budget and len(lengths) != 1:
                self.over_budget += 1
            rank_sum = math.fsum(synthetic_token_loss(x.id) * x.loss_tokens for x in s.samples)
            rank_sums.append(rank_sum)
            if s.info.local_loss_tokens:
                num += rank_sum / s.info.local_loss_tokens * s.info.loss_scale
            den += s.info.local_loss_tokens
        self._window(step, num, rank_sums, den)
        self.slowest += slowest
        self.phases.add(step)

    def _window(self, step: tuple[Step, ...], num: float, rank_sums: list[float], den: int) -> None:
        """The loss-scale check over an optimizer update (one step without `tokens_per_update`): the
        ranks' scaled means, averaged over ranks and times `update_scale`, against the per-token mean
        over every sample of the update."""
        self._w_num += num
        self._w_sums += rank_sums
        self._w_den += den
        info = step[0].info
        if not info.update_end:
            return
        self.update_tokens.append(info.update_loss_tokens)
        if self._w_den:
            ref = math.fsum(self._w_sums) / self._w_den
            got = self._w_num / len(step) * info.update_scale
            self.loss_err = max(self.loss_err, abs(got - ref))
        self._w_num, self._w_sums, self._w_den = 0.0, [], 0

    def result(self, sim: Simulator, wall_s: float) -> dict[str, Any]:
        c = self.c
        rejected = {i for r in sim.ranks for i, _ in r.rejected}
        missing = sum(1 for i, k in enumerate(self.counts) if k == 0 and i not in rejected)
        duplicates = sum(k - 1 for k in self.counts if k > 1)
        steps = self.steps[0] if self.steps else 0
        n = c.world_size
        counters: collections.Counter[str] = collections.Counter()
        for r in sim.ranks:
            counters.update(r.counters)
        return {
            "policy": c.policy,
            "world_size": n,
            "token_budget": c.token_budget,
            "window": c.window,
            "mode": c.mode,
            "cost": c.cost,
            "align": sim.coordinator.policy.align,
            "seed": c.seed,
            "samples": self.n,
            "steps": steps,
            "steps_per_rank": list(self.steps),
            "rounds": sim.rounds,
            "idle": self.idle,
            "emitted": self.emitted,
            "missing": missing,
            "duplicates": duplicates,
            "moved": self.moved,
            "rejected": len(rejected),
            "truncated": counters["truncated"],
            "over_budget_samples": counters["over_budget"],
            "real_tokens": self.real,
            "padded_tokens": self.padded,
            "padding_efficiency": self.real / self.padded if self.padded else 1.0,
            "step_efficiency": self.real / (steps * n * c.token_budget) if steps else 0.0,
            "ideal_steps": math.ceil(self.real / (n * c.token_budget)) if self.real else 0,
            "compute_vs_limit": self.slowest / (self.real / n) if self.real else 0.0,
            "over_budget": self.over_budget,
            "loss_scale_error": self.loss_err,
            "updates": len(self.update_tokens),
            "update_loss_tokens_min": min(self.update_tokens, default=0),
            "update_loss_tokens_mean": (
                sum(self.update_tokens) / len(self.update_tokens) if self.update_tokens else 0.0
            ),
            "update_loss_tokens_max": max(self.update_tokens, default=0),
            "wall_s": wall_s,
            "samples_per_s_per_rank": self.emitted / n / wall_s if wall_s > 0 else 0.0,
            **self.node_result(sim),
            **(self.phases.result(sim) if sim.multimodal or c.phases == 2 else {}),
        }

    def node_result(self, sim: Simulator) -> dict[str, Any]:
        """The topology's part of `result`: moves split intra/cross node (totals and per-round means),
        how the rounds were planned, and the coordinator's planning time per round."""
        rounds = max(sim.rounds, 1)
        m = self.moves
        stats = sim.coordinator.plan_stats
        out: dict[str, Any] = {"local_ranks": sim.local_ranks or 1, "node_aware": sim.planned_by_node}
        for key, name in (
            ("intra_node_moved", "intra_node_samples"),
            ("intra_node_bytes", "intra_node_bytes"),
            ("cross_node_moved", "cross_node_samples"),
            ("cross_node_bytes", "cross_node_bytes"),
        ):
            out[key] = m[name]
            out[f"{key}_per_round"] = m[name] / rounds
        out.update(
            {
                "node_planned_rounds": stats.get("node_aware", 0),
                "node_fallback_rounds": stats.get("node_fallback", 0),
                "node_swaps": stats.get("node_swaps", 0),
                "plan_per_round_s": sim.plan_s / rounds,
            }
        )
        return out


# What each key of `simulate`'s result means (`batchd simulate --help` lists them; tested to cover them all).
RESULT_FIELDS: dict[str, str] = {
    "policy": "the job's policy",
    "world_size": "ranks N",
    "token_budget": "L, tokens a rank's step may cost",
    "window": "samples buffered per rank",
    "mode": "join or non-join",
    "cost": "the cost model",
    "align": "the DGAP target rule",
    "seed": "the sampler seed",
    "samples": "sample ids in the file",
    "steps": "global steps (every rank runs this many)",
    "steps_per_rank": "steps of each rank (all equal)",
    "rounds": "alignment rounds",
    "idle": "(rank, step) slots with no data: IDLE steps",
    "emitted": "samples trained",
    "missing": "ids never trained (must be 0)",
    "duplicates": "ids trained more than once (must be 0)",
    "moved": "samples the balanced plan trained off their home rank",
    "rejected": "samples over L quarantined (over_budget reject)",
    "truncated": "samples over L cut to fit",
    "over_budget_samples": "samples longer than L (singleton, truncated or rejected by --over-budget)",
    "real_tokens": "tokens of the samples",
    "padded_tokens": "tokens materialized, padding included",
    "padding_efficiency": "real_tokens / padded_tokens",
    "step_efficiency": "real_tokens / (steps x N x L): how much of the paid-for budget carries data",
    "ideal_steps": "ceil(real_tokens / (N x L)): a perfectly packed, perfectly balanced run's steps",
    "compute_vs_limit": "sum over steps of the slowest rank's cost / (real_tokens / N): the straggler-bound "
    "compute against a padding-free, balanced run (1.0 = at that limit)",
    "over_budget": "steps on which a group of several samples costs more than L (only fixed-size baselines)",
    "loss_scale_error": "largest |scaled mean of rank losses x update_scale - per-token mean| over "
    "optimizer updates (0 = exact)",
    "updates": "optimizer updates (steps without --tokens-per-update / --samples-per-update)",
    "update_loss_tokens_min": "fewest global loss tokens in an update",
    "update_loss_tokens_mean": "mean global loss tokens per update",
    "update_loss_tokens_max": "most global loss tokens in an update",
    "wall_s": "seconds the simulation took",
    "samples_per_s_per_rank": "simulated samples / s / rank",
    "local_ranks": "ranks per node K (--local-ranks)",
    "node_aware": "whether balanced planned node-aware",
    "intra_node_moved": "moved samples that stayed in their node",
    "cross_node_moved": "moved samples that left it",
    "intra_node_bytes": "their bytes (a sample's nbytes, else 8 x length)",
    "cross_node_bytes": "their bytes",
    "intra_node_moved_per_round": "per round",
    "cross_node_moved_per_round": "per round",
    "intra_node_bytes_per_round": "per round",
    "cross_node_bytes_per_round": "per round",
    "node_planned_rounds": "rounds planned node-aware",
    "node_fallback_rounds": "rounds planned node-blind",
    "node_swaps": "group pairs swapped across nodes by the node-aware plan",
    "plan_per_round_s": "the coordinator's planning seconds per round",
    "phases": "1, or 2 with the vision encoder balanced too",
    "images": "images in the workload",
    "vision_steps": "steps with vision cost",
    "llm_imbalance": "LLM phase: mean over steps of max / mean rank cost",
    "vision_imbalance_single": "vision phase, every rank encoding its own images: mean max / mean",
    "vision_imbalance_two": "vision phase under the two-phase plan: mean max / mean",
    "vision_bound": "vision phase's per-step lower bound max(C / N, largest image) / (C / N), "
    "mean over steps",
    "vision_bound_pigeonhole": "the tighter per-step bound (an image is never split), mean over steps",
    "exchanged_intra_node_images_per_step": "two-phase: images encoded off their sample's rank, same node",
    "exchanged_intra_node_rows_per_step": "their embedding rows in the all-to-all",
    "exchanged_cross_node_images_per_step": "images encoded on another node",
    "exchanged_cross_node_rows_per_step": "their embedding rows",
    "vision_plan_rounds": "rounds the vision plan ran",
    "vision_plan_per_round_s": "its seconds per round",
}


def simulate(
    lengths: Sequence[int] | Sequence[Sample],
    spec: JobSpec,
    on_step: Callable[[tuple[Step, ...]], None] | None = None,
    local_ranks: int | None = None,
    node_aware: bool | None = None,
) -> dict[str, Any]:
    """Runs one epoch and returns the metrics dict `batchd simulate --json` prints.

    `lengths`: ints, or `Sample`s with images (`parse_workload`; the result then adds `PhaseMetrics`).
    `on_step` (e.g. a progress bar) sees each aligned step (one `Step` per rank) as it is emitted.
    `local_ranks` / `node_aware`: the topology (`Simulator`).
    """
    t0 = time.perf_counter()
    sim = Simulator(lengths, spec, local_ranks=local_ranks, node_aware=node_aware)
    metrics = SimMetrics(len(lengths), spec, sim.nodes)
    for step in sim:
        metrics.add(step)
        if on_step is not None:
            on_step(step)
    return metrics.result(sim, time.perf_counter() - t0)
