"""`batchd demo`: its flags (`DemoOptions`), the run (`batchd.demo.run_demo`, imported lazily: it imports
Ray) and its plain-text report (`print_demo`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from batchd._cli_flags import positive
from batchd._demo_run import DemoOptions
from batchd._job_keys import add_job_flags

D = DemoOptions  # its fields' defaults are the flags' defaults


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    """Adds `demo` to `sub`; its defaults are `DemoOptions`'."""
    p = sub.add_parser(
        "demo",
        help="run the main job end to end on this machine",
        description="Starts a local Ray, a coordinator, N rank services (each preprocessing its "
        "view of the dataset with Ray actors: chat template, tokenizer, Qwen2-VL visual tokens) "
        "and N gloo DDP trainers, trains a tiny multimodal LM (two-phase: its vision encoder balanced "
        "too) for one epoch through batchd, then "
        "with fixed batching on the same preprocessed samples, and compares. Default data: a "
        "generated demo dataset (conversations, images and a few bad records).",
    )
    add_job_flags(
        p,
        only=("world_size", "token_budget", "policy", "window", "depth", "seed", "deterministic"),
        defaults={"world_size": D.world_size, "token_budget": D.token_budget},
        spec_defaults=True,
    )
    p.add_argument(
        "--num-samples",
        type=positive,
        default=D.num_samples,
        metavar="M",
        help=f"records of the generated dataset, or synthetic samples (default {D.num_samples})",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the fixed-batching comparison run")
    p.add_argument(
        "--step-time",
        type=float,
        default=D.step_time,
        metavar="S",
        help=f"batchd trainers sleep S seconds per step (a real model's step time; default {D.step_time:g})",
    )
    p.add_argument(
        "--phases",
        type=int,
        choices=(1, 2),
        default=None,
        help="2: balance the vision encoder too (OrchMLLM two-phase; one all-to-all of image "
        "embeddings per step); default 2 for the image data under policy balanced, else 1",
    )
    _add_demo_data(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_demo)


def _add_demo_data(p: argparse.ArgumentParser) -> None:
    """The demo's data options: the records, the preprocessing and its limits."""
    data = p.add_mutually_exclusive_group()
    data.add_argument(
        "--dataset",
        default=None,
        metavar="PATH",
        help="your records (Parquet/JSONL/Arrow IPC) instead of the generated demo dataset",
    )
    data.add_argument(
        "--synthetic",
        action="store_true",
        help="no Ray: synthetic tokenized samples with long-tail lengths (`batchd rank --lengths`)",
    )
    p.add_argument(
        "--num-actors",
        type=positive,
        default=D.num_actors,
        metavar="K",
        help=f"preprocessing actors in all, spread over the rank services (default {D.num_actors})",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join this Ray cluster (default: start one local Ray that every rank service joins)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a tokenizer.json or a Hugging Face tokenizer directory (default: the demo's)",
    )
    p.add_argument(
        "--processor",
        default=None,
        metavar="DIR",
        help="preprocess with this Hugging Face processor directory (a Qwen2-VL-style one: the "
        "demo model reads <|image_pad|> tokens and pixel_values/image_grid_thw)",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        metavar="SIZE",
        help="records each rank service holds read ahead, e.g. 1GiB (default 2GiB)",
    )
    p.add_argument(
        "--max-bad-fraction",
        type=float,
        default=None,
        metavar="F",
        help="fail once more than this share of the records read are bad (default 0.1; on the "
        "generated dataset at least twice its deliberate bad records' share of a rank's view)",
    )


def _demo(args: argparse.Namespace) -> int:
    progress = None if args.json else (lambda msg: print(f"[batchd demo] {msg}", file=sys.stderr, flush=True))
    from batchd.demo import run_demo  # lazily, like the services: it imports Ray

    options = DemoOptions(
        world_size=args.world_size,
        token_budget=args.token_budget,
        policy=args.policy,
        window=args.window,
        depth=args.depth,
        seed=args.seed,
        deterministic=args.deterministic,
        phases=args.phases,
        num_samples=args.num_samples,
        baseline=not args.no_baseline,
        step_time=args.step_time,
        synthetic=args.synthetic,
        dataset=args.dataset,
        num_actors=args.num_actors,
        ray_address=args.ray_address,
        tokenizer=args.tokenizer,
        processor=args.processor,
        memory_budget=args.memory_budget,
        max_bad_fraction=args.max_bad_fraction,
    )
    summary = run_demo(options, progress)
    pre = summary.get("preprocess")
    ok = pre is None or pre["accounting_ok"]
    if not ok:
        print(f"batchd demo: error: emitted + quarantined != records read: {pre}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
        return 0 if ok else 1
    print_demo(summary)
    return 0 if ok else 1


def print_demo(summary: dict[str, Any]) -> None:
    """`batchd demo`'s plain-text report of a run's summary (`--json` prints the summary itself)."""
    pre = summary.get("preprocess")
    print(f"steps per rank      {summary['steps_per_rank']}  (idle rank-steps: {summary['idle']})")
    print(
        f"samples             {summary['emitted']} emitted, {summary['missing']} missing, "
        f"{summary['duplicates']} duplicated"
    )
    print(f"padding efficiency  {summary['padding_efficiency']:.3f}")
    if summary.get("vision_imbalance") is not None:
        print(
            f"vision encoder      {summary['phases']}-phase: slowest rank / mean, in encoder patches: "
            f"{summary['vision_imbalance']:.3f} (mean over steps with images)"
        )
    if summary.get("clips"):
        audio = summary.get("audio_imbalance")
        print(
            f"audio encoder       {summary['clips']} clips, each encoded once"
            + (f"; slowest rank / mean, in frames: {audio:.3f}" if audio is not None else "")
        )
    print(f"loss                {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}")
    print(f"epoch wall time     {summary['wall_s']:.2f}s")
    if pre is not None:
        print(
            f"preprocessing       {pre['actors']} Ray actors: {pre['samples']} samples + "
            f"{pre['quarantined']} quarantined = {pre['records_read']} of {pre['records']} records read; "
            f"{pre['samples_per_s']:.0f} samples/s; trainers waited for data "
            f"{100 * pre['stall_fraction']:.1f}% of their time (slowest rank)"
        )
        if pre["quarantined"]:
            reasons = ", ".join(
                f"{code} {n}" for code, n in sorted(pre["reasons"].items(), key=lambda kv: -kv[1])
            )
            print(
                f"quarantine          {pre['quarantined']} bad records ({reasons}): {pre['quarantine_file']}"
            )
    if "baseline" in summary:
        b = summary["baseline"]
        print(
            f"fixed batching      {b['wall_s']:.2f}s at batch size B={b['batch_size']} (as batchd bench), "
            f"{b['steps']} steps, padding efficiency {b['padding_efficiency']:.3f}"
            + (
                f", vision encoder {b['vision_imbalance']:.3f}"
                if b.get("vision_imbalance") is not None
                else ""
            )
        )
        print(f"speedup             {summary['speedup']:.2f}x over fixed batching at B={b['batch_size']}")
