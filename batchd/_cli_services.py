"""The service commands of `batchd`: `coordinator` (the alignment coordinator), `rank` (one rank's batching
service) and `node` (a node agent: the rank services of all of a host's ranks). Each merges its flags over
a job config file (`--config`) and validates the result before anything starts; the services themselves
(`batchd.service`) are imported lazily: they import Ray and gRPC."""

from __future__ import annotations

import argparse

from batchd._cli_flags import (
    add_config_flag,
    add_security,
    add_server,
    add_spec,
    common_overrides,
    overrides,
    positive,
    setup_job_logging,
)
from batchd._config import DROP, load_config
from batchd._lengths import read_workload


def add_service_parsers(sub: argparse._SubParsersAction) -> None:
    """Adds `coordinator`, `rank` and `node` to `sub`, in the order `--help` lists them."""
    _add_coordinator(sub)
    _add_rank(sub)
    _add_node(sub)


def _add_coordinator(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "coordinator",
        help="run the gRPC alignment coordinator",
        description="Runs the DGAP alignment coordinator for one job until every rank's trainer took its "
        "last step. Settings come from --config ([job], [coordinator], [security], [logging]) and flags.",
    )
    add_config_flag(p)
    add_spec(p)
    add_server(p, "coordinator")
    add_security(p)
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


def _add_rank(sub: argparse._SubParsersAction) -> None:
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


def _add_node(sub: argparse._SubParsersAction) -> None:
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
        type=positive,
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


def _add_rank_args(p: argparse.ArgumentParser, who: str) -> None:
    """The options of a rank service, shared by `batchd rank` and `batchd node` (`who`: whose actors)."""
    add_config_flag(p)
    add_spec(p)
    add_server(p, "rank")
    add_security(p)
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
    _add_preprocessing(p, who)
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


def _add_preprocessing(p: argparse.ArgumentParser, who: str) -> None:
    """The preprocessing group of `_add_rank_args` (`who`: whose actors)."""
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
    g.add_argument("--num-actors", type=positive, metavar="K", help=f"{who} actors (default 2)")
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


def _coordinator(args: argparse.Namespace) -> int:
    from batchd.service import Endpoint, run_coordinator  # lazily: the daemon imports Ray and gRPC

    keys = common_overrides(args)
    keys |= overrides(
        args,
        "coordinator",
        ("host", "port", "lease", "startup_timeout", "state_dir", "metrics_port"),
        {"lease": "lease_s", "startup_timeout": "startup_timeout_s"},
    )
    cfg = load_config(args.config, keys)
    setup_job_logging(cfg)
    c = cfg.coordinator
    endpoint = Endpoint(
        c.host,
        c.port,
        port_file=args.port_file,
        metrics_port=c.metrics_port,
        metrics_host=args.metrics_host or c.host,
        security=cfg.security_object(),
    )
    return run_coordinator(
        cfg.job, endpoint, c.lease_s, c.startup_timeout_s, state_dir=c.state_dir, resize=args.resize
    )


def _service_config(args: argparse.Namespace):
    """The merged config of a rank service or node agent (`_add_rank_args`' flags over --config) and the
    coordinator's address; logging is set up."""
    keys = common_overrides(args)
    keys |= overrides(
        args,
        "coordinator",
        ("coordinator", "startup_timeout"),
        {"coordinator": "address", "startup_timeout": "startup_timeout_s"},
    )
    keys |= overrides(
        args,
        "rank",
        ("host", "state_dir", "client_grace", "trainer_timeout", "retain_mb"),
        {"client_grace": "client_grace_s", "trainer_timeout": "trainer_timeout_s"},
    )
    keys |= overrides(
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
    keys |= overrides(args, "pipeline", ("tokenizer", "processor", "template", "vision", "augment"))
    if args.lengths is not None:  # the flag's source replaces the file's, whichever that was
        keys["data.dataset"] = DROP
    cfg = load_config(args.config, keys)
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
    setup_job_logging(cfg)
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
    setup_job_logging(cfg)
    return run_node(cfg.job, ranks, coordinator, _service_object(args, cfg, 0), name=args.name)
