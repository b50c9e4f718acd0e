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
import importlib.util
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchd._bench_options import BATCHD_SYSTEMS, HF_VLM_DEFAULTS, LR_SCALING, WORKLOAD_DIRS
from batchd._bench_options import DEFAULTS as DEFAULTS
from batchd._bench_options import HELP as HELP
from batchd._bench_options import HF_VLM_SYSTEMS as HF_VLM_SYSTEMS
from batchd._bench_options import MM_SYSTEMS as MM_SYSTEMS
from batchd._bench_options import SYSTEMS as SYSTEMS
from batchd._bench_options import BenchOptions as BenchOptions
from batchd._bench_options import add_arguments as add_arguments
from batchd._bench_options import default_workload as default_workload
from batchd._bench_options import odb_available as odb_available
from batchd._bench_options import parse_systems as parse_systems
from batchd._bench_report import _median_run
from batchd._bench_report import summarize as summarize
from batchd._bench_report import write_plots as write_plots
from batchd._lengths import read_workload
from batchd.core import JobSpec, Sample, format_workload
from batchd.launch import Processes, spec_argv, start_services, start_trainers, wait_trainers
from batchd.proto import Progress


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


@dataclass(frozen=True)
class _Data:
    """The workload read: its path, records, lengths, and the synthetic images and clips of each sample (None:
    a text workload, or no clips)."""

    path: Path
    read: list[Any]
    lengths: list[int]
    images: list[list[list[int]]] | None
    audio: list[list[list[int]]] | None


def _load(opts: BenchOptions) -> _Data:
    """`opts.workload` (or the device's / model's default) read; ValueError naming a missing file, or clips
    the model cannot hear."""
    workload = opts.workload
    if workload is None:
        name = (HF_VLM_DEFAULTS if opts.hf_vlm else DEFAULTS[opts.device])["workload"]
        workload = default_workload(name)
        if workload is None:
            raise ValueError(f"no workload given and {name} not found under {WORKLOAD_DIRS}; pass --workload")
    workload = Path(workload)
    if not workload.is_file():
        raise ValueError(f"workload file not found: {workload=}")
    read = read_workload(workload)
    if not (read and isinstance(read[0], Sample)):
        return _Data(workload, read, read, None, None)
    # a multimodal workload: synthetic images, the tiny MLLM; with clips, its audio encoder too
    images = [[list(im) for im in s.images] for s in read]
    audio = [[list(c) for c in s.audio] for s in read] if any(s.audio for s in read) else None
    if audio is not None and opts.hf_vlm:
        raise ValueError(
            f"{workload} has audio clips: --model {opts.model} has no audio encoder (the tiny MLLM has)"
        )
    return _Data(workload, read, [s.length for s in read], images, audio)


def _check_fits(opts: BenchOptions, data: _Data) -> None:
    n, world = opts.num_samples, opts.world_size
    if n > len(data.lengths):
        raise ValueError(f"{data.path} holds {len(data.lengths)} lengths, fewer than num_samples={n}")
    if n < world:
        raise ValueError(f"num_samples must be >= world_size, got num_samples={n} world_size={world}")
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < world:
            raise ValueError(
                f"device cuda needs {world} visible GPU(s), found "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
            )


def _plan(opts: BenchOptions, data: _Data) -> tuple[dict[str, Any], JobSpec]:
    """The trainers' common configuration (the bench trainer's `cfg`) and the batchd systems' job."""
    n, world, seed = opts.num_samples, opts.world_size, opts.seed
    heldout = min(opts.heldout, len(data.lengths) - n)
    lengths, used = data.lengths[:n], data.lengths[: n + heldout]
    batch_size = max(1, opts.token_budget // max(lengths))
    from batchd._train.bench_data import fixed_batches

    fixed_steps = max(len(fixed_batches(n, r, world, seed, batch_size)) for r in range(world))
    fixed_updates = math.ceil(fixed_steps / opts.accumulate)
    lr_ref_tokens = round(sum(lengths) / fixed_updates) if opts.lr_scaling != "none" else None
    job = opts.job()
    if opts.tokens_per_update == "auto":  # fixed batching's mean global loss tokens per update
        from batchd._train.bench_data import payload
        from batchd.client import loss_tokens

        loss = sum(loss_tokens(payload(i, lengths, seed)["labels"]) for i in range(n))
        job = job.replace(tokens_per_update=max(1, round(loss / fixed_updates)))
    names = ("seed", "lr", "model", "device", "token_budget", "window", "odb_workers", "epochs")
    common = {
        **{name: getattr(opts, name) for name in names},
        **{name: getattr(opts, name) for name in ("accumulate", "step_time", "num_samples")},
        "lengths": used,
        "all_lengths": used,
        "lr_ref_tokens": lr_ref_tokens,
        "lr_power": LR_SCALING[opts.lr_scaling],
        "batch_size": batch_size,
        "heldout_ids": list(range(n, n + heldout)),
        "images": data.images[: n + heldout] if data.images else None,
        "audio": data.audio[: n + heldout] if data.audio else None,
    }
    return common, job


def run_bench(
    options: BenchOptions | None = None, /, progress: Callable[[str], None] | None = None, **fields: Any
) -> dict[str, Any]:
    """Runs the bench; returns the dict `batchd bench --json` prints (see the module docstring).

    Args:
        options: What to run (`BenchOptions`); None: `BenchOptions(**fields)`.
        progress: Called with one line per event (e.g. print to stderr).
        **fields: `BenchOptions` fields, over `options`.

    Raises:
        ValueError: on bad arguments (the message names the value).
    """
    opts = BenchOptions(**{**(vars(options) if options is not None else {}), **fields})
    data = _load(opts)
    systems = list(
        opts.systems
        if opts.systems is not None
        else HF_VLM_SYSTEMS
        if data.images and opts.hf_vlm
        else MM_SYSTEMS
        if data.images
        else (s for s in SYSTEMS if s != "batchd-2phase")
    )
    _check_fits(opts, data)
    common, job = _plan(opts, data)
    work = Path(tempfile.mkdtemp(prefix="batchd-bench-"))
    n = opts.num_samples
    (work / "lengths.txt").write_text("\n".join(map(str, data.lengths[:n])) + "\n")
    if data.images:  # the rank services serve the same synthetic images (`batchd rank --lengths FILE.csv`)
        (work / "workload.csv").write_text(format_workload(data.read[:n]))
    t_all = time.perf_counter()
    try:
        results = _run_systems(opts, systems, work, common, job, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _summary(opts, data, common, job, results, systems, time.perf_counter() - t_all)


def _run_systems(
    opts: BenchOptions,
    systems: list[str],
    work: Path,
    common: dict[str, Any],
    job: JobSpec,
    progress: Callable[[str], None] | None,
) -> dict[str, dict[str, Any]]:
    """Every system `opts.repeats` times, each round in a rotated order (so that drift in the machine's
    speed does not land on one system); each system's median-wall run, or why it was skipped."""
    say = progress or (lambda msg: None)
    results: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    repeats, n = opts.repeats, opts.num_samples
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
            "fixed": f"fixed batch size B={common['batch_size']}",
            "odb-0.1.2": f"odb.apply, buffer_size={opts.window}, {opts.odb_workers} workers/rank",
        }.get(
            system,
            "policy {}, {} rows, {} phase(s), window {}, depth {}".format(
                *BATCHD_SYSTEMS.get(system, ("?", "?", "?")), opts.window, opts.depth
            ),
        )
        say(f"[bench] {system}: training {n} samples on {opts.world_size} {opts.device} rank(s) ({what})")
        t_sys = time.perf_counter()
        bar = (
            Progress(f"[bench] {system}", n * opts.epochs, "samples", emit=say)
            if progress is not None
            else None
        )  # a bar on a terminal, else a line every $BATCHD_PROGRESS_S
        res = run_system(system, work, common, job, opts.timeout, f"{system}-{rep}", bar)
        s = summarize(system, res, n, opts.epochs)
        s["outer_s"] = time.perf_counter() - t_sys
        runs[system].append(s)
        say(_ran_line(system, s, f" (run {rep + 1}/{repeats})" if repeats > 1 else ""))
    for system in systems:
        if runs[system]:
            results[system] = _median_run(runs[system])
    return {name: results[name] for name in systems if name in results}


def _cost_line(check: dict[str, Any] | None) -> str:
    """', compute max/mean 1.08 (planned 1.02), R^2 0.93' (`batchd.core.cost_check`), or ''."""
    if not check or not check.get("steps") or check.get("measured_imbalance") is None:
        return ""
    r2 = "-" if check["r2"] is None else f"{check['r2']:.2f}"
    return (
        f", compute max/mean {check['measured_imbalance']:.2f} (planned "
        f"{check['planned_imbalance']:.2f}), R^2 on cost {r2}"
    )


def _ran_line(system: str, s: dict[str, Any], run: str) -> str:
    return (
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
        + _cost_line(s.get("cost_check"))
        + f" ({s['outer_s']:.0f} s in all)"
    )


def _summary(
    opts: BenchOptions,
    data: _Data,
    common: dict[str, Any],
    job: JobSpec,
    results: dict[str, dict[str, Any]],
    systems: list[str],
    total_s: float,
) -> dict[str, Any]:
    """`run_bench`'s result, with each system's speedups; written (and plotted) under `opts.out`."""
    for s in results.values():
        if "wall_s" not in s:
            continue
        for ref in ("fixed", "odb-0.1.2"):
            r = results.get(ref, {})
            s[f"speedup_vs_{ref}"] = r["wall_s"] / s["wall_s"] if "wall_s" in r and s["wall_s"] > 0 else None
    n, lengths = opts.num_samples, data.lengths[: opts.num_samples]
    names = ("num_samples", "world_size", "token_budget", "device", "model", "seed", "lr", "lr_scaling")
    names2 = ("window", "depth", "odb_workers", "repeats", "epochs", "deterministic", "accumulate")
    summary: dict[str, Any] = {
        "workload": str(data.path),
        **{name: getattr(opts, name) for name in names[:1]},
        "heldout": len(common["heldout_ids"]),
        **{name: getattr(opts, name) for name in names[1:]},
        "lr_ref_tokens": common["lr_ref_tokens"],
        **{name: getattr(opts, name) for name in names2[:4]},
        "fixed_batch_size": common["batch_size"],
        **{name: getattr(opts, name) for name in names2[4:]},
        "tokens_per_update": job.updates.tokens_per_update,
        "longest": max(lengths),
        "mean_length": sum(lengths) / len(lengths),
        "layout": {name: BATCHD_SYSTEMS.get(name, ("", "padded"))[1] for name in systems},
        "images": sum(len(ims) for ims in data.images[:n]) if data.images else 0,
        "systems": results,
        "total_s": total_s,
        "plots": [],
    }
    if opts.out is not None:
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        if opts.plots and importlib.util.find_spec("matplotlib") is None:
            print("[bench] no plots: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        elif opts.plots and any("wall_s" in s for s in results.values()):
            title = (
                f"{data.path.stem}, {n} samples, N={opts.world_size}, L={opts.token_budget}, "
                f"{opts.model}, {opts.device}"
            )
            summary["plots"] = [str(p) for p in write_plots(results, out, title)]
        (out / "bench.json").write_text(json.dumps(summary, indent=1))
    return summary


def bench_command(args: argparse.Namespace) -> int:
    """Runs `batchd bench` from parsed arguments; prints a table (or JSON); returns the exit status."""
    try:
        options = BenchOptions(
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
            epochs=args.epochs,
            step_time=args.step_time,
            deterministic=args.deterministic,
            accumulate=args.accumulate,
            tokens_per_update=args.tokens_per_update,
        )
        summary = run_bench(options, progress=lambda m: print(m, file=sys.stderr, flush=True))
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


def _f(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.3f}"


if __name__ == "__main__":
    sys.exit(main())
