"""The simulator's metrics: what `batchd simulate` reports, accumulated from the consumed steps.

`SimMetrics` counts every aligned step the simulator yields (ids seen, padding, the slowest rank, the
loss-scale check over each optimizer update, moves under a topology) and `PhaseMetrics` the per-phase
balance of multimodal steps; `RESULT_FIELDS` says what each key of the result means. Metrics read the
simulator only at the end (`result`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

from ._encoders import EncoderCost
from ._phases import exchanged, imbalance, phase_loads, single_phase, vision_bound
from ._plan_moves import plan_moves, step_fetches
from ._spec import JobSpec
from ._step import Step

Simulator = Any  # `batchd.core.Simulator` (read at the end, by attribute; importing it would be a cycle)


def synthetic_token_loss(sample_id: int) -> float:
    """The simulator's per-token loss of every token of a sample (deterministic, in [0.5, 10.5))."""
    return 0.5 + ((sample_id * 2654435761) % 1000) / 100.0


EXCHANGED_KEYS = ("intra_node_images", "intra_node_rows", "cross_node_images", "cross_node_rows")


class EncoderPhase:
    """One encoder phase's balance over the consumed steps that hold its items (images for `VisionCost`,
    clips for `AudioCost`): sums of each step's max / mean rank load, single-phase (each rank encodes its own
    LLM samples' items) and planned (the steps' exchanges, the `Step` attribute `exchange`), of two per-step
    lower bounds (max(C / N, largest item) and `vision_bound`, over C / N), and the items the plan
    exchanged, intra- and cross-node (`EXCHANGED_KEYS`)."""

    def __init__(self, cost: EncoderCost, exchange: str) -> None:
        self.cost, self.exchange = cost, exchange
        self.steps = self.planned_steps = self.items = 0
        self.single = self.planned = self.bound = self.tight = 0.0
        self.moved = dict.fromkeys(EXCHANGED_KEYS, 0)

    def add(self, step: tuple[Step, ...], row: list[tuple[Any, ...]], nodes: Sequence[int] | None) -> None:
        loads = phase_loads(single_phase(row, self.cost), self.cost)
        single = imbalance(loads)
        if single is None:  # no item of this encoder in this step
            return
        costs = [self.cost.item(size) for s in step for x in s.samples for size, _ in self.cost.items(x)]
        mean = sum(loads) / len(loads)
        self.steps += 1
        self.items += len(costs)
        self.single += single
        self.bound += max(mean, max(costs)) / mean
        self.tight += vision_bound(costs, len(step)) / mean
        exchanges = [x for x in (getattr(s, self.exchange) for s in step) if x is not None]
        if len(exchanges) == len(step):
            self.planned_steps += 1
            self.planned += imbalance(phase_loads(exchanges, self.cost)) or 1.0
            for k, v in exchanged(exchanges, nodes).items():
                self.moved[k] += v

    def mean(self, total: float, planned: bool = False) -> float | None:
        """`total` over the steps with items (planned: with the plan's exchanges); None without any."""
        n = self.planned_steps if planned else self.steps
        return total / n if n else None


class PhaseMetrics:
    """Per-phase balance of consumed steps (module docstring): the LLM phase's max / mean rank cost per step,
    and each encoder phase's (`EncoderPhase`: vision, and audio when the workload has clips)."""

    KEYS = EXCHANGED_KEYS

    def __init__(self, spec: JobSpec, nodes: Sequence[int] | None = None) -> None:
        self.nodes = nodes
        self.steps = self.llm_steps = 0
        self.llm = 0.0
        self.vision = EncoderPhase(spec.vision_cost(), "exchange")
        self.audio = EncoderPhase(spec.audio_cost(), "audio_exchange")

    def add(self, step: tuple[Step, ...]) -> None:
        self.steps += 1
        llm = imbalance([s.info.cost for s in step])
        if llm is not None:
            self.llm_steps += 1
            self.llm += llm
        row = [s.samples for s in step]
        self.vision.add(step, row, self.nodes)
        self.audio.add(step, row, self.nodes)

    def result(self, sim: Simulator) -> dict[str, Any]:
        steps = max(self.steps, 1)
        plans = sim.vision_plan_s
        v, a = self.vision, self.audio
        out: dict[str, Any] = {
            "phases": sim.spec.phases.count,
            "images": v.items,
            "vision_steps": v.steps,
            "llm_imbalance": self.llm / self.llm_steps if self.llm_steps else None,
            "vision_imbalance_single": v.mean(v.single),
            "vision_imbalance_two": v.mean(v.planned, planned=True),
            "vision_bound": v.mean(v.bound),
            "vision_bound_pigeonhole": v.mean(v.tight),
        }
        for k in self.KEYS:
            out[f"exchanged_{k}_per_step"] = v.moved[k] / steps
        out["vision_plan_rounds"] = len(plans)
        out["vision_plan_per_round_s"] = sum(plans) / len(plans) if plans else 0.0
        if sim.has_audio:
            out.update(
                {
                    "audio_clips": a.items,
                    "audio_steps": a.steps,
                    "audio_imbalance_single": a.mean(a.single),
                    "audio_imbalance_two": a.mean(a.planned, planned=True),
                    "audio_bound_pigeonhole": a.mean(a.tight),
                    "exchanged_cross_node_clips_per_step": a.moved["cross_node_images"] / steps,
                }
            )
        return out


class SimMetrics:
    """Accumulates the `batchd simulate` metrics from consumed steps (with a multimodal workload or
    phases=2, also `PhaseMetrics`)."""

    def __init__(self, num_samples: int, spec: JobSpec, nodes: Sequence[int] | None = None) -> None:
        self.n, self.c = num_samples, spec
        self.nodes = nodes
        self.moves = dict.fromkeys(
            (
                "intra_node_samples",
                "intra_node_bytes",
                "cross_node_samples",
                "cross_node_bytes",
                "intra_node_fetched",
                "cross_node_fetched",
            ),
            0,
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
        self.quality: list[tuple[int, int, float, int]] = []  # per step: real, padded, slowest, ranks
        self.segments: list[dict[str, Any]] = []  # one per world size in a row (`start_segment`)
        self.start_segment(spec.world_size, nodes)

    def start_segment(self, world_size: int, nodes: Sequence[int] | None) -> None:
        """The steps from the next one on run at `world_size` ranks on `nodes` (a resize)."""
        self.nodes = self.phases.nodes = nodes
        self.steps += [0] * (world_size - len(self.steps))
        self.segments.append(
            {"world_size": world_size, "first_step": len(self.quality), "steps_per_rank": [0] * world_size}
        )

    def add(self, step: tuple[Step, ...]) -> None:
        c = self.c
        slowest, num, den = 0.0, 0.0, 0
        rank_sums: list[float] = []
        real0, padded0 = self.real, self.padded
        for k, v in plan_moves([[s.samples] for s in step], self.nodes).items():
            self.moves[k] += v
        for k, v in step_fetches(step, self.nodes).items():
            self.moves[k] += v
        for rank, s in enumerate(step):
            self.steps[rank] += 1
            self.segments[-1]["steps_per_rank"][rank] += 1
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
        self.quality.append((self.real - real0, self.padded - padded0, slowest, len(step)))
        self.phases.add(step)

    @property
    def steps_taken(self) -> int:
        """Steps added so far."""
        return len(self.quality)

    def window_quality(self, first: int, steps: int) -> dict[str, Any]:
        """Padding efficiency and compute_vs_limit of the consumed steps first .. first + steps - 1."""
        q = self.quality[first : first + steps]
        real, padded = sum(x[0] for x in q), sum(x[1] for x in q)
        ideal = sum(x[0] / x[3] for x in q)
        return {
            "first_step": first,
            "steps": len(q),
            "padding_efficiency": real / padded if padded else 1.0,
            "compute_vs_limit": sum(x[2] for x in q) / ideal if ideal else 0.0,
        }

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
        steps = len(self.quality)
        n = c.world_size
        ideal = sum(x[0] / x[3] for x in self.quality)
        capacity = sum(x[3] for x in self.quality) * c.token_budget
        counters: collections.Counter[str] = collections.Counter()
        for r in sim.ranks:
            counters.update(r.counters)
        return {
            "policy": c.policy.name,
            "world_size": n,
            "token_budget": c.token_budget,
            "window": c.policy.window,
            "mode": c.mode,
            "cost": c.cost.name,
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
            "step_efficiency": self.real / capacity if capacity else 0.0,
            "ideal_steps": math.ceil(self.real / (n * c.token_budget)) if self.real else 0,
            "compute_vs_limit": self.slowest / ideal if ideal else 0.0,
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
            **(self.phases.result(sim) if sim.multimodal or c.phases.count == 2 else {}),
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
            ("intra_node_fetched", "intra_node_fetched"),
            ("cross_node_fetched", "cross_node_fetched"),
        ):
            out[key] = m[name]
            out[f"{key}_per_round"] = m[name] / rounds
        out.update(
            {
                "node_planned_rounds": stats.get("node_aware", 0),
                "node_fallback_rounds": stats.get("node_fallback", 0),
                "node_swaps": stats.get("node_swaps", 0),
                "node_local_rounds": stats.get("node_local", 0),
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
    "intra_node_fetched": "payloads a rank fetched from another rank of its node: the moved samples and, "
    "two-phase, the samples of the images (clips) it encodes for another rank (distinct per step)",
    "cross_node_fetched": "those it fetched from another node (the daemon's Fetch over the network)",
    "intra_node_fetched_per_round": "per round",
    "cross_node_fetched_per_round": "per round",
    "node_planned_rounds": "rounds planned node-aware",
    "node_fallback_rounds": "rounds planned node-blind",
    "node_swaps": "group pairs swapped across nodes by the node-aware plan",
    "node_local_rounds": "rounds planned node-local (node_local, additive costs)",
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
    "segments": "with --resize: each world size in a row, its first step and steps per rank (equal in one)",
    "resizes": "with --resize: per change, the step it was made at (the first update boundary at or after "
    "the one asked; null if the epoch ended first), the world sizes from and to, and padding_efficiency / "
    "compute_vs_limit of the 8 steps after it (after) and of the same steps run without any change (without)",
    "audio_clips": "audio clips in the workload (a workload with audio columns)",
    "audio_steps": "steps with audio cost",
    "audio_imbalance_single": "audio phase, every rank encoding its own clips: mean max / mean",
    "audio_imbalance_two": "audio phase under the phase plan (phases 2): mean max / mean",
    "audio_bound_pigeonhole": "audio phase's per-step lower bound (a clip is never split), mean over steps",
    "exchanged_cross_node_clips_per_step": "phases 2: audio clips encoded on another node",
    "vision_plan_rounds": "rounds the vision plan ran",
    "vision_plan_per_round_s": "its seconds per round",
}
