"""`batchd bench`'s options (`BenchOptions`, validated, the job's defaults taken from `JobSpec`), its flags
(`add_arguments`, shared with benchmarks/bench_systems.py), its systems, devices and workloads. Imports
neither torch nor the bench's processes: `batchd`'s parser reads it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from batchd._job_keys import add_job_flags
from batchd.core import JobSpec, check_int

SYSTEMS = ("fixed", "odb-0.1.2", "batchd-odb", "batchd-balanced", "batchd-packed", "batchd-2phase")
# The default systems of a multimodal workload (a .csv with images): the two-phase comparison.
MM_SYSTEMS = ("fixed", "odb-0.1.2", "batchd-balanced", "batchd-2phase")
# batchd systems: (policy, collate = cost model, phases). `batchd-packed` groups under the packed cost model
# (a group's cost is its token sum) and collates one packed row per step, trained with varlen attention.
# `batchd-2phase` is `batchd-balanced` with the vision encoder balanced too (OrchMLLM two-phase: each rank
# encodes the images the plan gives it, one all-to-all returns the embeddings to their samples' ranks).
BATCHD_SYSTEMS = {
    "batchd-odb": ("odb", "padded", 1),
    "batchd-balanced": ("balanced", "padded", 1),
    "batchd-packed": ("balanced", "packed", 1),
    "batchd-2phase": ("balanced", "padded", 2),
}
REPO = Path(__file__).resolve().parents[1]
# The public length workloads ship inside the package (batchd/workloads/*.txt, package data), so the
# installed console script finds its default workload; the multimodal .csv ones live in the checkout.
WORKLOADS = Path(__file__).resolve().parent / "workloads"
WORKLOAD_DIRS = (WORKLOADS, REPO / "benchmarks" / "workloads")
# `--model tiny-qwen2vl` (the stock HF Qwen2-VL through `batchd.two_phase`): a multimodal workload and its
# systems by default, the packed one included (one row per step, M-RoPE per sample)
HF_VLM_DEFAULTS = {"workload": "bimodal.csv", "num_samples": 256}
HF_VLM_SYSTEMS = ("fixed", "odb-0.1.2", "batchd-balanced", "batchd-2phase", "batchd-packed")
# the bench trainer's models (`batchd._train.models.MODELS`)
MODEL_NAMES = ("tiny", "llama-100m", "tiny-qwen2vl")
HF_MODEL_NAMES = ("tiny-qwen2vl",)
LR_SCALING = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}
DEFAULTS = {  # per device: world size, model, workload file name, token budget, samples
    "cpu": {
        "world_size": 2,
        "model": "tiny",
        "workload": "odb-synthetic.txt",
        "token_budget": 8192,
        "num_samples": 1024,
    },
    "cuda": {
        "world_size": 1,
        "model": "llama-100m",
        "workload": "sharegpt4o-like.txt",
        "token_budget": 16384,
        "num_samples": 2048,
    },
}


def default_workload(name: str = "odb-synthetic.txt") -> Path | None:
    """The workload file `name` ($BATCHD_WORKLOADS, then the package's batchd/workloads, then the checkout's
    benchmarks/workloads); None when none holds it."""
    dirs = [Path(os.environ["BATCHD_WORKLOADS"])] if os.environ.get("BATCHD_WORKLOADS") else []
    for d in [*dirs, *WORKLOAD_DIRS]:
        if (d / name).is_file():
            return d / name
    return None


def odb_available() -> str | None:
    """None when `odb` 0.1.2 imports, else why not."""
    try:
        import odb
    except ImportError as exc:
        return f"online-dynamic-batching is not installed ({exc}); pip install 'batchd[bench]'"
    if getattr(odb, "__version__", "") != "0.1.2":
        return f"odb {getattr(odb, '__version__', '?')} is installed, the bench compares against 0.1.2"
    return None


def parse_systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SYSTEMS]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"systems must be distinct names from {','.join(SYSTEMS)}, got {text=}")
    return names


@dataclass(frozen=True)
class BenchOptions:
    """What `run_bench` runs; None fields take the device's default (`DEFAULTS`) or `JobSpec`'s, filled in
    here.

    Args:
        workload: Length file (one length per line; id = line number), or a multimodal .csv. None: the
            device's default workload in batchd/workloads (odb-synthetic on CPU, sharegpt4o-like on CUDA).
        num_samples: Train on the first `num_samples` lengths (None: the device default).
        world_size: Trainer processes (None: 2 on CPU, 1 on CUDA).
        token_budget: L_max per rank step (None: 8192 on CPU, 16384 on CUDA).
        systems: Names from `SYSTEMS`, run in this order (None: all but `batchd-2phase`; for a multimodal
            workload `MM_SYSTEMS`).
        device: "cpu" (gloo) or "cuda" (NCCL, bf16).
        model: "tiny", "llama-100m" or "tiny-qwen2vl" (the stock HF Qwen2-VL through `batchd.two_phase`;
            default workload bimodal.csv, 256 samples, `HF_VLM_SYSTEMS`) (None: tiny on CPU,
            llama-100m on CUDA).
        out: Directory for bench.json and the PNG plots (None: no files).
        seed: Seeds the model, the sampler views and the synthetic samples (None, like window, depth,
            epochs and deterministic: `JobSpec`'s default).
        window: Per-rank window in samples (batchd `--window`, ODB `buffer_size`).
        depth: batchd's per-rank ready batches (`--depth`).
        heldout: Samples after the training set evaluated after every epoch, clock paused (0: none).
        odb_workers: ODB DataLoader workers per rank (prefetch_factor = window / workers).
        lr: AdamW learning rate (all systems).
        lr_scaling: "sqrt": every system's step uses lr x sqrt(step tokens / fixed batching's mean step
            tokens) (the square-root scaling rule for Adam-type optimizers, one rule for all systems);
            "linear": lr x that ratio; "none": the constant lr everywhere (token-budget batchers then
            take fewer steps of the same size as fixed batching's and end an epoch at a higher loss).
        timeout: Seconds per system.
        repeats: Runs per system, interleaved (the order rotates each round so that drift in the
            machine's speed does not land on one system); each system reports its median-wall run.
        plots: Write PNGs under `out`.
        epochs: Epochs every system trains (epoch e: the views of epoch e, for every system).
        step_time: Seconds every system's trainers sleep per step, a stand-in for a large model's step
            (tests that slow trainers never fail a job); 0 in measurements.
        deterministic: The batchd systems' `JobSpec.deterministic` (batches independent of timing).
        accumulate: K: fixed and ODB 0.1.2 step the optimizer once per K steps (gradient accumulation,
            the update's gradient its per-token mean; `batchd._train.bench_data.Window`).
        tokens_per_update: The batchd systems' `JobSpec.tokens_per_update`; "auto": fixed batching's
            mean global loss tokens per update (with `accumulate`), the comparison at equal update
            semantics. With either, the learning-rate rule compares an update's tokens with fixed
            batching's mean per update.

    Raises:
        ValueError: on a bad option (the message names the value).
    """

    workload: str | Path | None = None
    num_samples: int | None = None
    world_size: int | None = None
    token_budget: int | None = None
    systems: Sequence[str] | None = None
    device: str = "cpu"
    model: str | None = None
    out: str | Path | None = None
    seed: int | None = None
    window: int | None = None
    depth: int | None = None
    heldout: int = 64
    odb_workers: int = 2
    lr: float = 1e-3
    timeout: float = 1800.0
    repeats: int = 1
    lr_scaling: str = "sqrt"
    plots: bool = True
    epochs: int | None = None
    step_time: float = 0.0
    deterministic: bool | None = None
    accumulate: int = 1
    tokens_per_update: int | str | None = None

    def __post_init__(self) -> None:
        if self.device not in DEFAULTS:
            raise ValueError(f"device must be cpu or cuda, got device={self.device!r}")
        d = DEFAULTS[self.device]
        fill = {"world_size": d["world_size"], "model": d["model"], "token_budget": d["token_budget"]}
        for name, default in fill.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if self.num_samples is None:
            object.__setattr__(self, "num_samples", (HF_VLM_DEFAULTS if self.hf_vlm else d)["num_samples"])
        # the job's fields are validated by JobSpec itself (the one set of rules every command uses)
        job = self.job()  # None: the spec's default
        policy = {"window": job.policy.window, "depth": job.policy.depth, "seed": job.seed}
        for name, value in {**policy, "epochs": job.epochs, "deterministic": job.deterministic}.items():
            object.__setattr__(self, name, value)
        for name, lo in (
            ("accumulate", 1),
            ("num_samples", 1),
            ("heldout", 0),
            ("odb_workers", 1),
            ("repeats", 1),
        ):
            check_int(name, getattr(self, name), lo=lo)
        if self.model not in MODEL_NAMES:
            raise ValueError(f"model must be one of {sorted(MODEL_NAMES)}, got model={self.model!r}")
        if self.systems is not None:
            object.__setattr__(self, "systems", tuple(parse_systems(",".join(self.systems))))
        if self.lr_scaling not in LR_SCALING:
            raise ValueError(
                f"lr_scaling must be one of {list(LR_SCALING)}, got lr_scaling={self.lr_scaling!r}"
            )

    @property
    def hf_vlm(self) -> bool:
        """Whether the model is the stock HF Qwen2-VL (its own default workload and systems)."""
        return self.model in HF_MODEL_NAMES

    def job(self) -> JobSpec:
        """The batchd systems' job: these options' fields over `JobSpec`'s defaults (its policy, collate
        and phases set per system); `tokens_per_update` "auto" is not in it (`run_bench` derives it)."""
        given = dict(
            window=self.window,
            depth=self.depth,
            seed=self.seed,
            epochs=self.epochs,
            deterministic=self.deterministic,
        )
        job = JobSpec.from_keys(
            world_size=self.world_size,
            token_budget=self.token_budget,
            **{k: v for k, v in given.items() if v is not None},
        )
        if self.tokens_per_update is not None and self.tokens_per_update != "auto":
            job = job.replace(tokens_per_update=self.tokens_per_update)  # validated there
        return job


HELP = """Side-by-side real training run: fixed batching, the seed's ODB 0.1.2 package and batchd
(policies odb and balanced) train the same model on the same samples, one system after another, as N
real processes in DDP (gloo on CPU). Reports per system the epoch wall time (from the moment every rank
holds its first batch to the last rank's last optimizer step; start-up is excluded for all systems
alike and shown as startup_s), samples, steps, padding efficiency (real / materialized tokens), the
loss curve, the final loss (per-token, last 10% of steps) and a held-out loss of the final model,
with speedups vs fixed and vs odb-0.1.2; every system must train on every sample id exactly once per
epoch (missing / duplicates; --epochs). PNG plots (loss vs step, loss vs wall time, wall-time bars)
and bench.json go to --out. odb-0.1.2 is skipped when online-dynamic-batching 0.1.2 is not installed
(pip install 'batchd[bench]')."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `batchd bench` (shared with benchmarks/bench_systems.py, which parses the same ones)."""
    add_job_flags(
        p,
        only=("world_size", "token_budget", "window", "depth", "seed", "epochs", "deterministic"),
        spec_defaults=True,
        shown={"world_size": "2 on cpu, 1 on cuda", "token_budget": "8192 on cpu, 16384 on cuda"},
    )
    _add_data(p)
    _add_training(p)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per system run (default 1800)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="R",
        help="runs per system, interleaved in rotating order; the median-wall run is reported (default 1)",
    )
    p.add_argument("--out", metavar="DIR", default=None, help="write bench.json and PNG plots here")
    p.add_argument("--json", action="store_true", help="print one JSON object (loss curves included)")


def _add_data(p: argparse.ArgumentParser) -> None:
    """What is trained: the workload, its samples, the systems, the device and the model."""
    p.add_argument(
        "--workload",
        metavar="FILE",
        default=None,
        help="length file, one length per line (default: the packaged odb-synthetic.txt on cpu, "
        "sharegpt4o-like.txt on cuda), or a multimodal .csv (docs/workloads.md): synthetic "
        "images and the tiny MLLM (batchd.TinyMLLM)",
    )
    p.add_argument(
        "--num-samples",
        type=int,
        default=None,
        metavar="M",
        help="train on the first M lengths (default: 1024 on cpu, 2048 on cuda)",
    )
    p.add_argument(
        "--heldout",
        type=int,
        default=64,
        metavar="H",
        help="evaluate the model after every epoch on the H samples after the training set, clock "
        "paused (default 64; 0: none)",
    )
    p.add_argument(
        "--systems",
        default=None,
        help="comma-separated, run in this order (default: "
        f"{','.join(s for s in SYSTEMS if s != 'batchd-2phase')}; "
        f"for a multimodal .csv workload {','.join(MM_SYSTEMS)})",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo DDP; cuda: NCCL, bf16, one GPU per rank (default cpu)",
    )
    p.add_argument(
        "--model",
        choices=MODEL_NAMES,
        default=None,
        help="tiny: ~0.5M-param Llama-style LM (cpu default); llama-100m: ~110M params, 12 layers, "
        "d_model 768, randomly initialised (cuda default); tiny-qwen2vl: the stock Hugging Face "
        "Qwen2VLForConditionalGeneration (2-block ViT, 2-layer M-RoPE LM) adapted by "
        "batchd.two_phase, by default on benchmarks/workloads/bimodal.csv (256 samples) with "
        f"{','.join(HF_VLM_SYSTEMS)}",
    )


def _add_training(p: argparse.ArgumentParser) -> None:
    """How every system trains: step time, ODB's workers, the learning rate and the updates."""
    p.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        metavar="S",
        help="every trainer sleeps S seconds per step (a large model's step time; default 0)",
    )
    p.add_argument(
        "--odb-workers",
        type=int,
        default=2,
        metavar="K",
        help="ODB DataLoader workers per rank; prefetch_factor = W / K (default 2)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, all systems (default 1e-3)")
    p.add_argument(
        "--lr-scaling",
        choices=tuple(LR_SCALING),
        default="sqrt",
        help="sqrt: each step's lr = lr x sqrt(its tokens / fixed batching's mean step tokens), the "
        "same rule for every system; linear: lr x that ratio; none: constant lr (default sqrt)",
    )
    p.add_argument(
        "--accumulate",
        type=int,
        default=1,
        metavar="K",
        help="fixed and ODB 0.1.2: one optimizer update per K steps (gradient accumulation; default 1)",
    )
    p.add_argument(
        "--tokens-per-update",
        default=None,
        metavar="G|auto",
        type=lambda v: v if v == "auto" else int(v),
        help="batchd systems: one optimizer update per G global loss tokens; auto: fixed batching's "
        "mean per update (with --accumulate: the comparison at equal update semantics; default off)",
    )
