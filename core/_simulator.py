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
means per round; with `node_aware` (the job's `node_aware`, or the argument) `balanced` plans node-aware (`plan_round`'s `nodes`),
without it the plan stays node-blind and only the counts use the topology. K = 1 or None: every rank is
its own node and the plan is node-blind, as without topology.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from ._align import Coordinator
from ._balance import plan_moves
from ._rank import RankState
from ._source import ViewSource
from ._spec import JobSpec
from ._types import Sample, Step, check_bool, check_int


def synthetic_token_loss(sample_id: int) -> float:
    """The simulator's per-token loss of every token of a sample (deterministic, in [0.5, 10.5))."""
    return 0.5 + ((sample_id * 2654435761) % 1000) / 100.0


class Simulator:
    """Runs one epoch of `spec` over `lengths` (sample id = index).

    `local_ranks` (K >= 1, or None): ranks per node, rank r on node r // K (module docstring);
    `node_aware` (None: the job's `spec.node_aware`): with K > 1, `balanced` plans node-aware (else
    node-blind, its moves counted under the topology).
    """

    def __init__(self, lengths: Sequence[int], spec: JobSpec, epoch: int = 0, local_ranks: int | None = None,
                 node_aware: bool | None = None) -> None:
        if local_ranks is not None:
            check_int("local_ranks", local_ranks, lo=1)
        node_aware = spec.node_aware if node_aware is None else node_aware
        check_bool("node_aware", node_aware)
        self.local_ranks, self.node_aware = local_ranks, node_aware
        k = local_ranks or 1
        self.nodes = [r // k for r in range(spec.world_size)]
        for i, n in enumerate(lengths):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"lengths[{i}] must be a positive int, got {n!r}")
        self.lengths = list(lengths)
        if spec.mode == "non-join" and spec.quota is None:  # the simulator's default quota: every sample
            spec = spec.replace(quota=len(self.lengths))
        self.spec = c = spec
        self.epoch = epoch
        self.cost = spec.cost_model()
        wrap = c.mode == "non-join"
        self.sources = [ViewSource(len(self.lengths), r, c.world_size, c.seed, epoch, c.shuffle, wrap)
                        for r in range(c.world_size)]
        self.coordinator = Coordinator(c, epoch, self.nodes if self.planned_by_node else None)
        self.ranks = [RankState(c, r, epoch) for r in range(c.world_size)]
        self.plan_s = 0.0  # time spent in the coordinator's decide (the plan, for `balanced`)
        self.pending: list[collections.deque[Step]] = [collections.deque() for _ in range(c.world_size)]
        self.rounds = 0
        self._idle_rounds = 0

    @property
    def planned_by_node(self) -> bool:
        """True when the coordinator plans node-aware (K > 1 and `node_aware`)."""
        return self.node_aware and (self.local_ranks or 1) > 1

    @property
    def done(self) -> bool:
        return self.coordinator.done and not self.pending[0]

    def _fill(self) -> None:
        for rank, src in zip(self.ranks, self.sources):
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
                rank.push(Sample(i, self.lengths[i], -1, rank.rank))
            if not rank.exhausted and (src.exhausted() or rank.rejected_all(len(src))):
                rank.mark_exhausted()

    def run_round(self) -> int:
        """Runs one alignment round; returns the steps it added per rank."""
        self._fill()
        depth = self.spec.depth
        reports = [r.report(depth - len(q)) for r, q in zip(self.ranks, self.pending)]
        t0 = time.perf_counter()
        decision = self.coordinator.decide(reports)
        self.plan_s += time.perf_counter() - t0
        commits = [r.apply(decision) for r in self.ranks]
        totals = self.coordinator.commit(commits)
        for r, q in zip(self.ranks, self.pending):
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
                    raise RuntimeError(f"alignment stalled at round {self.coordinator.round}: no step in 4 rounds")
            else:
                self._idle_rounds = 0
        return tuple(q.popleft() for q in self.pending)

    def __iter__(self) -> Iterator[tuple[Step, ...]]:
        while (step := self.next_step()) is not None:
            yield step

    # -- state ---------------------------------------------------------------------------------------
    def _topology(self) -> dict[str, Any] | None:
        return None if self.local_ranks is None else {"local_ranks": self.local_ranks, "node_aware": self.node_aware}

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
            diff = {k: (saved.get(k), v) for k, v in dataclasses.asdict(self.spec).items() if saved.get(k) != v}
            raise ValueError(f"simulator state was saved with another config (saved, current): {diff}")
        if state.get("topology") != self._topology():
            raise ValueError(f"simulator state was saved with another topology: saved {state.get('topology')!r}, "
                             f"current {self._topology()!r}")
        self.coordinator.load_state_dict(state["coordinator"])
        for r, s in zip(self.ranks, state["ranks"], strict=True):
            r.load_state_dict(s)
        for src, s in zip(self.sources, state["sources"], strict=True):
            src.load_state_dict(s)
        self.pending = [collections.deque(Step.from_json(s) for s in q) for q in state["pending"]]
        self.rounds = state["rounds"]


class SimMetrics:
    """Accumulates the `batchd simulate` metrics from consumed steps."""

    def __init__(self, num_samples: int, spec: JobSpec, nodes: Sequence[int] | None = None) -> None:
        self.n, self.c = num_samples, spec
        self.nodes = nodes
        self.moves = dict.fromkeys(("intra_node_samples", "intra_node_bytes", "cross_node_samples",
                                    "cross_node_bytes"), 0)
        self.cost = spec.cost_model()
        self.counts = [0] * num_samples
        self.steps = [0] * spec.world_size
        self.idle = self.emitted = self.moved = self.real = self.padded = self.over_budget = 0
        self.slowest = 0.0
        self.loss_err = 0.0

    def add(self, step: tuple[Step, ...]) -> None:
        c = self.c
        slowest, num, den = 0.0, 0.0, 0
        rank_sums = []
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
        if den:
            ref = math.fsum(rank_sums) / den
            self.loss_err = max(self.loss_err, abs(num / len(step) - ref))
        self.slowest += slowest

    def result(self, sim: Simulator, wall_s: float) -> dict[str, Any]:
        c = self.c
        rejected = {i for r in sim.ranks for i, _ in r.rejected}
        missing = sum(1 for i, k in enumerate(self.counts) if k == 0 and i not in rejected)
        duplicates = sum(k - 1 for k in self.counts if k > 1)
        steps = self.steps[0] if self.steps else 0
        n = c.world_size
        counters = collections.Counter()
        for r in sim.ranks:
            counters.update(r.counters)
        return {
            "policy": c.policy, "world_size": n, "token_budget": c.token_budget, "window": c.window,
            "mode": c.mode, "cost": c.cost, "align": sim.coordinator.policy.align, "seed": c.seed,
            "samples": self.n, "steps": steps, "steps_per_rank": list(self.steps), "rounds": sim.rounds,
            "idle": self.idle, "emitted": self.emitted, "missing": missing, "duplicates": duplicates,
            "moved": self.moved, "rejected": len(rejected), "truncated": counters["truncated"],
            "over_budget_samples": counters["over_budget"],
            "real_tokens": self.real, "padded_tokens": self.padded,
            "padding_efficiency": self.real / self.padded if self.padded else 1.0,
            "step_efficiency": self.real / (steps * n * c.token_budget) if steps else 0.0,
            "ideal_steps": math.ceil(self.real / (n * c.token_budget)) if self.real else 0,
            "compute_vs_limit": self.slowest / (self.real / n) if self.real else 0.0,
            "over_budget": self.over_budget, "loss_scale_error": self.loss_err,
            "wall_s": wall_s, "samples_per_s_per_rank": self.emitted / n / wall_s if wall_s > 0 else 0.0,
            **self.node_result(sim),
        }

    def node_result(self, sim: Simulator) -> dict[str, Any]:
        """The topology's part of `result`: moves split intra/cross node (totals and per-round means),
        how the rounds were planned, and the coordinator's planning time per round."""
        rounds = max(sim.rounds, 1)
        m = self.moves
        stats = sim.coordinator.plan_stats
        out: dict[str, Any] = {"local_ranks": sim.local_ranks or 1, "node_aware": sim.planned_by_node}
        for key, name in (("intra_node_moved", "intra_node_samples"), ("intra_node_bytes", "intra_node_bytes"),
                          ("cross_node_moved", "cross_node_samples"), ("cross_node_bytes", "cross_node_bytes")):
            out[key] = m[name]
            out[f"{key}_per_round"] = m[name] / rounds
        out.update({
            "node_planned_rounds": stats.get("node_aware", 0), "node_fallback_rounds": stats.get("node_fallback", 0),
            "node_swaps": stats.get("node_swaps", 0), "plan_per_round_s": sim.plan_s / rounds,
        })
        return out


def simulate(lengths: Sequence[int], spec: JobSpec,
             on_step: Callable[[tuple[Step, ...]], None] | None = None, local_ranks: int | None = None,
             node_aware: bool | None = None) -> dict[str, Any]:
    """Runs one epoch and returns the metrics dict `batchd simulate --json` prints.

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


def parse_lengths(lines: Iterable[str], source: str = "<lengths>") -> list[int]:
    """Parses one positive integer length per line; errors name `source` and the line (no I/O here:
    `batchd.read_lengths(path)` opens the file)."""
    out = []
    for lineno, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            raise ValueError(f"{source}:{lineno}: empty line (ids are 0-based line numbers)")
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"{source}:{lineno}: not an integer length: {text!r}") from None
        if n < 1:
            raise ValueError(f"{source}:{lineno}: length must be >= 1, got {n}")
        out.append(n)
    return out
