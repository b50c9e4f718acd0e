"""What both paths of `batchd demo` share: its options (`DemoOptions`), one run's parts (`DemoRun`: the
processes, the temp dir, the trainers of a phase) and the summary of the trainers' results (`summarize`).

Imports neither Ray nor torch: the CLI builds its `demo` flags from `DemoOptions`' defaults.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from batchd.core import KEYS, JobSpec, check_bool, check_choice, check_int, check_number, mean_imbalance
from batchd.launch import Processes, start_node_agents, start_trainers, wait_trainers
from batchd.proto import Progress

DEMO_BUDGET = 1024
# The fixed-batching baseline's batch size: the bench's B on its default workload (floor(8192 / 4064)), what
# a user would pick; on the tiny CPU model a step of two samples up to L each cannot run out of memory.
BASELINE_BATCH_SIZE = 2


def _job_default(key: str) -> Any:
    """`JobSpec`'s default of the job key `key` (`batchd.core.KEYS`): the one home of job defaults."""
    return KEYS[key].field.default


def _check_range(name: str, value: Any, lo: float, hi: float | None = None) -> None:
    """Raises ValueError naming `value` unless it is a number in [lo, hi] (hi None: no upper bound)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not lo <= value <= (float("inf") if hi is None else hi):
        bounds = f">= {lo:g}" if hi is None else f"in [{lo:g}, {hi:g}]"
        raise ValueError(f"{name} must be a number {bounds}, got {name}={value!r}")


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """What `batchd.demo.run_demo` runs: `batchd demo`'s flags, whose defaults these are.

    The job: `world_size` ranks, `token_budget` L (the demo's own defaults: 2 and `DEMO_BUDGET`), and
    `policy`, `window`, `depth`, `seed`, `deterministic` (`JobSpec`'s keys and defaults; `deterministic`:
    the same data, seed and config give the same batches, steps and losses, `step_digests` and `losses`
    in the summary, whatever the actors' and trainers' speed). `phases` (None: 2 for the image data of
    the Ray path under policy balanced, else 1): with 2 the coordinator also balances the vision encoder
    every step (`batchd.core.plan_vision`) and the trainers' `TinyMLLM` exchanges the image embeddings
    with one all-to-all per step (and in rounds with clips the audio encoder's likewise). Two-phase is
    the default for image data because its cost is one collective of a few embedding rows while an
    unbalanced encoder phase makes every rank wait for the one that holds most images (`vision_imbalance`
    in the summary).

    The run: `num_samples` (generated records, or synthetic samples), `baseline` (also the same epoch with
    fixed batching), `step_time` (seconds each batchd trainer sleeps per step: a real model's step time;
    the job must not mind), `timeout` (seconds each phase's trainers may take), `keep_dir` (leave the
    temporary directory, and start no reaper).

    The data. Ray path (default): `dataset` (None: generate `num_samples` demo records,
    `DEMO_AUDIO_FRACTION` of them with clips where the chain turns clips into audio tokens,
    `audio_model_cfg`), `num_actors` preprocessing actors in all (the same number per rank, at least one
    each), `ray_address` (None: start a local Ray here, which the node agent joins), `tokenizer` (None:
    the demo tokenizer), `processor` (a Hugging Face processor directory whose `HFProcessor` replaces the
    built-in template/tokenizer/vision/audio stages; its tokenizer sizes the model unless `tokenizer` is
    given; clips only when it has an audio feature extractor), `memory_budget` and `max_bad_fraction`
    (the node agent's [data] keys; None: their defaults, and for the generated dataset at least twice
    its bad records' share of a rank's view). `synthetic=True`: synthetic samples, no Ray.

    Raises ValueError naming the first bad field (a job key as `JobSpec` names it).
    """

    world_size: int = 2
    token_budget: int = DEMO_BUDGET
    policy: str = _job_default("policy")
    window: int = _job_default("window")
    depth: int = _job_default("depth")
    seed: int = _job_default("seed")
    deterministic: bool = _job_default("deterministic")
    phases: int | None = None
    num_samples: int = 1024
    baseline: bool = True
    step_time: float = 0.0
    timeout: float = 900.0
    keep_dir: bool = False
    synthetic: bool = False
    dataset: str | None = None
    num_actors: int = 2
    ray_address: str | None = None
    tokenizer: str | None = None
    processor: str | None = None
    memory_budget: str | None = None
    max_bad_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.phases is not None:
            check_choice("phases", self.phases, (1, 2))
        self.job()  # the job keys, as JobSpec names them
        check_int("num_samples", self.num_samples, lo=1)
        check_int("num_actors", self.num_actors, lo=1)
        for name in ("baseline", "keep_dir", "synthetic"):
            check_bool(name, getattr(self, name))
        check_number("timeout", self.timeout)
        _check_range("step_time", self.step_time, 0.0)
        if self.max_bad_fraction is not None:
            _check_range("max_bad_fraction", self.max_bad_fraction, 0.0, 1.0)
        if self.synthetic and self.dataset is not None:
            raise ValueError(f"synthetic samples or a dataset, not both: got dataset={self.dataset!r}")

    def phase_count(self) -> int:
        """`phases`, or its default: 2 for the image data of the Ray path under policy balanced, else 1."""
        if self.phases is not None:
            return self.phases
        return 2 if not self.synthetic and self.policy == "balanced" else 1

    def job(self) -> JobSpec:
        """The job these options run (`phase_count()` phases)."""
        return JobSpec.from_keys(
            world_size=self.world_size,
            token_budget=self.token_budget,
            policy=self.policy,
            window=self.window,
            depth=self.depth,
            seed=self.seed,
            deterministic=self.deterministic,
            phases=self.phase_count(),
        )


@dataclasses.dataclass(frozen=True)
class DemoRun:
    """One demo run's parts: its `options`, the child processes (`procs`) in the temp dir `work`, the run
    marker its children inherit, the job's flags (`spec`: `batchd.launch.spec_argv`), the progress
    printers (`say`: the demo's lines; `show`: None for no trainer progress) and its start time."""

    options: DemoOptions
    procs: Processes
    work: Path
    marker: str
    spec: list[str]
    say: Callable[[str], None]
    show: Callable[[str], None] | None
    t_start: float

    def trainers(
        self, tag: str, common: dict[str, Any], per_rank: list[dict[str, Any]], total: int, desc: str
    ) -> list[dict[str, Any]]:
        """Runs one phase's trainers (`common` and `per_rank[r]`: their settings) and returns their
        results; with `show` shows the phase's progress in samples of every rank together out of `total`
        (a bar on a terminal, else a line every $BATCHD_PROGRESS_S seconds)."""
        n = self.options.world_size
        _, outs = start_trainers(self.procs, self.work, tag, n, common, per_rank)
        bar = Progress(desc, total, "samples", emit=self.show) if self.show is not None else None
        return wait_trainers(self.procs, tag, outs, self.options.timeout, bar)

    def start_services(self, lengths_file: Path | None, node_args: tuple[str, ...] = ()) -> list[int]:
        """Starts the coordinator and one node agent that serves every rank (`start_node_agents`:
        `lengths_file` or `node_args` say what it serves); returns each rank's service port."""
        n = self.options.world_size
        _, ports = start_node_agents(
            self.procs, self.work, self.spec, n, n, lengths_file, node_args=node_args
        )
        return ports

    def service_addresses(self, ports: list[int]) -> list[dict[str, Any]]:
        """The batchd trainers' per-rank settings: rank r's service at 127.0.0.1:`ports[r]`."""
        return [{"service": f"127.0.0.1:{ports[r]}"} for r in range(self.options.world_size)]


def kept_quarantine(work: Path) -> Path:
    """Where the demo leaves its quarantine file (beside its temporary directory, which it removes)."""
    return work.with_name(work.name + "-quarantine.jsonl")


def add_baseline(summary: dict[str, Any], b: dict[str, Any], bs: int) -> None:
    """Adds the fixed-batching run `b` (`summarize` of its trainers, at batch size `bs`) to `summary`."""
    summary["baseline"] = {
        "wall_s": b["wall_s"],
        "steps": b["steps_per_rank"][0],
        "batch_size": bs,
        "padding_efficiency": b["padding_efficiency"],
        "loss_last": b["loss_last"],
        "stall_fraction": b["stall_fraction"],
        "vision_imbalance": b["vision_imbalance"],
        "clips": b["clips"],
        "audio_imbalance": b["audio_imbalance"],
    }
    summary["speedup"] = b["wall_s"] / summary["wall_s"]


def summarize(
    lengths: list[int],
    results: list[dict[str, Any]],
    check_coverage: bool = True,
    expected_ids: Iterable[int] | None = None,
) -> dict[str, Any]:
    """The demo's metrics over the trainers' results; `missing` counts ids of `expected_ids` (default:
    0 .. len(lengths) - 1) that no trainer trained on."""
    ids = [i for r in results for step in r["sample_ids"] for i in step]
    counts: dict[int, int] = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    real = sum(r["real_tokens"] for r in results)
    padded = sum(r["padded_tokens"] for r in results)
    losses = [x for x in results[0]["losses"] if x == x]
    stalls = [r.get("wait_s", 0.0) / r["wall_s"] if r["wall_s"] > 0 else 0.0 for r in results]
    return {
        "steps_per_rank": [r["steps"] for r in results],
        "step_digests": step_digests(results),
        "losses": losses,
        "emitted": len(ids),
        "missing": sum(
            1 for i in (range(len(lengths)) if expected_ids is None else expected_ids) if i not in counts
        ),
        "duplicates": sum(c - 1 for c in counts.values() if c > 1),
        "idle": sum(r["idle"] for r in results),
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_efficiency": real / padded if padded else 1.0,
        "wall_s": max(r["wall_s"] for r in results),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "stall_fraction": max(stalls),
        "stall_fraction_per_rank": stalls,
        "vision_imbalance": vision_imbalance(results),
        "clips": sum(sum(r.get("encoded_clips", ())) for r in results),
        "audio_imbalance": vision_imbalance(results, "encoded_frames"),
    }


def step_digests(results: list[dict[str, Any]]) -> list[str]:
    """One short digest per global step: of every rank's sample ids at that step, in rank order (two runs
    made the same batches iff their digests are equal)."""
    per_rank = [r["sample_ids"] for r in results]
    steps = max((len(p) for p in per_rank), default=0)
    return [
        hashlib.sha256(json.dumps([p[k] if k < len(p) else None for p in per_rank]).encode()).hexdigest()[:16]
        for k in range(steps)
    ]


def vision_imbalance(results: list[dict[str, Any]], load: str = "encoded_patches") -> float | None:
    """The mean over steps with images of (max / mean) of the encoder patches the ranks ran (1.0: every
    rank encoded alike); None when no step had an image or a trainer did not record them. `load`
    "encoded_frames": the same of the audio encoder's frames, over steps with clips."""
    per_rank = [r.get(load) for r in results]
    if not all(per_rank) or len({len(p) for p in per_rank}) != 1:
        return None
    return mean_imbalance(zip(*per_rank, strict=False))
