"""`batchd bench`: the side-by-side real training run of fixed batching, ODB 0.1.2 and batchd.

Same data, same model, same seed, optimizer and token budget, N real trainer processes in DDP
(`batchd._train.bench`, gloo on CPU): for each system in turn it trains one epoch over the first
`num_samples` lengths of a workload file (synthetic tokenized samples of exactly those lengths: the
content batchd's `SyntheticSource` makes for each id) and reports wall time, samples, steps, padding
efficiency, the loss curve, the final loss and a held-out loss, plus the speedups over `fixed` and
`odb-0.1.2`, and draws PNG plots (matplotlib, Agg).

Systems:

- `fixed`: DistributedSampler-style views, fixed batch size B = floor(L_max / longest sample) (the
  out-of-memory-safe choice when lengths are not known before preprocessing), padded.
- `odb-0.1.2`: the seed's own package (`online-dynamic-batching==0.1.2`, the `bench` extra only;
  skipped with a message when it is not installed), driven as its README says: `odb.apply` on a
  multi-worker `DataLoader(batch_size=1)`, its collate process and Gloo alignment group, exact token
  loss scaling, join mode with torch's DDP `Join` context. Its `buffer_size` is batchd's window.
- `batchd-odb`, `batchd-balanced`: a coordinator and N rank services (`batchd rank --lengths`, launched
  with `batchd.demo`'s helpers) with that policy, the same window, padded collation.
- `batchd-packed`: policy `balanced` under the packed cost model (a group costs its token sum, up to
  L_max), one packed row per step (`--collate packed --cost packed`), trained with the model's varlen
  attention (one causal attention per sample). The only system that does not pad: ODB 0.1.2 groups
  under the padded cost (k x longest <= L), which is what its budget means.

Every system trains on the same ids, split into the same per-rank views (batchd's seeded permutation);
the check `missing` / `duplicates` is reported per system. Wall time: the clock starts after every
rank has fetched its first batch (a barrier), so process start-up, gloo rendezvous, model build, Ray
(none is used here), ODB's worker/collate-process start and startup jitter, and batchd's first round
are excluded for every system alike (reported as `startup_s`); it stops at the last rank's last
optimizer step. See `batchd/_train/bench.py` for the per-rank loop.

`--model tiny-qwen2vl` trains the stock Hugging Face `Qwen2VLForConditionalGeneration` of `batchd._vlm_tiny`
adapted by `batchd.two_phase` (every system calls it through `forward_logits`), by default on
`benchmarks/workloads/bimodal.csv` (256 samples) with `HF_VLM_SYSTEMS` (packed included: one row, restarting
position_ids, per-sample M-RoPE). On multimodal workloads every system also reports rank 0's vision tower
share of its time (`vision_share`, `vision_share_mean`: `batchd._train.models.VisionTimer`); figures in
docs/benchmarks.md.

`--device cuda` runs world size 1 with a randomly initialised ~110M-parameter Llama-style model
(`--model llama-100m`, bf16) on the sharegpt4o-like workload by default. Trade-offs: the systems run
one after another on the same machine (not interleaved), so slow drift of the machine's speed lands
on one system; on a 2-core box the data-side processes (ODB's workers and collate process, batchd's
coordinator and rank services) compete with the trainers for CPU, which is part of what is measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from batchd._job_keys import add_job_flags
from batchd._lengths import read_workload
from batchd.core import JobSpec, Sample, check_int, format_workload, mean_imbalance
from batchd.launch import Processes, spec_argv, start_services, start_trainers, wait_trainers
from batchd.proto import Progress

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


# -- running one system ----------------------------------------------------------------------------
def run_system(
    system: str,
    work: Path,
    common: dict[str, Any],
    job: JobSpec,
    timeout: float,
    tag: str | None = None,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Runs one system's N trainers (and, for batchd, its coordinator and rank services, on `job` with the
    system's policy and layout) in `work/tag`; returns their results. `progress` follows the trainers'
    samples (every rank together) and is closed."""
    world_size = job.world_size
    sys_dir = work / (tag or system)
    sys_dir.mkdir()
    procs = Processes(sys_dir)
    try:
        per_rank: list[dict[str, Any]] = [{} for _ in range(world_size)]
        if system.startswith("batchd-"):
            policy, layout, phases = BATCHD_SYSTEMS[system]
            args = spec_argv(job.replace(policy=policy, collate=layout, cost=layout, phases=phases))
            workload = work / ("workload.csv" if common.get("images") else "lengths.txt")
            _, ports = start_services(procs, sys_dir, args, world_size, workload)
            per_rank = [{"service": f"127.0.0.1:{p}"} for p in ports]
        _, outs = start_trainers(
            procs,
            sys_dir,
            "trainer",
            world_size,
            {**common, "system": system},
            per_rank,
            module="batchd._train.bench",
        )
        return wait_trainers(procs, "trainer", outs, timeout, progress)
    finally:
        if progress is not None:
            progress.close()
        procs.stop()


def _epoch_evals(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Held-out loss after each epoch (rank 0 evaluates), with the time the epoch ended (all ranks done)."""
    evals = next((r["epoch_evals"] for r in results if r.get("eval")), [])
    return [
        {"epoch": e["epoch"], "t": max(r["epoch_evals"][k]["t"] for r in results), "loss": e["eval"]["loss"]}
        for k, e in enumerate(evals)
    ]


def summarize(
    system: str, results: list[dict[str, Any]], num_samples: int, epochs: int = 1
) -> dict[str, Any]:
    """One system's metrics from its ranks' step records (steps combined across ranks by index); every
    id is expected `epochs` times."""
    n_steps = max(len(r["steps"]) for r in results)
    curve, times, mats = [], [], []
    for k in range(n_steps):
        recs = [r["steps"][k] for r in results if k < len(r["steps"])]
        ls, lt = sum(x["loss_sum"] for x in recs), sum(x["loss_tokens"] for x in recs)
        curve.append(ls / lt if lt else float("nan"))
        times.append(max(x["t"] for x in recs))
        mats.append(max(x["materialized"] for x in recs))
    counts: dict[int, int] = {}
    for r in results:
        for s in r["steps"]:
            for i in s["ids"]:
                counts[i] = counts.get(i, 0) + 1
    real = sum(s["real"] for r in results for s in r["steps"])
    mat = sum(s["materialized"] for r in results for s in r["steps"])
    tail = max(1, math.ceil(0.1 * n_steps))
    tail_recs = [
        r["steps"][k] for r in results for k in range(n_steps - tail, n_steps) if k < len(r["steps"])
    ]
    t_ls, t_lt = sum(x["loss_sum"] for x in tail_recs), sum(x["loss_tokens"] for x in tail_recs)
    wall = max(r["wall_s"] for r in results)
    wait = max(sum(s["wait_s"] for s in r["steps"]) for r in results)
    mean_mat = [
        sum(r["steps"][k]["materialized"] for r in results if k < len(r["steps"])) / len(results)
        for k in range(n_steps)
    ]
    ev = next((r["eval"] for r in results if r.get("eval")), None)
    per_update = max((r.get("updates") or [] for r in results), key=len)
    update_len_cv = _update_length_spread(results)
    seen, tokens_curve = 0, []
    for k in range(n_steps):  # real tokens trained so far, all ranks, after each step
        seen += sum(r["steps"][k]["real"] for r in results if k < len(r["steps"]))
        tokens_curve.append(seen)
    return {
        "wall_s": wall,
        "samples": sum(counts.values()),
        "steps": n_steps,
        "steps_per_rank": [len(r["steps"]) for r in results],
        "idle": sum(1 for r in results for s in r["steps"] if not s["ids"]),
        "missing": sum(epochs - counts.get(i, 0) for i in range(num_samples) if counts.get(i, 0) < epochs),
        "duplicates": sum(c - epochs for c in counts.values() if c > epochs),
        "unexpected": sum(1 for i in counts if not 0 <= i < num_samples),
        "real_tokens": real,
        "materialized_tokens": mat,
        "padding_efficiency": real / mat if mat else 1.0,
        "tokens_per_rank_step": mat / max(sum(len(r["steps"]) for r in results), 1),
        "final_loss": t_ls / t_lt if t_lt else float("nan"),
        "final_loss_steps": tail,
        "heldout_loss": ev["loss"] if ev else None,
        "heldout_by_epoch": _epoch_evals(results),
        "heldout_samples": ev["samples"] if ev else 0,
        "first_loss": next((x for x in curve if x == x), float("nan")),
        "samples_per_s": sum(counts.values()) / wall if wall > 0 else float("nan"),
        "stall_fraction": wait / wall if wall > 0 else 0.0,
        "startup_s": max(r["startup_s"] for r in results),
        "trainer_cpu_s": max(r.get("cpu_s", 0.0) for r in results),
        "rank_imbalance": sum(mats) / sum(mean_mat) if sum(mean_mat) else 1.0,
        "vision_imbalance": _vision_imbalance(results, n_steps),
        "encoder_patches": sum(s.get("patches", 0) for r in results for s in r["steps"]),
        **_vision_share(results[0]),
        **_vision_share(results[0], "audio", "frames"),
        "params": results[0].get("params"),
        "loss_curve": curve,
        "step_times": times,
        "tokens_curve": tokens_curve,
        "updates": len(per_update),
        "update_tokens_min": min(per_update, default=0),
        "update_tokens_mean": sum(per_update) / len(per_update) if per_update else 0.0,
        "update_tokens_max": max(per_update, default=0),
        "update_length_cv": update_len_cv,
    }


def _update_length_spread(results: list[dict[str, Any]]) -> float:
    """How much the updates' composition varies: the coefficient of variation, over the epoch's optimizer
    updates (cut where rank 0's updates end), of each update's mean sample length (real tokens / samples,
    all ranks). Random fixed-size micro-batches give a low value; updates of a few length-homogeneous
    token-budget steps a high one."""
    ends = [k for k, s in enumerate(results[0]["steps"]) if s.get("update_end")]
    means, start = [], 0
    for end in ends:
        recs = [r["steps"][k] for r in results for k in range(start, end + 1) if k < len(r["steps"])]
        samples = sum(len(x["ids"]) for x in recs)
        if samples:
            means.append(sum(x["real"] for x in recs) / samples)
        start = end + 1
    if len(means) < 2:
        return 0.0
    return statistics.pstdev(means) / statistics.fmean(means)


def _vision_share(result: dict[str, Any], tower: str = "vision", load: str = "patches") -> dict[str, Any]:
    """Rank 0's vision tower share of its steps (`VisionTimer`, multimodal workloads): `vision_share`, the
    tower's forward + backward seconds over the rank's wall time (every step's whole span: data wait,
    forward, backward and all-reduce, optimizer); `vision_share_mean`, the mean over its steps with images
    of each step's share; `vision_s`, the seconds in all. Empty for a text workload. With `tower="audio"`
    (and `load="frames"`) the same of the audio encoder (`audio_share`, ...; a workload with clips)."""
    steps = result["steps"]
    if not steps or f"{tower}_s" not in steps[0]:
        return {}
    spans, prev = [], 0.0
    for s in steps:
        spans.append(max(s["t"] - prev, 1e-9))
        prev = s["t"]
    vis = [s.get(f"{tower}_s", 0.0) for s in steps]
    with_items = [v / span for v, span, s in zip(vis, spans, steps, strict=False) if s.get(load)]
    return {
        f"{tower}_s": sum(vis),
        f"{tower}_share": sum(vis) / result["wall_s"] if result["wall_s"] > 0 else None,
        f"{tower}_share_mean": sum(with_items) / len(with_items) if with_items else 0.0,
    }


def _vision_imbalance(results: list[dict[str, Any]], n_steps: int) -> float | None:
    """Mean over steps with images of max / mean of the encoder patches the ranks ran (1.0: balanced)."""
    return mean_imbalance(
        [r["steps"][k].get("patches", 0) if k < len(r["steps"]) else 0 for r in results]
        for k in range(n_steps)
    )


# -- plots -----------------------------------------------------------------------------------------
def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        if v == v:
            acc.append(v)
        acc = acc[-window:]
        out.append(sum(acc) / len(acc) if acc else float("nan"))
    return out


def write_plots(
    systems: dict[str, dict[str, Any]], out: Path, title: str, prefix: str = "bench_"
) -> list[Path]:
    """loss vs step, vs wall time and vs tokens seen, and a wall-time bar chart, as PNGs under `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {k: v for k, v in systems.items() if "wall_s" in v}
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    kinds = [("step", "step"), ("time", "wall time (s)"), ("tokens", "tokens seen (all ranks)")]
    for kind, xlabel in kinds:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        for name, s in ran.items():
            xs = {
                "step": list(range(1, len(s["loss_curve"]) + 1)),
                "time": s["step_times"],
                "tokens": s.get("tokens_curve") or list(range(1, len(s["loss_curve"]) + 1)),
            }[kind]
            w = max(1, len(s["loss_curve"]) // 20)
            (line,) = ax.plot(xs, s["loss_curve"], alpha=0.25, linewidth=0.8)
            ax.plot(
                xs,
                _smooth(s["loss_curve"], w),
                color=line.get_color(),
                linewidth=1.8,
                label=f"{name} ({len(xs)} steps, {s.get('updates') or len(xs)} updates, {s['wall_s']:.1f} s)",
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("global per-token loss (train)")
        ax.set_title(f"loss vs {xlabel.split(' (')[0]}: {title}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{prefix}loss_vs_{kind}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    names = list(ran)
    walls = [ran[n]["wall_s"] for n in names]
    bars = ax.bar(
        names,
        walls,
        color=["#888888" if n == "fixed" else "#d98c3a" if n.startswith("odb") else "#3a7bd5" for n in names],
    )
    base = ran.get("fixed", {}).get("wall_s")
    for b, n in zip(bars, names, strict=False):
        label = f"{ran[n]['wall_s']:.1f} s" + (f"\n{base / ran[n]['wall_s']:.2f}x vs fixed" if base else "")
        ax.annotate(
            label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8
        )
    ax.set_ylabel("epoch wall time (s)")
    ax.set_ylim(0, max(walls) * 1.3 if walls else 1)
    ax.set_title(f"wall time: {title}", fontsize=9)
    fig.tight_layout()
    path = out / f"{prefix}wall_time.png"
    fig.savefig(path)
    plt.close(fig)
    paths.append(path)
    return paths


LR_SCALING = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}


# -- the bench -------------------------------------------------------------------------------------
def run_bench(
    workload: str | Path | None = None,
    num_samples: int | None = None,
    world_size: int | None = None,
    token_budget: int | None = None,
    systems: Sequence[str] | None = None,
    device: str = "cpu",
    model: str | None = None,
    out: str | Path | None = None,
    seed: int | None = None,
    window: int | None = None,
    depth: int | None = None,
    heldout: int = 64,
    odb_workers: int = 2,
    lr: float = 1e-3,
    timeout: float = 1800.0,
    repeats: int = 1,
    lr_scaling: str = "sqrt",
    plots: bool = True,
    progress: Callable[[str], None] | None = None,
    epochs: int | None = None,
    step_time: float = 0.0,
    deterministic: bool | None = None,
    accumulate: int = 1,
    tokens_per_update: int | str | None = None,
) -> dict[str, Any]:
    """Runs the bench; returns the dict `batchd bench --json` prints (see the module docstring).

    Args:
        workload: Length file (one length per line; id = line number). None: the device's default
            workload in batchd/workloads (odb-synthetic on CPU, sharegpt4o-like on CUDA).
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
        progress: Called with one line per event (e.g. print to stderr).
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
        ValueError: on bad arguments (the message names the value).
    """
    say = progress or (lambda msg: None)
    if device not in DEFAULTS:
        raise ValueError(f"device must be cpu or cuda, got {device=}")
    d = DEFAULTS[device]
    world_size = d["world_size"] if world_size is None else world_size
    model = d["model"] if model is None else model
    from batchd._train.models import HF_MODELS

    hf_vlm = model in HF_MODELS
    token_budget = d["token_budget"] if token_budget is None else token_budget
    num_samples = (HF_VLM_DEFAULTS if hf_vlm else d)["num_samples"] if num_samples is None else num_samples
    systems = None if systems is None else list(systems)
    from batchd._train.models import MODELS

    # the job's fields are validated by JobSpec itself (the one set of rules every command uses)
    given = dict(window=window, depth=depth, seed=seed, epochs=epochs, deterministic=deterministic)
    job = JobSpec.from_keys(
        world_size=world_size, token_budget=token_budget, **{k: v for k, v in given.items() if v is not None}
    )  # None: the spec's default
    window, depth, seed = job.policy.window, job.policy.depth, job.seed
    epochs, deterministic = job.epochs, job.deterministic
    if tokens_per_update is not None and tokens_per_update != "auto":
        job = job.replace(tokens_per_update=tokens_per_update)  # validated there
    for name, value, lo in (
        ("accumulate", accumulate, 1),
        ("num_samples", num_samples, 1),
        ("heldout", heldout, 0),
        ("odb_workers", odb_workers, 1),
        ("repeats", repeats, 1),
    ):
        check_int(name, value, lo=lo)
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model=}")
    if systems is not None:
        parse_systems(",".join(systems))
    if workload is None:
        found = default_workload((HF_VLM_DEFAULTS if hf_vlm else d)["workload"])
        if found is None:
            raise ValueError(
                f"no workload given and {d['workload']} not found under {WORKLOAD_DIRS}; pass --workload"
            )
        workload = found
    workload = Path(workload)
    if not workload.is_file():
        raise ValueError(f"workload file not found: {workload=}")
    read = read_workload(workload)
    all_images = all_audio = None
    if read and isinstance(read[0], Sample):  # a multimodal workload: synthetic images, the tiny MLLM
        all_lengths, all_images = [s.length for s in read], [[list(im) for im in s.images] for s in read]
        if any(s.audio for s in read):  # and audio clips: its audio encoder too
            all_audio = [[list(c) for c in s.audio] for s in read]
            if hf_vlm:
                raise ValueError(
                    f"{workload} has audio clips: --model {model} has no audio encoder (the tiny MLLM has)"
                )
    else:
        all_lengths = read
    if systems is None:
        systems = list(
            HF_VLM_SYSTEMS
            if all_images and hf_vlm
            else MM_SYSTEMS
            if all_images
            else (s for s in SYSTEMS if s != "batchd-2phase")
        )
    if num_samples > len(all_lengths):
        raise ValueError(f"{workload} holds {len(all_lengths)} lengths, fewer than {num_samples=}")
    if num_samples < world_size:
        raise ValueError(f"num_samples must be >= world_size, got {num_samples=} {world_size=}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
            raise ValueError(
                f"device cuda needs {world_size} visible GPU(s), found "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
            )
    heldout = min(heldout, len(all_lengths) - num_samples)
    lengths = all_lengths[:num_samples]
    used = all_lengths[: num_samples + heldout]
    batch_size = max(1, token_budget // max(lengths))
    if lr_scaling not in LR_SCALING:
        raise ValueError(f"lr_scaling must be one of {list(LR_SCALING)}, got {lr_scaling=}")
    from batchd._train.bench_data import fixed_batches

    fixed_steps = max(
        len(fixed_batches(num_samples, r, world_size, seed, batch_size)) for r in range(world_size)
    )
    fixed_updates = math.ceil(fixed_steps / accumulate)
    lr_ref_tokens = round(sum(lengths) / fixed_updates) if lr_scaling != "none" else None
    if tokens_per_update == "auto":  # fixed batching's mean global loss tokens per update
        from batchd._train.bench_data import payload
        from batchd.client import loss_tokens

        loss = sum(loss_tokens(payload(i, lengths, seed)["labels"]) for i in range(num_samples))
        job = job.replace(tokens_per_update=max(1, round(loss / fixed_updates)))
    title = f"{workload.stem}, {num_samples} samples, N={world_size}, L={token_budget}, {model}, {device}"
    common = {
        "num_samples": num_samples,
        "lengths": used,
        "all_lengths": used,
        "seed": seed,
        "lr": lr,
        "lr_ref_tokens": lr_ref_tokens,
        "lr_power": LR_SCALING[lr_scaling],
        "model": model,
        "device": device,
        "token_budget": token_budget,
        "batch_size": batch_size,
        "window": window,
        "odb_workers": odb_workers,
        "epochs": epochs,
        "accumulate": accumulate,
        "step_time": step_time,
        "heldout_ids": list(range(num_samples, num_samples + heldout)),
        "images": all_images[: num_samples + heldout] if all_images else None,
        "audio": all_audio[: num_samples + heldout] if all_audio else None,
    }
    work = Path(tempfile.mkdtemp(prefix="batchd-bench-"))
    (work / "lengths.txt").write_text("\n".join(map(str, lengths)) + "\n")
    if all_images:  # the rank services serve the same synthetic images (`batchd rank --lengths FILE.csv`)
        (work / "workload.csv").write_text(format_workload(read[:num_samples]))
    results: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    t_all = time.perf_counter()
    try:
        # each round rotates the order, so that drift in the machine's speed does not land on one system
        order = [
            (rep, name)
            for rep in range(repeats)
            for name in systems[rep % len(systems) :] + systems[: rep % len(systems)]
        ]
        for rep, system in order:
            if system == "odb-0.1.2" and (why := odb_available()):
                if rep == 0:
                    say(f"[bench] {system}: skipped: {why}")
                results[system] = {"skipped": why}
                continue
            what = {
                "fixed": f"fixed batch size B={batch_size}",
                "odb-0.1.2": f"odb.apply, buffer_size={window}, {odb_workers} workers/rank",
            }.get(
                system,
                "policy {}, {} rows, {} phase(s), window {}, depth {}".format(
                    *BATCHD_SYSTEMS.get(system, ("?", "?", "?")), window, depth
                ),
            )
            say(f"[bench] {system}: training {num_samples} samples on {world_size} {device} rank(s) ({what})")
            t_sys = time.perf_counter()
            bar = (
                Progress(f"[bench] {system}", num_samples * epochs, "samples", emit=say)
                if progress is not None
                else None
            )  # a bar on a terminal, else a line every $BATCHD_PROGRESS_S
            res = run_system(system, work, common, job, timeout, f"{system}-{rep}", bar)
            s = summarize(system, res, num_samples, epochs)
            s["outer_s"] = time.perf_counter() - t_sys
            runs[system].append(s)
            run = f" (run {rep + 1}/{repeats})" if repeats > 1 else ""
            say(
                f"[bench] {system}{run}: {s['wall_s']:.1f} s wall, {s['steps']} steps, "
                f"{s['samples']} samples (missing {s['missing']}, dup {s['duplicates']}), "
                f"padding eff {s['padding_efficiency']:.3f}, "
                f"final loss {s['final_loss']:.3f}, held-out {_f(s['heldout_loss'])}"
                + (
                    f", vision tower {_pct(s['vision_share'])} of rank 0's time"
                    if s.get("vision_share") is not None
                    else ""
                )
                + (f", audio encoder {_pct(s['audio_share'])}" if s.get("audio_share") is not None else "")
                + f" ({s['outer_s']:.0f} s in all)"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for system in systems:
        if runs[system]:
            results[system] = _median_run(runs[system])
    results = {name: results[name] for name in systems if name in results}
    for s in results.values():
        if "wall_s" not in s:
            continue
        for ref in ("fixed", "odb-0.1.2"):
            r = results.get(ref, {})
            s[f"speedup_vs_{ref}"] = r["wall_s"] / s["wall_s"] if "wall_s" in r and s["wall_s"] > 0 else None
    summary: dict[str, Any] = {
        "workload": str(workload),
        "num_samples": num_samples,
        "heldout": heldout,
        "world_size": world_size,
        "token_budget": token_budget,
        "device": device,
        "model": model,
        "seed": seed,
        "lr": lr,
        "lr_scaling": lr_scaling,
        "lr_ref_tokens": lr_ref_tokens,
        "window": window,
        "depth": depth,
        "odb_workers": odb_workers,
        "repeats": repeats,
        "fixed_batch_size": batch_size,
        "epochs": epochs,
        "deterministic": deterministic,
        "accumulate": accumulate,
        "tokens_per_update": job.updates.tokens_per_update,
        "longest": max(lengths),
        "mean_length": sum(lengths) / len(lengths),
        "layout": {name: BATCHD_SYSTEMS.get(name, ("", "padded"))[1] for name in systems},
        "images": sum(len(ims) for ims in all_images[:num_samples]) if all_images else 0,
        "systems": results,
        "total_s": time.perf_counter() - t_all,
        "plots": [],
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        if plots and any("wall_s" in s for s in results.values()):
            summary["plots"] = [str(p) for p in write_plots(results, out, title)]
        (out / "bench.json").write_text(json.dumps(summary, indent=1))
    return summary


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose wall time is the median (lower median for an even count) + every run's wall time."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    pick = dict(ordered[(len(ordered) - 1) // 2])
    pick["wall_s_runs"] = [r["wall_s"] for r in runs]
    pick["runs"] = len(runs)
    return pick


def _f(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.3f}"


# -- CLI -------------------------------------------------------------------------------------------
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
        choices=("tiny", "llama-100m", "tiny-qwen2vl"),
        default=None,
        help="tiny: ~0.5M-param Llama-style LM (cpu default); llama-100m: ~110M params, 12 layers, "
        "d_model 768, randomly initialised (cuda default); tiny-qwen2vl: the stock Hugging Face "
        "Qwen2VLForConditionalGeneration (2-block ViT, 2-layer M-RoPE LM) adapted by "
        "batchd.two_phase, by default on benchmarks/workloads/bimodal.csv (256 samples) with "
        f"{','.join(HF_VLM_SYSTEMS)}",
    )
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


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `bench` subcommand to an argparse subparsers object; its handler is `args.func`."""
    p = subparsers.add_parser(
        "bench",
        help="real side-by-side run: fixed, ODB 0.1.2, batchd",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=bench_command)
    return p


def bench_command(args: argparse.Namespace) -> int:
    """Runs `batchd bench` from parsed arguments; prints a table (or JSON); returns the exit status."""
    try:
        summary = run_bench(
            workload=args.workload,
            num_samples=args.num_samples,
            world_size=args.world_size,
            token_budget=args.token_budget,
            systems=parse_systems(args.systems) if args.systems else None,
            device=args.device,
            model=args.model,
            out=args.out,
            seed=args.seed,
            window=args.window,
            depth=args.depth,
            heldout=args.heldout,
            odb_workers=args.odb_workers,
            lr=args.lr,
            timeout=args.timeout,
            repeats=args.repeats,
            lr_scaling=args.lr_scaling,
            progress=lambda m: print(m, file=sys.stderr, flush=True),
            epochs=args.epochs,
            step_time=args.step_time,
            deterministic=args.deterministic,
            accumulate=args.accumulate,
            tokens_per_update=args.tokens_per_update,
        )
    except ValueError as exc:
        print(f"batchd bench: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_table(summary))
    bad = [
        n
        for n, s in summary["systems"].items()
        if s.get("missing") or s.get("duplicates") or s.get("unexpected")
    ]
    return 1 if bad else 0


def format_table(summary: dict[str, Any]) -> str:
    vision = any(s.get("vision_share") is not None for s in summary["systems"].values())
    rows = [
        f"{'system':<16} {'wall s':>8} {'vs fixed':>9} {'vs odb':>8} {'steps':>6} {'samples':>8} "
        f"{'pad eff':>8} {'final loss':>10} {'held-out':>9}" + (f" {'vision':>7}" if vision else "")
    ]
    for name, s in summary["systems"].items():
        if "wall_s" not in s:
            rows.append(f"{name:<16} skipped: {s.get('skipped')}")
            continue
        vf, vo = s.get("speedup_vs_fixed"), s.get("speedup_vs_odb-0.1.2")
        rows.append(
            f"{name:<16} {s['wall_s']:>8.2f} {_x(vf):>9} {_x(vo):>8} {s['steps']:>6} {s['samples']:>8} "
            f"{s['padding_efficiency']:>8.3f} {s['final_loss']:>10.3f} {_f(s['heldout_loss']):>9}"
            + (f" {_pct(s.get('vision_share')):>7}" if vision else "")
        )
    return "\n".join(rows)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m batchd.bench", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return bench_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
