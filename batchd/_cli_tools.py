"""The tool commands of `batchd`: `simulate` (the core over a length file), `config` (check a job config or
print an example), `tokenizer` (write or check the default tokenizer), `tiny-vlm` (write a tiny stock
Hugging Face multimodal model)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import textwrap

from batchd._cli_flags import positive
from batchd._config import EXAMPLE, load_config
from batchd._job_keys import add_job_flags
from batchd._lengths import read_workload
from batchd.core import KEYS, REQUIRED, RESULT_FIELDS, JobSpec, simulate
from batchd.proto import Progress


def add_tool_parsers(sub: argparse._SubParsersAction) -> None:
    """Adds `simulate`, `config`, `tokenizer` and `tiny-vlm` to `sub`, in the order `--help` lists them."""
    _add_simulate(sub)
    _add_config(sub)
    _add_tokenizer(sub)
    _add_tiny_vlm(sub)


SIM_EXCLUDE = ("collate", "epochs")  # the job flags `batchd simulate` does not take


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="run N virtual ranks and the coordinator over a length file (the daemon's core code)",
        description=textwrap.fill(
            "Simulates one epoch of batchd over realized lengths (one integer per line; the sample "
            "id is the 0-based line number) or a multimodal workload (CSV, docs/workloads.md) and prints the "
            "batching metrics; with images also the per-phase balance (LLM and vision encoder, single- vs "
            "two-phase with --phases 2). With --config, the [job] section of a job config is the starting "
            "point and flags override it.",
            100,
        ),
        epilog="output fields (text: one per line; --json: one object):\n"
        + "\n".join(f"  {k:<38} {v}" for k, v in RESULT_FIELDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument(
        "--lengths", metavar="FILE", help="one integer length per line (a .csv file: as --workload)"
    )
    data.add_argument(
        "--workload",
        metavar="FILE",
        help="a workload file: .csv = text_tokens,image_patches,image_tokens per sample "
        "(docs/workloads.md), else one length per line",
    )
    p.add_argument("--config", default=None, metavar="FILE", help="job config (TOML/YAML); its [job] is used")
    add_job_flags(p, exclude=SIM_EXCLUDE)
    p.add_argument(
        "--local-ranks",
        type=positive,
        default=None,
        metavar="K",
        help="ranks per node (rank r on node r // K): the result splits moved samples/bytes into "
        "intra- and cross-node; balanced plans as --nodes says: node-local rounds where they cost as "
        "node-blind (local; packed, attention cost), every round node-aware (aware) or node-blind "
        "(blind) (default: every rank its own node)",
    )
    p.add_argument(
        "--resize",
        type=_resizes,
        default=(),
        metavar="STEP:W[,STEP:W...]",
        help="change the world size to W at STEP (at the first optimizer update boundary from there), as "
        "a job resumed from a checkpoint at another world size does: reports missing and duplicated ids, "
        "steps per rank of each world size and the batching around each change (segments, resizes)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (no progress bar)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_simulate)


def _resizes(text: str) -> list[tuple[int, int]]:
    """`STEP:W[,STEP:W...]` -> [(STEP, W), ...] (argparse type: a bad item is its error message)."""
    out = []
    for item in text.split(","):
        step, sep, world = item.strip().partition(":")
        if not sep or not step.isdigit() or not world.isdigit() or int(world) < 1:
            raise argparse.ArgumentTypeError(
                f"expected STEP:W (STEP >= 0, W >= 1), comma-separated, got {item.strip()!r}"
            )
        out.append((int(step), int(world)))
    return out


SIM_KEYS = tuple(k for k in KEYS if k not in SIM_EXCLUDE)


def _simulate(args: argparse.Namespace) -> int:
    given = {k: getattr(args, k) for k in SIM_KEYS if getattr(args, k) is not None}
    if args.config:
        spec = load_config(args.config, {f"job.{k}": v for k, v in given.items()}, check_files=False).job
    else:
        for req in REQUIRED:
            if req not in given:
                raise ValueError(f"--{req.replace('_', '-')} is required (or give --config with [job] {req})")
        spec = JobSpec.from_keys(**given)
    lengths = read_workload(args.workload or args.lengths)
    total = len(lengths) if spec.quota is None else min(spec.quota, len(lengths))
    with Progress("simulate", total, "samples", enabled=not (args.json or args.quiet), emit=say) as bar:
        result = simulate(
            lengths,
            spec,
            on_step=lambda step: bar.update(sum(len(s.samples) for s in step), 1),
            local_ranks=args.local_ranks,
            resize=args.resize,
        )
    if args.json:
        print(json.dumps(result))
    else:
        width = max(len(k) for k in result)
        for key, value in result.items():
            if key in ("segments", "resizes"):
                continue
            if isinstance(value, float):
                value = f"{value:.4f}"
            print(f"{key:<{width}}  {value}")
        if "resizes" in result:
            print()
            print(resize_table(result))
        if "vision_imbalance_single" in result:
            print()
            print(phase_table(result))
    return 0


def say(line: str) -> None:
    """A progress line on standard error."""
    print(line, file=sys.stderr, flush=True)


def resize_table(result: dict) -> str:
    """The world-size changes of `batchd simulate --resize` (text output): each world size's steps per
    rank, and per change the batching of the 8 steps after it beside the same steps without a change."""
    lines = ["world sizes (segments): first step, steps per rank"]
    for seg in result["segments"]:
        lines.append(f"  W={seg['world_size']:<4} from step {seg['first_step']:<6} {seg['steps_per_rank']}")
    lines.append("changes: padding_efficiency / compute_vs_limit of the steps after it (without the change)")
    for m in result["resizes"]:
        if m["step"] is None:
            lines.append(f"  asked at step {m['asked']} -> W={m['to']}: not made (the epoch ended first)")
            continue
        a, b = m["after"], m["without"]
        lines.append(
            f"  step {m['step']} (asked {m['asked']}): W {m['from']} -> {m['to']}; {a['steps']} steps: "
            f"{a['padding_efficiency']:.4f} / {a['compute_vs_limit']:.4f} "
            f"({b['padding_efficiency']:.4f} / {b['compute_vs_limit']:.4f})"
        )
    return "\n".join(lines)


def phase_table(result: dict) -> str:
    """The per-phase balance block of `batchd simulate` (text output): mean over steps of max / mean rank
    load per phase, single- vs two-phase, and the embeddings the two-phase plan exchanges per step."""

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    two = result["phases"] == 2
    llm = result["llm_imbalance"]
    lines = [
        "per-phase balance (mean over steps of max / mean rank load)",
        f"  {'phase':<8} {'single-phase':>12} {'two-phase':>10} {'bound':>8}",
        f"  {'llm':<8} {f(llm):>12} {f(llm) if two else '-':>10} {'-':>8}",
        (
            f"  {'vision':<8} {f(result['vision_imbalance_single']):>12} "
            f"{f(result['vision_imbalance_two']):>10} "
            f"{f(result['vision_bound_pigeonhole']):>8}"
        ),
        "  (bound: a lower bound no vision plan beats, images being whole: vision_bound_pigeonhole)",
    ]
    if two:
        lines.append(
            "embeddings exchanged per step: "
            f"intra-node {result['exchanged_intra_node_images_per_step']:.2f} images / "
            f"{result['exchanged_intra_node_rows_per_step']:.1f} rows, "
            f"cross-node {result['exchanged_cross_node_images_per_step']:.2f} images / "
            f"{result['exchanged_cross_node_rows_per_step']:.1f} rows; "
            f"vision plan {result['vision_plan_per_round_s'] * 1e3:.2f} ms/round"
        )
    return "\n".join(lines)


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="check a job config file, or print a commented example",
        description="Validates a job config (TOML/YAML) the way the services will load it; "
        "errors name the field and the bad value.",
    )
    p.add_argument("file", nargs="?", metavar="FILE", help="the config to check")
    p.add_argument("--example", action="store_true", help="print a commented example config")
    p.add_argument(
        "--no-file-check",
        action="store_true",
        help="do not require the files the config names to exist (a config for another machine)",
    )
    p.add_argument("--json", action="store_true", help="print the merged, validated config as JSON")
    p.set_defaults(func=_config_cmd)


def _add_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tokenizer",
        help="write the default (demo) tokenizer to a file, or check a tokenizer",
        description="Writes the default tokenizer of `batchd rank --dataset` and `batchd demo` "
        "to FILE: a byte-level BPE trained locally on the demo generator's text (no download), "
        "cached in $BATCHD_CACHE or ~/.cache/batchd. Trainers pass the same file "
        "(`--tokenizer FILE`) so their vocabulary covers its ids. With --check, loads PATH "
        "(a tokenizer.json or a Hugging Face tokenizer directory) offline and prints its size.",
    )
    p.add_argument(
        "path", metavar="FILE", help="where to write tokenizer.json (with --check: the tokenizer to load)"
    )
    p.add_argument(
        "--check", action="store_true", help="load PATH as batchd would and print its vocabulary size"
    )
    p.set_defaults(func=_tokenizer_cmd)


def _add_tiny_vlm(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tiny-vlm",
        help="write a tiny stock Hugging Face multimodal model and its processor to DIR",
        description="Writes what a model's checkout holds, built locally (no download): a tiny "
        "randomly initialised Qwen2-VL or LLaVA model (config and weights) and its processor "
        "(tokenizer, image processor, chat template), as save_pretrained writes them. The rank "
        "services preprocess with it (`[pipeline] processor = DIR`) and the reference trainer "
        "trains it (`python -m batchd.train --hf-model DIR`); a real job points both at its "
        "model's own directory instead.",
    )
    p.add_argument(
        "path", metavar="DIR", help="the directory to write (created; existing files are replaced)"
    )
    p.add_argument(
        "--family",
        choices=("qwen2_vl", "llava"),
        default="qwen2_vl",
        help="qwen2_vl (Qwen2VLForConditionalGeneration, M-RoPE, 56x56 to 224x224 images) or llava "
        "(LlavaForConditionalGeneration, 28x28 images); default qwen2_vl",
    )
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    p.set_defaults(func=_tiny_vlm_cmd)


def _config_cmd(args: argparse.Namespace) -> int:
    if args.example:
        print(EXAMPLE, end="")
        return 0
    if not args.file:
        raise ValueError("give a config FILE to check, or --example")
    cfg = load_config(args.file, check_files=not args.no_file_check)
    if args.json:
        out = {"job": dataclasses.asdict(cfg.job)}
        for name in ("data", "pipeline", "coordinator", "rank", "security", "logging"):
            out[name] = dataclasses.asdict(getattr(cfg, name))
        print(json.dumps(out))
    else:
        print(
            f"{args.file}: ok ({cfg.job.world_size} ranks, L_max {cfg.job.token_budget}, "
            f"policy {cfg.job.policy.name}, mode {cfg.job.mode})"
        )
    return 0


def _tokenizer_cmd(args: argparse.Namespace) -> int:
    from batchd.service.preprocess import TokenizerRef, demo_tokenizer

    if args.check:
        ref = TokenizerRef(args.path)
        print(f"{args.path}: ok ({ref.id_space} token ids, pad token {ref.pad_token!r})")
        return 0
    cached = demo_tokenizer()
    if os.path.isdir(args.path):
        raise ValueError(f"FILE must be a file path, got a directory: path={args.path!r}")
    shutil.copyfile(cached, args.path)
    print(
        f"wrote the demo tokenizer to {args.path} ({TokenizerRef(args.path).id_space} token ids; "
        f"cached at {cached})"
    )
    return 0


def _tiny_vlm_cmd(args: argparse.Namespace) -> int:
    import transformers

    from batchd._vlm_tiny import save_tiny_vlm

    transformers.logging.set_verbosity_error()  # its notes on torchvision and its progress bars: not ours
    transformers.logging.disable_progress_bar()
    if os.path.isfile(args.path):
        raise ValueError(f"DIR must be a directory (created if missing), got a file: path={args.path!r}")
    path = save_tiny_vlm(args.path, args.family, args.seed)
    print(
        f"wrote a tiny {args.family} model and its processor to {path} (config, weights, tokenizer, image "
        f'processor, chat template): [pipeline] processor = "{path}", '
        f"python -m batchd.train --hf-model {path}"
    )
    return 0
