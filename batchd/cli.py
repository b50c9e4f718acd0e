"""The `batchd` command line: simulate, config, tokenizer, tiny-vlm, coordinator, rank, node, demo, bench.

`batchd coordinator` and `batchd rank` take a job config file (`--config`, see `batchd._config`);
every flag overrides one key of it, and the merged result is validated before anything starts.
Errors (bad flags, bad config, a dead peer) exit with status 2 and a one-line message naming the field
or party; a failed job exits 1 with `batchd CMD: the job failed: <reason>`, Ctrl-C / SIGTERM 130 with
`batchd CMD: interrupted` (`batchd coordinator` exits 143 on SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import os
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from batchd._bench_cli import add_bench_parser
from batchd._config import DROP, EXAMPLE, load_config
from batchd._job_keys import add_job_flags
from batchd._lengths import read_workload
from batchd._logging import setup_logging
from batchd.core import KEYS, REQUIRED, RESULT_FIELDS, JobSpec, simulate
from batchd.proto import Progress


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


# Flags default to None ("not given") so a config file's value survives unless the flag is given;
# the help strings state the built-in defaults, which live in the config dataclasses and
# batchd.core.JobSpec (the job flags are derived from its leaves, `KEYS`).
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
        type=_positive,
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
    with Progress("simulate", total, "samples", enabled=not (args.json or args.quiet), emit=_say) as bar:
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


def _say(line: str) -> None:
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


def _add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="job config file (TOML, or YAML by extension); flags override its keys. "
        "`batchd config --example` prints a commented one",
    )


def _add_rank_args(p: argparse.ArgumentParser, who: str) -> None:
    """The options of a rank service, shared by `batchd rank` and `batchd node` (`who`: whose actors)."""
    _add_config_flag(p)
    _add_spec(p)
    _add_server(p, "rank")
    _add_security(p)
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="the coordinator's address (default: coordinator.address of the config)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--lengths", metavar="FILE", help="serve a synthetic tokenized dataset with these realized lengths"
    )
    src.add_argument(
        "--dataset",
        metavar="PATH",
        help="preprocess these records (Parquet/JSONL/Arrow) with a Ray actor pool "
        "(neither --lengths nor --dataset: producers push samples through Ingest)",
    )
    g = p.add_argument_group("preprocessing (with --dataset; [data], [pipeline])")
    g.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a tokenizer.json or a Hugging Face tokenizer directory, read offline (default: the "
        "demo tokenizer, trained locally on first use; `batchd tokenizer FILE` writes it out)",
    )
    g.add_argument(
        "--processor",
        metavar="DIR",
        help="the model's own Hugging Face processor directory, read offline: its chat template, "
        "tokenizer and image processor replace --template/--vision (`HFProcessor`)",
    )
    g.add_argument("--template", help="chat template: chatml, qwen2, llama3 or Jinja text (default qwen2)")
    g.add_argument(
        "--vision", choices=("qwen2_vl", "llava", "none"), help="visual-token expansion (default qwen2_vl)"
    )
    g.add_argument("--augment", action="store_const", const=True, help="add the augmentation stages")
    g.add_argument("--num-actors", type=_positive, metavar="K", help=f"{who} actors (default 2)")
    g.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="join this Ray cluster, or 'auto': the Ray running on "
        "this host (default: this job's own Ray, started here or by another of its services on this host)",
    )
    g.add_argument("--quarantine", metavar="FILE", help="append bad records here (JSONL)")
    g.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="records held read ahead, e.g. 1GiB (default 2GiB; blocks are read in windows of a quarter)",
    )
    g.add_argument(
        "--stats-file",
        metavar="FILE",
        help="write the source's counters here as JSON on exit; a node agent writes one file per rank, "
        "'.rank<r>' before the suffix (stats.json: stats.rank0.json, stats.rank1.json ...) or where "
        "FILE has '{rank}'. Fields: docs/operations.md#stats-file",
    )
    g.add_argument(
        "--max-bad-fraction",
        type=float,
        metavar="F",
        help="fail the job once more than this share of the records read are bad (default 0.1; while "
        "a rank reads its view the share counts at least 100 records, at its end the records read)",
    )
    p.add_argument("--state-dir", help="journal here after every round (restartable)")
    p.add_argument(
        "--startup-timeout",
        type=float,
        metavar="S",
        help="seconds to wait for the coordinator to answer at start (default 600)",
    )
    p.add_argument(
        "--client-grace",
        type=float,
        help="seconds a disconnected trainer has to come back: a restart from its checkpoint (default 600)",
    )
    p.add_argument(
        "--retain-mb",
        type=float,
        metavar="MB",
        help="memory per rank for the batches consumed since the trainer's second-last checkpoint, held "
        "so that trainers restarted from it get them again (default 2048)",
    )
    p.add_argument(
        "--trainer-timeout",
        type=float,
        metavar="S",
        help="seconds ready batches wait for a trainer that has not connected yet, at the start or "
        "for the next epoch, before the job fails naming this rank (default 1800)",
    )


def _add_spec(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job spec ([job]; identical on the coordinator and every rank)")
    add_job_flags(g)


SPEC_FLAGS = tuple(KEYS)


def _add_security(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security ([security]; default: plaintext, no token, loopback only)")
    g.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain this service presents")
    g.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", metavar="FILE", help="PEM CA bundle that peers' certificates must chain to")
    g.add_argument(
        "--tls-client-auth",
        dest="client_auth",
        action="store_const",
        const=True,
        help="mutual TLS: require callers to present a certificate signed by --tls-ca",
    )
    g.add_argument("--token-file", metavar="FILE", help="file holding the shared bearer token")


SECURITY_FLAGS = ("tls_cert", "tls_key", "tls_ca", "client_auth", "token_file")


def _add_server(p: argparse.ArgumentParser, role: str) -> None:
    g = p.add_argument_group(f"serving ([{role}], [logging])")
    g.add_argument("--host", help="address to listen on (default: 127.0.0.1, loopback only)")
    g.add_argument("--port", type=int, help="port (0 picks a free one; default from the config, else 0)")
    g.add_argument("--port-file", default=None, help="write the bound ports here as JSON")
    g.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: a free one)")
    g.add_argument("--metrics-host", help="address of the metrics endpoint (default: --host)")
    g.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="logging level (default INFO)",
    )
    g.add_argument("--log-format", choices=("text", "json"), help="text lines or one JSON object per line")


def _overrides(
    args: argparse.Namespace, section: str, names: Sequence[str], rename: dict[str, str] | None = None
) -> dict[str, object]:
    rename = rename or {}
    return {
        f"{section}.{rename.get(n, n)}": getattr(args, n) for n in names if getattr(args, n, None) is not None
    }


def _common_overrides(args: argparse.Namespace) -> dict[str, object]:
    out = _overrides(args, "job", SPEC_FLAGS)
    out |= _overrides(args, "security", SECURITY_FLAGS)
    out |= _overrides(
        args, "logging", ("log_level", "log_format"), {"log_level": "level", "log_format": "format"}
    )
    return out


def _logging(cfg) -> None:
    setup_logging(cfg.logging.level, cfg.logging.format)


def _coordinator(args: argparse.Namespace) -> int:
    from batchd.service import run_coordinator  # lazily: the daemon imports Ray and gRPC

    overrides = _common_overrides(args)
    overrides |= _overrides(
        args,
        "coordinator",
        ("host", "port", "lease", "startup_timeout", "state_dir", "metrics_port"),
        {"lease": "lease_s", "startup_timeout": "startup_timeout_s"},
    )
    cfg = load_config(args.config, overrides)
    _logging(cfg)
    c = cfg.coordinator
    return run_coordinator(
        cfg.job,
        c.host,
        c.port,
        args.port_file,
        c.lease_s,
        c.startup_timeout_s,
        security=cfg.security_object(),
        metrics_port=c.metrics_port,
        metrics_host=args.metrics_host or c.host,
        state_dir=c.state_dir,
        resize=args.resize,
    )


def _service_config(args: argparse.Namespace):
    """The merged config of a rank service or node agent (`_add_rank_args`' flags over --config) and the
    coordinator's address; logging is set up."""
    overrides = _common_overrides(args)
    overrides |= _overrides(
        args,
        "coordinator",
        ("coordinator", "startup_timeout"),
        {"coordinator": "address", "startup_timeout": "startup_timeout_s"},
    )
    overrides |= _overrides(
        args,
        "rank",
        ("host", "state_dir", "client_grace", "trainer_timeout", "retain_mb"),
        {"client_grace": "client_grace_s", "trainer_timeout": "trainer_timeout_s"},
    )
    overrides |= _overrides(
        args,
        "data",
        (
            "lengths",
            "dataset",
            "num_actors",
            "ray_address",
            "quarantine",
            "stats_file",
            "memory_budget",
            "max_bad_fraction",
        ),
    )
    overrides |= _overrides(args, "pipeline", ("tokenizer", "processor", "template", "vision", "augment"))
    if args.lengths is not None:  # the flag's source replaces the file's, whichever that was
        overrides["data.dataset"] = DROP
    cfg = load_config(args.config, overrides)
    coordinator = cfg.coordinator.dial_address()
    if coordinator is None:
        raise ValueError(
            "the coordinator's address is unknown: pass --coordinator HOST:PORT or set "
            "coordinator.address (or a fixed coordinator.port) in the config"
        )
    return cfg, coordinator


def _service_object(args: argparse.Namespace, cfg, base: int):
    """The `ServiceConfig` of `run_rank` and `run_node` (flags over `cfg`); `base` is the rank whose ports
    the config gives."""
    from batchd.service import Endpoint, Limits, ServiceConfig, SourceOptions

    d = cfg.data
    return ServiceConfig(
        source=SourceOptions(
            lengths=read_workload(d.lengths) if d.lengths else None,
            dataset=d.dataset,
            tokenizer=cfg.pipeline.tokenizer,
            num_actors=d.num_actors,
            ray_address=d.ray_address,
            quarantine=d.quarantine,
            cutoff=cfg.pipeline.cutoff,
            pipeline=cfg.pipeline.stage_kwargs(),
            source_options=d.source_options(),
        ),
        endpoint=Endpoint(
            host=cfg.rank.host,
            port=args.port if args.port is not None else cfg.rank.port_of(base),
            advertise=getattr(args, "advertise", None),
            port_file=args.port_file,
            metrics_port=cfg.rank.metrics_port_of(base) if args.metrics_port is None else args.metrics_port,
            metrics_host=args.metrics_host or cfg.rank.host,
            security=cfg.security_object(),
        ),
        limits=Limits(
            client_grace_s=cfg.rank.client_grace_s,
            trainer_timeout_s=cfg.rank.trainer_timeout_s,
            startup_timeout_s=cfg.coordinator.startup_timeout_s,
            retain_bytes=int(cfg.rank.retain_mb * 2**20),
        ),
        state_dir=cfg.rank.state_dir,
        stats_file=d.stats_file,
    )


def _rank(args: argparse.Namespace) -> int:
    from batchd.service import run_rank

    if args.rank < 0:
        raise ValueError(f"--rank must be >= 0, got rank={args.rank}")
    cfg, coordinator = _service_config(args)
    if args.rank >= cfg.job.world_size:
        raise ValueError(f"--rank must be < world size {cfg.job.world_size}, got rank={args.rank}")
    _logging(cfg)
    return run_rank(cfg.job, args.rank, coordinator, _service_object(args, cfg, args.rank))


def _node(args: argparse.Namespace) -> int:
    from batchd.service import node_ranks, run_node

    ranks = node_ranks(args.local_ranks, args.node_rank)
    cfg, coordinator = _service_config(args)
    if ranks[-1] >= cfg.job.world_size:
        raise ValueError(
            f"node rank {ranks[0] // len(ranks)} with {len(ranks)} local ranks serves ranks "
            f"{ranks[0]}..{ranks[-1]}, but the job's world size is {cfg.job.world_size}"
        )
    _logging(cfg)
    return run_node(cfg.job, ranks, coordinator, _service_object(args, cfg, 0), name=args.name)


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


def _demo(args: argparse.Namespace) -> int:
    progress = None if args.json else (lambda msg: print(f"[batchd demo] {msg}", file=sys.stderr, flush=True))
    from batchd.demo import run_demo  # lazily, like the services: it imports Ray

    summary = run_demo(
        args.world_size,
        args.num_samples,
        args.token_budget,
        args.policy,
        args.window,
        args.depth,
        args.seed,
        baseline=not args.no_baseline,
        progress=progress,
        synthetic=args.synthetic,
        dataset=args.dataset,
        num_actors=args.num_actors,
        ray_address=args.ray_address,
        tokenizer=args.tokenizer,
        processor=args.processor,
        step_time=args.step_time,
        phases=args.phases,
        memory_budget=args.memory_budget,
        max_bad_fraction=args.max_bad_fraction,
        deterministic=args.deterministic,
    )
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchd", description="batchd: token-budget batching as a service.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_simulate(sub)

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

    p = sub.add_parser(
        "coordinator",
        help="run the gRPC alignment coordinator",
        description="Runs the DGAP alignment coordinator for one job until every rank's trainer took its "
        "last step. Settings come from --config ([job], [coordinator], [security], [logging]) and flags.",
    )
    _add_config_flag(p)
    _add_spec(p)
    _add_server(p, "coordinator")
    _add_security(p)
    p.add_argument(
        "--lease",
        type=float,
        help="seconds a rank may stay silent before the job fails naming it "
        "(default 60); a slow trainer never fails a job, only a gone party does",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        metavar="S",
        help="seconds to wait for every rank to register (default 600)",
    )
    p.add_argument(
        "--state-dir",
        help="journal the job here (fsynced); a coordinator restarted with the same command resumes it",
    )
    p.add_argument(
        "--resize",
        action="store_true",
        help="the journal in --state-dir ran this job at another world size: go on at --world-size from "
        "the trainers' checkpoint, the epoch's samples no step before it held dealt to the new ranks "
        "(without it a different world size is refused, so a typo cannot resize a job)",
    )
    p.set_defaults(func=_coordinator)

    p = sub.add_parser(
        "rank",
        help="run one rank's batching service",
        description="Runs the batching service of one trainer rank. Settings come from --config "
        "([job], [data], [pipeline], [rank], [coordinator].address, [security], [logging]) and "
        "flags; rank r listens on rank.base_port + r unless --port is given.",
    )
    p.add_argument("--rank", type=int, required=True, help="this service's rank")
    _add_rank_args(p, "this rank's")
    p.set_defaults(func=_rank)

    p = sub.add_parser(
        "node",
        help="run a node agent: the batching services of all of a host's ranks",
        description="Runs the node agent of one host: the batching services of its K trainer ranks "
        "(global ranks G*K .. G*K+K-1, torchrun's numbering) in one process, on one port every "
        "local trainer connects to (python -m batchd.train --node-agent HOST:PORT), with one "
        "stream to the coordinator. Samples a balanced plan moves between its ranks are handed "
        "over in process; only moves to other nodes cross the network. Same settings as "
        "`batchd rank`; it listens on rank.base_port unless --port is given.",
    )
    g = p.add_argument_group("node")
    g.add_argument(
        "--local-ranks",
        type=_positive,
        metavar="K",
        help="trainer ranks on this host (default: $LOCAL_WORLD_SIZE, as torchrun sets it)",
    )
    g.add_argument(
        "--node-rank",
        type=int,
        metavar="G",
        help="this host's index among the job's nodes (default: $GROUP_RANK, else $NODE_RANK)",
    )
    g.add_argument("--name", help="the agent's name in logs and failures (default: the host name)")
    g.add_argument(
        "--advertise",
        metavar="HOST",
        help="the host other nodes reach this agent at (default: --host, or this machine's name "
        "when --host is 0.0.0.0)",
    )
    _add_rank_args(p, "each rank's")
    p.set_defaults(func=_node)

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
        defaults={"world_size": 2, "token_budget": 1024},
        spec_defaults=True,
    )
    p.add_argument(
        "--num-samples",
        type=_positive,
        default=1024,
        metavar="M",
        help="records of the generated dataset, or synthetic samples (default 1024)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the fixed-batching comparison run")
    p.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        metavar="S",
        help="batchd trainers sleep S seconds per step (a real model's step time; default 0)",
    )
    p.add_argument(
        "--phases",
        type=int,
        choices=(1, 2),
        default=None,
        help="2: balance the vision encoder too (OrchMLLM two-phase; one all-to-all of image "
        "embeddings per step); default 2 for the image data under policy balanced, else 1",
    )
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
        type=_positive,
        default=2,
        metavar="K",
        help="preprocessing actors in all, spread over the rank services (default 2)",
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
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_demo)

    add_bench_parser(sub)
    sub.add_parser(
        "torchrun",
        help="torchrun for a batchd job: restarts that work, one line on Ctrl-C (same arguments)",
        description="torch.distributed.run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (restarted worker "
        "groups connect to each other, pytorch #135712) and a one-line end on Ctrl-C / SIGTERM (exit "
        "130 / 143) that says how to resume; every argument is torchrun's (`batchd torchrun --help` "
        "prints torchrun's own).",
    )
    return parser


# Exit statuses, the same for every command (README, "Exit statuses").
EXIT_OK = 0
EXIT_JOB_FAILED = 1  # the job failed: a party failed or is gone, too many bad records, samples lost
EXIT_ERROR = 2  # a flag, a config key, a file, or a party that cannot be reached (one line names it)
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM
EXIT_TERMINATED = 143  # SIGTERM, from `batchd coordinator` (and `batchd torchrun`)
EXIT_CLOSED_PIPE = 141  # standard output was closed early (`| head`): nothing more is printed


def main(argv: Sequence[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    if args_in[:1] == ["torchrun"]:  # every argument is torchrun's: not parsed here
        from batchd._torchrun import main as torchrun_main

        return torchrun_main(args_in[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("coordinator", "rank", "node") and not faulthandler.is_enabled():
        faulthandler.enable()  # a daemon that dies in native code (gRPC, torch) leaves its stacks in its log
    from batchd.core import BatchdError, JobFailed

    try:
        status = args.func(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is handled below
        if status in (EXIT_INTERRUPTED, EXIT_TERMINATED) and args.command in ("coordinator", "rank", "node"):
            print(f"batchd {args.command}: interrupted", file=sys.stderr, flush=True)  # a service's stop
        return status
    except KeyboardInterrupt as exc:
        print(
            f"batchd {args.command}: interrupted{f' {exc}' if str(exc) else ''}", file=sys.stderr, flush=True
        )
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`| head`): end quietly, as command-line tools do
        return _closed_pipe()
    except JobFailed as exc:
        print(f"batchd {args.command}: the job failed: {exc}", file=sys.stderr)
        return EXIT_JOB_FAILED
    except BatchdError as exc:  # a party that cannot be reached (or refuses): the line names it
        print(f"batchd {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except (ValueError, OSError, RuntimeError, TimeoutError) as exc:
        print(f"batchd {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _closed_pipe() -> int:
    """Points stdout at /dev/null so the interpreter's final flush cannot fail again; the status for
    SIGPIPE."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return EXIT_CLOSED_PIPE


if __name__ == "__main__":
    sys.exit(main())
