"""`python -m batchd.train`'s flags (`build_parser`) and what they resolve to: the rank service's address,
the model's vocabulary, the trainer's `Security`."""

from __future__ import annotations

import argparse
import os

from batchd.proto import Security
from batchd.service.preprocess import TokenizerRef

STRATEGIES = ("ddp", "fsdp2", "deepspeed")


def env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"{name} is not set: start this module with torchrun ({name}=None)")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value=}") from None


def rank_service_address(
    rank: int,
    world_size: int,
    rank_services: str | None = None,
    rank_host: str | None = None,
    base_port: int | None = None,
) -> str:
    """The host:port of `rank`'s batching service.

    Args:
        rank: The global trainer rank.
        world_size: Ranks in the job.
        rank_services: A comma list of `world_size` addresses (indexed by rank), or one address
            containing `{rank}` (formatted with the rank).
        rank_host: With `base_port`: rank r's service listens on rank_host:base_port + r.
        base_port: See `rank_host`.

    Raises:
        ValueError: when neither or both forms are given, or the list has the wrong length.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got {rank=} {world_size=}")
    if (rank_services is None) == (base_port is None):
        raise ValueError(
            f"give either rank_services or rank_host + base_port, got {rank_services=} {base_port=}"
        )
    if rank_services is not None:
        if "{rank}" in rank_services:
            return rank_services.format(rank=rank)
        addresses = [a.strip() for a in rank_services.split(",") if a.strip()]
        if len(addresses) != world_size:
            raise ValueError(f"rank_services must list world_size={world_size} addresses, got {addresses=}")
        return addresses[rank]
    if base_port is None or not 0 < base_port + rank < 65536:
        raise ValueError(f"base_port + rank must be a TCP port, got {base_port=} {rank=}")
    return f"{rank_host or '127.0.0.1'}:{base_port + rank}"


def vocab_size(explicit: int | None, tokenizer: str | None) -> int:
    """The model's vocabulary: `explicit`, else 1 + the largest id of `tokenizer` (a tokenizer.json or a
    Hugging Face tokenizer directory), else 512.

    Raises:
        ValueError: when `explicit` is smaller than the tokenizer's vocabulary (ids would overflow), or
            `tokenizer` is not a tokenizer.
        FileNotFoundError: naming `tokenizer` when it does not exist.
    """
    needed = TokenizerRef(tokenizer).id_space if tokenizer else None
    if explicit is not None and needed is not None and explicit < needed:
        raise ValueError(
            f"vocab_size is smaller than the tokenizer's, got {explicit=} {needed=} ({tokenizer=})"
        )
    return explicit if explicit is not None else (needed or 512)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m batchd.train",
        description="One torchrun-launched DDP rank training on its batchd rank service.",
    )
    _add_where(p)
    _add_model(p)
    _add_run(p)
    _add_checkpoint(p)
    sec = p.add_argument_group("security (as the rank services: batchd.proto.Security)")
    sec.add_argument(
        "--tls-ca", default=None, metavar="FILE", help="CA of the rank service's certificate (TLS on)"
    )
    sec.add_argument("--tls-cert", default=None, metavar="FILE", help="client certificate (mutual TLS)")
    sec.add_argument("--tls-key", default=None, metavar="FILE", help="key of --tls-cert")
    sec.add_argument("--tls-client-auth", action="store_true", help="present --tls-cert (mutual TLS)")
    sec.add_argument("--token-file", default=None, metavar="FILE", help="shared bearer token")
    _add_hooks(p)
    return p


def _add_where(p: argparse.ArgumentParser) -> None:
    """Where the rank service is, and the process group's backend."""
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--node-agent",
        metavar="HOST:PORT",
        help="this host's node agent (`batchd node`), serving every local rank (default: $BATCHD_NODE_AGENT)",
    )
    where.add_argument(
        "--rank-services",
        metavar="ADDRS",
        help="comma list of rank service addresses by global rank, or one with {rank}",
    )
    where.add_argument(
        "--base-port", type=int, metavar="P", help="rank r's service listens on --rank-host:P+r"
    )
    p.add_argument("--rank-host", default="127.0.0.1", metavar="HOST", help="host of the rank services")
    p.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="process group backend (auto: nccl when CUDA is available, else gloo)",
    )


def _add_model(p: argparse.ArgumentParser) -> None:
    """The model: the tiny LM's vocabulary and sizes, or `--hf-model`; the data parallelism."""
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="model vocabulary (default: --tokenizer's, else 512 = `batchd rank --lengths`)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="FILE",
        help="the rank services' tokenizer (a tokenizer.json or a Hugging Face tokenizer directory): "
        "the model's vocabulary covers its ids",
    )
    p.add_argument(
        "--hf-model",
        default=None,
        metavar="DIR",
        help="train this stock Hugging Face multimodal model (Qwen2-VL, Qwen2.5-VL, LLaVA; a directory "
        "save_pretrained wrote, read offline; `batchd tiny-vlm DIR` writes a tiny one) through "
        "batchd.two_phase(model) instead of the tiny LM",
    )
    p.add_argument(
        "--images",
        action="store_true",
        help="the tiny LM with a vision encoder in front (`TinyMLLM`), for the synthetic images of a "
        "workload CSV (`batchd node --lengths W.csv`); with `phases = 2` it runs the vision exchange",
    )
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="ddp",
        help="data parallelism: ddp (DistributedDataParallel), fsdp2 (torch's fully_shard per block, "
        "then the root) or deepspeed (ZeRO, --zero-stage; needs the deepspeed package)",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 1, 2, 3),
        default=2,
        help="the DeepSpeed ZeRO stage with --strategy deepspeed",
    )
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--n-layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--n-heads", type=int, default=4, help="attention heads")


def _add_run(p: argparse.ArgumentParser) -> None:
    """The run: learning rate, seed, epochs, the client's credits and timeouts."""
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        metavar="E",
        help="epochs to train, 0..E-1 (default: all the job's epochs, asked of the rank service); "
        "a checkpoint resumes mid-epoch",
    )
    p.add_argument("--credits", type=int, default=4, help="batches the rank service may send ahead")
    p.add_argument(
        "--reconnect-timeout",
        type=float,
        default=60.0,
        help="seconds to retry an unreachable rank service (covers its restart)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait for a rank service that is not up yet (logged every 5 s); then exit 2",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="process group collective timeout, seconds")


def _add_checkpoint(p: argparse.ArgumentParser) -> None:
    """Checkpoints, `--elastic`, and logging."""
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="save/resume rank-<r>.pt here")
    p.add_argument(
        "--elastic",
        default=None,
        metavar="DIR",
        help="torchrun elastic: rank 0 starts the coordinator (--resize) and each host's local rank 0 "
        "its node agent, from --config, journaling under DIR (shared by every host), so a restarted "
        "worker group goes on at its new world size (batchd/_elastic.py)",
    )
    p.add_argument(
        "--config", default=None, metavar="FILE", help="the job config the --elastic services read"
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=100,
        metavar="K",
        help="steps between checkpoints (taken at the next end of an optimizer update)",
    )
    p.add_argument(
        "--log-every", type=int, default=10, metavar="K", help="rank 0 logs the loss every K steps"
    )


def _add_hooks(p: argparse.ArgumentParser) -> None:
    """The summary file and the test hooks (`benchmarks/chaos.py`)."""
    p.add_argument(
        "--summary",
        default=None,
        metavar="FILE",
        help="write this rank's JSON summary here ({rank} is replaced)",
    )
    p.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        metavar="S",
        help="sleep S seconds per step, before training it (simulates a slower model)",
    )
    p.add_argument(
        "--crash-at",
        default=None,
        metavar="R:K[:RANK],...",
        help="test hook: os._exit(1) in torchrun restart R after K steps of that run (on rank RANK only, "
        "if given), after the step is logged and before it is trained",
    )
    p.add_argument(
        "--inject-oom-above",
        type=float,
        default=None,
        metavar="COST",
        help="test hook: raise torch.OutOfMemoryError before training any step of planned cost above COST "
        "(StepInfo.cost), as a device too small for the job's token budget would",
    )
    p.add_argument(
        "--ids-log",
        default=None,
        metavar="FILE",
        help="append each step's epoch, step and sample ids here as a JSON line, fsynced, before "
        "training it ({rank} is replaced)",
    )


def security_from_args(args: argparse.Namespace):
    """The trainer's `batchd.proto.Security` from its flags, or None (plaintext, no token)."""
    if not any((args.tls_ca, args.tls_cert, args.tls_key, args.token_file, args.tls_client_auth)):
        return None
    return Security.from_files(
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        client_auth=args.tls_client_auth,
        token_file=args.token_file,
    )
