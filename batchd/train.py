"""A torchrun-launched reference trainer: one DDP rank that trains on its batchd rank service.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \\
        -m batchd.train --rank-host batchd-head --base-port 7100

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous (MASTER_ADDR/PORT); this module reads
them, initialises the process group (NCCL on `cuda:LOCAL_RANK` when CUDA is available, else gloo on
CPU), connects a `BatchClient` to the rank service of its global rank and runs `train_step` on every
(batch, StepInfo) of epochs 0..E-1 (`client.set_epoch(e)` before each; E: `--epochs`, by default the
job's, asked of the rank service). The rank service address comes from `--node-agent HOST:PORT` (this
host's `batchd node`, which serves every local rank on one port; default $BATCHD_NODE_AGENT), from
`--rank-services` (a comma list indexed by global rank, or one address with a `{rank}` placeholder) or
from `--rank-host HOST --base-port P` (rank r at HOST:P+r, one `batchd rank` per rank).

The model is the demo's `TinyCausalLM` (size flags below): this is a smoke-test and template trainer;
a real job swaps in its own model and keeps the loop. With `--hf-model DIR` it is instead the stock Hugging
Face multimodal model saved in DIR (a Qwen2-VL, Qwen2.5-VL or LLaVA checkout, or `batchd tiny-vlm DIR`'s
tiny one; loaded offline, fp32, by `batchd._vlm_tiny.load_vlm`), adapted by `batchd.two_phase(model)`
before DDP wraps it, so the same `train_step` loop trains it on one- and two-phase, padded or packed
batches (the rank services then run the model's own processor: `[pipeline] processor = DIR`). The size
flags are ignored and `--vocab-size` is refused: the model's embedding is the vocabulary (`--tokenizer`,
if given, must fit in it). With `--checkpoint DIR` every rank saves the model, the optimizer and
`BatchClient.state_dict()` every `--checkpoint-every` steps (at the next update's end) and at the end,
and resumes from DIR when it holds a checkpoint, so a restarted torchrun continues mid-epoch (the rank
services must still be running, or have been restarted with `--state-dir`; they keep the steps from the
older of the last two checkpoints on, so a group that crashed between two saves, or during one, gets
them again). With `ddp` each rank writes its own `rank-<r>.pt` (atomically: a temporary file, then a
rename). A restarted group first agrees on the furthest saved position (a rank killed between the
all-reduce of step s and its own save is one step behind: step s was consumed by the collective, so it
skips it rather than replaying it against the others' next step). Beside each checkpoint a small
`rank-<r>.pos.json` holds its position: when the furthest position in DIR was saved at another world
size (the job was resized: `batchd coordinator --resize`), every rank loads that checkpoint
(`BatchClient.load_state_dict(..., resize=True)`; DDP replicates the model, so any rank's serves all)
and the rank services resume the epoch there.

`fsdp2` and `deepspeed` shard the model and the optimizer, so a checkpoint is one directory that every
rank writes its shards into together: `DIR/fsdp2-<n>/` (`torch.distributed.checkpoint`: `get_state_dict`
then `dcp.save`; resumed with `dcp.load` then `set_state_dict`) or `DIR/deepspeed-<n>/` (the engine's
`save_checkpoint` / `load_checkpoint`, tag `deepspeed-<n>`), each rank's `BatchClient.state_dict()` in it
as `data-rank-<r>.json`. Once every rank wrote its part (a barrier), rank 0 points `DIR/latest.json` at
the new directory (a temporary file, then a rename), so a crash in the middle of a save resumes from the
one before; after a second barrier every rank writes its `rank-<r>.pos.json`, tells its rank service the
save completed (`BatchClient.checkpointed()`: it frees the steps before it) and rank 0 removes the older
directories. Every rank resumes from the directory `latest.json` names (rank 0 reads it and tells the
others), so they start at the same position; DIR must be shared by every host. These checkpoints resume
at the world size they were saved at only: a resized job (another world size than `latest.json`'s) is
refused at start in one line, as is a DIR that another `--strategy` saved into.

`--strategy` picks the data parallelism; every one trains the same loop on the same loss scale:
`ddp` (the default, DistributedDataParallel), `fsdp2` (torch's `fully_shard` on each transformer block,
then the root; `train_step` unchanged: FSDP2's reduce-scatter averages over the ranks like DDP) and
`deepspeed` (ZeRO `--zero-stage`, default 2, over the process group made here; AdamW as its optimizer,
no gradient accumulation; `batchd.client.batchd_deepspeed_backward` then `engine.step()`). `fsdp2` and
`deepspeed` train the tiny LM only (with `--hf-model` they are refused in one line, as is `deepspeed`
without the deepspeed package); their checkpoints are sharded (above).

Test hooks (`benchmarks/chaos.py`): `--step-time S` sleeps S seconds per step (a stand-in for a slow
model); `--ids-log FILE` appends one JSON line per step as the batch arrives, before it is trained
(`{"epoch", "step", "ids", "patches", "t", "world", "restart"}`, fsynced; `t`: the wall clock;
`patches`: the vision-encoder
patches this rank runs that step, the rows of its `pixel_values`; `world`: the world size; `restart`:
torchrun's $TORCHELASTIC_RESTART_COUNT), so a restarted trainer that replays a step logs it again with
the same ids.

Summary (one JSON line on stdout, and `--summary FILE`): the strategy, steps, idle steps, steps per
epoch, the last loss, the wall time, `exchange_steps` (steps whose batch carried a two-phase vision
exchange) and `vision_imbalance`: the mean over steps with images of the slowest rank's
encoder patches / the mean rank's (1.0: every rank encoded alike; all ranks' patches, gathered once at the
end; null without images). Rank 0 also logs it ("vision encoder: ..."): with `phases = 2` the
coordinator's vision plan keeps it near 1.

Start order and progress: the trainer may start before its rank service / node agent; it waits up to
`--startup-timeout` (default 600 s, like the services) and logs every 5 s whom it waits for and why
("waiting for the rank service at ADDR (rank R of N) (5s of 600s): UNAVAILABLE: ... Connection
refused"). Rank 0 shows the epoch's progress in samples (all ranks together, out of the job's total,
steps beside them): a tqdm bar on a terminal, else a log line every $BATCHD_PROGRESS_S seconds (30).

Exit status: 0 done; 1 the job failed (`JobFailed`: the message names the failed party); 2 an error
before or outside the job, in one line `[rank R] batchd.train: error: ...`: a bad flag or file, or a
rank service that cannot be reached (or refuses this trainer): the line names its address.

Trade-offs: with `ddp` one checkpoint file per rank (the DDP model is replicated, so this stores N
copies; simple and independent of a shared filesystem's consistency), with `fsdp2` / `deepspeed` one
sharded directory on a shared filesystem (each rank writes 1/N of the model and optimizer); the trainer
fails fast with exit code 1 and the job's failure message (naming the failed rank) when any party fails,
and leaves restarts to torchrun (`--max-restarts`) or the orchestrator.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from batchd.client import (
    BatchClient,
    BatchdError,
    ClientOptions,
    JobFailed,
    batchd_deepspeed_backward,
    train_step,
    weighted_steps,
)
from batchd.proto import Progress, Security, progress_interval
from batchd.service.preprocess import TokenizerRef

from ._elastic import ElasticServices
from ._logging import setup_logging
from ._model import TinyCausalLM
from ._trainer import _FailureWatch, raise_job_failure

STRATEGIES = ("ddp", "fsdp2", "deepspeed")


def _env_int(name: str) -> int:
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
    sec = p.add_argument_group("security (as the rank services: batchd.proto.Security)")
    sec.add_argument(
        "--tls-ca", default=None, metavar="FILE", help="CA of the rank service's certificate (TLS on)"
    )
    sec.add_argument("--tls-cert", default=None, metavar="FILE", help="client certificate (mutual TLS)")
    sec.add_argument("--tls-key", default=None, metavar="FILE", help="key of --tls-cert")
    sec.add_argument("--tls-client-auth", action="store_true", help="present --tls-cert (mutual TLS)")
    sec.add_argument("--token-file", default=None, metavar="FILE", help="shared bearer token")
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
        "--ids-log",
        default=None,
        metavar="FILE",
        help="append each step's epoch, step and sample ids here as a JSON line, fsynced, before "
        "training it ({rank} is replaced)",
    )
    return p


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


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one rank's epochs; returns the exit code (1 when the job failed, 2 on an error)."""
    args = build_parser().parse_args(argv)
    setup_logging("WARNING")  # batchd's own lines (waiting, progress) at INFO; torch's and others' quieter
    logging.getLogger("batchd").setLevel(logging.INFO)
    rank, world_size, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    _stop_quietly_on_signals(rank, args.checkpoint)
    services: ElasticServices | None = None
    try:  # bad addresses and TLS/token/tokenizer files fail here, before the rendezvous, in one line
        if args.epochs is not None and args.epochs < 1:
            raise ValueError(f"--epochs must be >= 1, got {args.epochs}")
        if not args.startup_timeout > 0:
            raise ValueError(f"--startup-timeout must be > 0, got {args.startup_timeout}")
        progress_interval()  # a bad $BATCHD_PROGRESS_S fails here
        if args.elastic is not None:
            if args.config is None or args.checkpoint is None or args.node_agent or args.rank_services:
                raise ValueError(
                    "--elastic DIR needs --config FILE and --checkpoint DIR, and starts its own node agent"
                )
            services = ElasticServices(args.config, args.elastic)
            services.start()
            args.node_agent = services.agent
        node_agent = args.node_agent or (
            os.environ.get("BATCHD_NODE_AGENT", "").strip() or None
            if args.rank_services is None and args.base_port is None
            else None
        )
        if node_agent is not None:
            address = node_agent
        elif args.rank_services is None and args.base_port is None:
            raise ValueError(
                "where is the rank service? pass --node-agent HOST:PORT (or set $BATCHD_NODE_AGENT), "
                "--rank-services ADDRS or --base-port P"
            )
        else:
            address = rank_service_address(
                rank, world_size, args.rank_services, args.rank_host, args.base_port
            )
        security = security_from_args(args)
        if args.strategy != "ddp" and args.hf_model is not None:
            raise ValueError(
                f"--strategy {args.strategy} trains the tiny LM only, got --hf-model={args.hf_model}"
            )
        if args.checkpoint is not None:
            _check_checkpoint_dir(Path(args.checkpoint), args.strategy, world_size)
        if args.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            raise ValueError("--strategy deepspeed needs the deepspeed package: pip install deepspeed")
        if args.hf_model is not None:
            hf_model = _load_hf_model(args)
        else:
            hf_model, vocab = None, vocab_size(args.vocab_size, args.tokenizer)
    except (ValueError, OSError) as exc:
        return _fail(rank, f"batchd.train: error: {exc}", 2)
    cuda = torch.cuda.is_available() and args.backend != "gloo"
    backend = args.backend if args.backend != "auto" else ("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        _init_process_group(backend, args.timeout, rank)
    except RestartStoreError as exc:
        return _fail(rank, f"batchd.train: error: {exc}", 2)
    ddp = None
    works: list[
        Any
    ] = []  # the last collectives' handles: released after the process group (see _vision_imbalance)
    try:
        torch.manual_seed(args.seed)
        options = ClientOptions(args.credits, args.reconnect_timeout, args.startup_timeout)
        client = BatchClient(address, rank, world_size, security=security, options=options)
        longest = client.job_max_tokens()  # the job's longest sample: the model's positions must reach it
        if hf_model is not None:  # adapted before DDP wraps it: DDP sees the model's own parameters
            from batchd.client import two_phase

            _check_positions(hf_model, longest, args.hf_model)
            model = two_phase(hf_model.to(device))
        else:
            model = TinyCausalLM(
                vocab_size=vocab,
                d_model=args.d_model,
                n_layers=args.n_layers,
                n_heads=args.n_heads,
                max_len=max(4096, longest) if longest else 1 << 20,  # rotary: no table to size
            ).to(device)
        if args.strategy == "fsdp2":  # before the optimizer: fully_shard makes the parameters DTensors
            _fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        step = train_step
        if args.strategy == "deepspeed":  # before its checkpoint: the engine loads it
            ddp, step = _deepspeed_engine(model, opt, args), _deepspeed_step
        ckpt: Path | _ShardedCheckpoint | None = None
        if args.checkpoint is not None and args.strategy != "ddp":  # one directory, every rank's shards
            ckpt = _ShardedCheckpoint(Path(args.checkpoint), args.strategy, rank, ddp)
            ckpt.load(model, opt, client)
        elif args.checkpoint is not None:
            ckpt = Path(args.checkpoint) / f"rank-{rank}.pt"
        load, resize = _checkpoint_to_load(ckpt, world_size) if isinstance(ckpt, Path) else (None, False)
        if load is not None:  # before DDP wraps the model: DDP broadcasts rank 0's weights
            state = torch.load(load, map_location=device, weights_only=False)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            client.load_state_dict(state["data"], resize=resize)
            print(
                f"[rank {rank}] resumed from {load} at epoch {client.epoch} step {client.next_step}"
                + (
                    f" (saved at world size {state['data']['world_size']}: the job was resized)"
                    if resize
                    else ""
                ),
                file=sys.stderr,
                flush=True,
            )
        if ckpt is not None:
            _agree_position(client, device)
        if args.strategy == "ddp":
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
        elif args.strategy == "fsdp2":
            ddp = model
        summary = _loop(client, ddp, opt, rank, args, ckpt, step, works)
        if services is not None:  # the job ended: they exit by themselves once every rank finished
            services.wait(120.0)
    except JobFailed as exc:
        return _fail(rank, f"batchd job failed: {exc}", 1)
    except (VocabularyError, PositionsError) as exc:
        return _fail(rank, f"batchd.train: error: {exc}", 2)
    except BatchdError as exc:  # e.g. the rank service unreachable: one line naming it, not a traceback
        return _fail(rank, f"batchd.train: error: {exc}", 2)
    finally:
        _destroy_process_group()
        del ddp  # its reducer holds the process group: its gloo threads are joined here, then the handles go
        works.clear()
    summary.update(
        rank=rank,
        world_size=world_size,
        backend=backend,
        device=str(device),
        rank_service=address,
        strategy=args.strategy,
    )
    line = json.dumps(summary)
    print(line, flush=True)
    if args.summary:
        Path(args.summary.format(rank=rank)).write_text(line)
    return 0


def _fail(rank: int, reason: str, code: int) -> int:
    """Prints `[rank R] reason` on stderr and returns `code`. Under torchrun ($TORCHELASTIC_ERROR_FILE set for
    each worker) the same line becomes the rank's error file, in the format `torch.distributed.elastic`
    reads (a message and, in place of a Python traceback, the line itself): `batchd torchrun` ends a failed
    worker group with these lines, and torchrun's own failure summary shows them."""
    line = f"[rank {rank}] {reason}"
    print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        info = {"py_callstack": line, "timestamp": str(int(time.time()))}
        try:
            Path(error_file).write_text(json.dumps({"message": {"message": line, "extraInfo": info}}))
        except OSError:
            pass  # the line is on stderr already; torchrun then reports the exit status alone
    return code


def _stop_quietly_on_signals(rank: int, checkpoint: str | None) -> None:
    """Ctrl-C and SIGTERM (torchrun passes either on to its workers) end this rank at once in one line,
    exit 130 / 143, without a traceback or a wait on peers that are stopping too: the checkpoint on disk
    is where the job goes on."""

    def stop(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        where = f"; its last checkpoint is in {checkpoint}" if checkpoint else ""
        print(f"[rank {rank}] batchd.train: stopped by {name}{where}", file=sys.stderr, flush=True)
        os._exit(143 if signum == signal.SIGTERM else 130)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


INIT_GRACE_S = 60.0  # past the process group's own timeout, the watchdog ends a stuck init


def _init_process_group(backend: str, timeout_s: float, rank: int) -> None:
    """`dist.init_process_group`, ended by a watchdog when it outlives its own timeout: a gloo bootstrap
    that connected to a stale peer address (a port reused by another process) waits forever, and a rank
    that never returns is a silent hang of the whole job. The watchdog names the stall and exits 1, so
    that torchrun restarts the group or the job fails."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(timeout_s + INIT_GRACE_S):
            os._exit(
                _fail(
                    rank,
                    f"batchd.train: error: the {backend} process group did not form within "
                    f"{timeout_s + INIT_GRACE_S:g}s (--timeout {timeout_s:g} + {INIT_GRACE_S:g}); a peer "
                    f"unreachable or stuck in its own init (MASTER_ADDR={os.environ.get('MASTER_ADDR')}, "
                    f"MASTER_PORT={os.environ.get('MASTER_PORT')})",
                    1,
                )
            )

    threading.Thread(target=watch, name="batchd-init-watchdog", daemon=True).start()
    try:
        timeout = timedelta(seconds=timeout_s)
        store = _restart_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            world = int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    finally:
        done.set()


class RestartStoreError(ValueError):
    """torchrun restarts a worker group on several hosts over its shared rendezvous store."""


def _restart_store(timeout: timedelta) -> Any:
    """The process group's store under torchrun `--max-restarts`, or None for `env://`'s own.

    torchrun (since torch 2.5) hands its workers the rendezvous store of its agent, the same one for every
    restart, without a prefix per restart: a restarted group reads the old group's addresses and gloo or
    NCCL connects to peers that are gone (pytorch #135712). On one host every worker of a group has the
    same restart count, so the store is prefixed with it. Across hosts the agents count restarts apart,
    so that is refused at start, naming the way out."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) == 0:
        return None
    if int(os.environ.get("GROUP_WORLD_SIZE", 1)) > 1:
        raise RestartStoreError(
            "torchrun --max-restarts across several hosts shares its rendezvous store between restarts, "
            "so a restarted group can reach the old group's peers (pytorch #135712): run it as `batchd "
            "torchrun` with --rdzv-backend c10d (or set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every host; "
            "a static rendezvous always shares it)"
        )
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    tcp = dist.TCPStore(host, port, int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"batchd/restart_{restart}", tcp)


def _destroy_process_group() -> None:
    """Ends the process group; through DeepSpeed once it wraps the group (it caches groups made from it,
    stale in a later group of the same process unless it releases them)."""
    ds_comm = sys.modules.get("deepspeed.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()


def _fully_shard(model: torch.nn.Module) -> None:
    """FSDP2: each transformer block its own group (all-gathered for its forward/backward, reduce-scattered
    after), then the root (embedding, final norm, head). The gradient is averaged over the ranks like
    DDP's, so `train_step` and its loss scale apply unchanged."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def _deepspeed_engine(model: torch.nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace) -> Any:
    """A DeepSpeed engine over the process group already made (its backend), ZeRO stage `--zero-stage`,
    `opt` as its optimizer, no gradient accumulation (each batchd step is one update)."""
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # its CPU backend JIT-compiles a shared-memory all-reduce on its first init (~40 s, needs a compiler),
    # used only by inference_all_reduce: off, training reduces over the process group
    deepspeed.ops.__compatible_ops__ = {**deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm": False}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _deepspeed_step(engine: Any, opt: Any, batch: Any, info: Any) -> float:
    """`train_step` for a DeepSpeed engine: forward, scaled loss, engine.backward, engine.step."""
    loss = batchd_deepspeed_backward(engine, batch, info)
    engine.step()
    return loss


def _load_hf_model(args: argparse.Namespace) -> torch.nn.Module:
    """The `--hf-model` directory's model (offline, fp32); ValueError / OSError naming the directory."""
    if args.vocab_size is not None:
        raise ValueError(f"--vocab-size is the model's own with --hf-model, got {args.vocab_size=}")
    path = Path(args.hf_model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--hf-model must be a model directory (save_pretrained's: config.json and the "
            f"weights), got {args.hf_model!r}"
        )
    import transformers

    from ._vlm_tiny import load_vlm

    transformers.logging.disable_progress_bar()  # "Loading weights" per rank: noise in a trainer's log
    try:
        model = load_vlm(path)
    except (ValueError, KeyError) as exc:  # transformers: an unknown model type, missing weights
        raise ValueError(f"--hf-model {args.hf_model!r} does not load as a multimodal model: {exc}") from None
    rows = model.get_input_embeddings().num_embeddings
    vocab_size(rows, args.tokenizer)  # the rank services' tokenizer must fit the model's embedding
    return model


def _vocabulary(model: torch.nn.Module) -> int | None:
    """Rows of the model's token embedding: `vocab_size` of the tiny LM, the input embedding's of an
    HF model."""
    if hasattr(model, "vocab_size") and isinstance(model.vocab_size, int):
        return model.vocab_size
    embeddings = getattr(model, "get_input_embeddings", None)
    return embeddings().num_embeddings if embeddings is not None else None


def _patches(batch: dict[str, Any]) -> int:
    """Vision-encoder patches this rank runs this step: the rows of its `pixel_values` (0 without images)."""
    pixels = batch.get("pixel_values")
    return int(pixels.shape[0]) if pixels is not None and pixels.ndim > 0 else 0


def _vision_imbalance(patches: list[int], device: torch.device, works: list[Any]) -> float | None:
    """The mean over steps with images of max / mean rank patches, over every rank's `patches` (one entry
    per step of this run; collectives: every rank calls it). Two all-reduces (max, sum) of one number per
    step, so each rank holds one vector, not every rank's. None without images, or when the ranks ran
    different numbers of steps (a resumed run whose ranks restarted at different points).

    The collectives' handles go to `works`, which the caller keeps until the process group is gone: these
    are the run's last collectives, and a gloo worker thread that dropped the last reference to one (its
    Python tensors, so it needs the GIL) while the main thread destroys the group (holding the GIL, joining
    that thread) deadlocks the exit."""
    world = dist.get_world_size()

    def all_reduce(t: torch.Tensor, op: Any) -> None:
        work = dist.all_reduce(t, op=op, async_op=True)
        works.append(work)
        work.wait()

    n = torch.tensor([len(patches), -len(patches)], dtype=torch.int64, device=device)
    all_reduce(n, dist.ReduceOp.MAX)  # the longest run, and minus the shortest
    longest, shortest = int(n[0]), -int(n[1])
    high = torch.zeros(longest, dtype=torch.int64, device=device)
    high[: len(patches)] = torch.tensor(patches, dtype=torch.int64)
    total = high.clone()
    all_reduce(high, dist.ReduceOp.MAX)
    all_reduce(total, dist.ReduceOp.SUM)
    if longest != shortest:
        return None
    ratios = [
        h * world / t for h, t in zip(high.tolist(), total.tolist(), strict=False) if t > 0
    ]  # = batchd.core.imbalance
    return sum(ratios) / len(ratios) if ratios else None


POINTER = "latest.json"  # fsdp2 / deepspeed: names the last complete checkpoint directory of --checkpoint


def _read_pointer(directory: Path) -> dict[str, Any] | None:
    """DIR/latest.json (`_ShardedCheckpoint`): {"strategy", "dir", "seq", "world_size", "epoch",
    "next_step"}, or None when DIR holds no sharded checkpoint."""
    try:
        return json.loads((directory / POINTER).read_text())
    except FileNotFoundError:
        return None


def _check_checkpoint_dir(directory: Path, strategy: str, world_size: int) -> None:
    """Refuses, before the rendezvous, a `--checkpoint` DIR this run cannot resume from: one that another
    `--strategy` saved into, or a sharded (fsdp2 / deepspeed) checkpoint of another world size."""
    pointer = _read_pointer(directory)
    saved_by = pointer["strategy"] if pointer else ("ddp" if any(directory.glob("rank-*.pt")) else None)
    if saved_by is not None and saved_by != strategy:
        raise ValueError(
            f"--checkpoint {directory} holds a --strategy {saved_by} checkpoint, got --strategy {strategy}: "
            "resume with the strategy that saved it, or give another directory"
        )
    if pointer is not None and int(pointer["world_size"]) != world_size:
        raise ValueError(
            f"--strategy {strategy} resumes at the world size it saved at (resizing needs --strategy ddp): "
            f"--checkpoint {directory} was saved at world size {pointer['world_size']}, got {world_size=}"
        )


class _ShardedCheckpoint:
    """`--checkpoint DIR` of `--strategy fsdp2 / deepspeed` (see module docstring): every save a new
    directory DIR/<strategy>-<n>, written by every rank together, then named by DIR/latest.json. All its
    methods are collectives: every rank calls them at the same step.

    Args:
        directory: DIR.
        strategy: "fsdp2" or "deepspeed".
        rank: This rank.
        engine: The DeepSpeed engine (deepspeed), else None.
    """

    def __init__(self, directory: Path, strategy: str, rank: int, engine: Any = None) -> None:
        self.directory, self.strategy, self.rank, self.engine = directory, strategy, rank, engine
        self.seq = 0  # the number n of the last complete save, DIR/<strategy>-<n>

    def load(self, model: torch.nn.Module, opt: torch.optim.Optimizer, client: Any) -> None:
        """Loads the model, the optimizer and `client`'s position of the directory latest.json names, when
        there is one; removes the directories of saves that did not complete."""
        pointer = None
        if self.rank == 0:
            pointer = _read_pointer(self.directory)
            self._remove_others(pointer["dir"] if pointer else None)
        box = [pointer]
        dist.broadcast_object_list(box, src=0)  # every rank the same checkpoint, whatever it sees of DIR
        pointer = box[0]
        if pointer is None:
            return
        self.seq, where = int(pointer["seq"]), self.directory / pointer["dir"]
        if self.strategy == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_state, optim_state = get_state_dict(model, opt)  # this rank's shards, filled in place
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, checkpoint_id=str(where))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        else:
            path, _ = self.engine.load_checkpoint(str(self.directory), tag=pointer["dir"])
            if path is None:
                raise FileNotFoundError(f"DeepSpeed found no checkpoint in {where} (named by {POINTER})")
        client.load_state_dict(json.loads((where / f"data-rank-{self.rank}.json").read_text()))
        print(
            f"[rank {self.rank}] resumed from {where} at epoch {client.epoch} step {client.next_step}",
            file=sys.stderr,
            flush=True,
        )

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, client: Any) -> None:
        data = client.state_dict()  # once: it tells the rank service a checkpoint is taken here
        name = f"{self.strategy}-{self.seq + 1:06d}"
        where = self.directory / name
        where.mkdir(parents=True, exist_ok=True)
        if self.strategy == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(model, opt)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(where))
        else:
            self.engine.save_checkpoint(str(self.directory), tag=name, save_latest=False)
        (where / f"data-rank-{self.rank}.json").write_text(json.dumps(data))
        dist.barrier()  # every rank's part is written
        if self.rank == 0:
            pointer = {
                "strategy": self.strategy,
                "dir": name,
                "seq": self.seq + 1,
                "world_size": data["world_size"],
                "epoch": data["epoch"],
                "next_step": data["next_step"],
            }
            tmp = self.directory / f"{POINTER}.tmp"
            tmp.write_text(json.dumps(pointer))
            tmp.replace(self.directory / POINTER)  # atomic: a crash before it resumes from the one before
        dist.barrier()  # the save is complete on every rank
        self.seq += 1
        pos, tmp = self.directory / f"rank-{self.rank}.pos.json", self.directory / f"rank-{self.rank}.pos.tmp"
        tmp.write_text(json.dumps(data))  # its position, as ddp's (`batchd torchrun`'s note reads it)
        tmp.replace(pos)
        client.checkpointed()  # the rank service frees the steps before it
        if self.rank == 0:
            self._remove_others(name)

    def _remove_others(self, keep: str | None) -> None:
        """Removes DIR/<strategy>-* but `keep`: older saves, and saves that did not complete."""
        for old in self.directory.glob(f"{self.strategy}-*"):
            if old.is_dir() and old.name != keep:
                shutil.rmtree(old, ignore_errors=True)


def _save(
    ckpt: Path | _ShardedCheckpoint, model: torch.nn.Module, opt: torch.optim.Optimizer, client: Any
) -> None:
    if isinstance(ckpt, _ShardedCheckpoint):
        ckpt.save(model, opt, client)
        return
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    tmp = ckpt.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "data": client.state_dict()}, tmp)
    tmp.replace(ckpt)  # atomic: a crash mid-save keeps the previous checkpoint
    pos, tmp = ckpt.with_suffix(".pos.json"), ckpt.with_suffix(".pos.tmp")
    tmp.write_text(json.dumps(client.state_dict()))  # its position, read without loading the model
    tmp.replace(pos)


def _position(data: dict[str, Any]) -> tuple[int, int, int]:
    return int(data["epoch"]), int(data["next_step"]), int(data["finished"])


def _checkpoint_to_load(ckpt: Path | None, world_size: int) -> tuple[Path | None, bool]:
    """`--strategy ddp`'s (the checkpoint this rank resumes from, whether the job was resized since it was
    saved). Every rank's file holds the same model and optimizer at an update's end (DDP replicates them); the
    furthest position saved in the directory says where the job stands. Saved at this world size: each
    rank its own file (`_agree_position` evens out a step between them). Saved at another (the job was
    resized, `batchd coordinator --resize`): every rank the furthest one, its data state at that size."""
    if ckpt is None:
        return None, False
    saved = {}
    for pos in ckpt.parent.glob("rank-*.pos.json"):
        try:
            saved[pos] = json.loads(pos.read_text())
        except ValueError:
            continue
    if not saved:
        return (ckpt if ckpt.exists() else None), False
    newest = max(saved, key=lambda p: _position(saved[p]))
    if int(saved[newest]["world_size"]) == world_size:
        return (ckpt if ckpt.exists() else None), False
    return newest.with_name(newest.name.replace(".pos.json", ".pt")), True


def _agree_position(client: Any, device: torch.device) -> None:
    """Moves this rank to the furthest (epoch, next_step, finished) any rank saved. Checkpoints are per
    rank, so a group killed between one rank's save and another's resumes up to one step apart; the step
    in between went through the all-reduce on every rank, so the rank behind skips it."""
    mine = torch.tensor(
        [client.epoch, client.next_step, int(client.finished)], dtype=torch.int64, device=device
    )
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    epoch, next_step, finished = max(tuple(int(x) for x in t.tolist()) for t in every)
    if (epoch, next_step, finished) != (client.epoch, client.next_step, int(client.finished)):
        print(
            f"[rank {client.rank}] a peer saved a later position: epoch {epoch} step {next_step} "
            f"(mine: epoch {client.epoch} step {client.next_step})",
            file=sys.stderr,
            flush=True,
        )
        client.epoch, client.next_step, client.finished = epoch, next_step, bool(finished)


def _maybe_crash(spec: str | None, rank: int, steps: int) -> None:
    """`--crash-at`: dies like an OOM kill would, without a word, when this run reached its step."""
    if not spec:
        return
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    for item in spec.split(","):
        r, k, *who = (int(x) for x in item.split(":"))
        if r == restart and k == steps and (not who or who[0] == rank):
            os._exit(1)


def _log_step(fd: int | None, epoch: int, step: int, ids: list[int], patches: int) -> None:
    if fd is not None:  # one write per line: a kill leaves whole lines
        line = {"epoch": epoch, "step": step, "ids": ids, "patches": patches, "t": round(time.time(), 3)}
        line |= {
            "world": dist.get_world_size(),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        }
        os.write(fd, (json.dumps(line) + "\n").encode())
        os.fsync(fd)


class PositionsError(ValueError):
    """The job sends samples longer than the model's positions reach."""


def _check_positions(model: torch.nn.Module, longest: int | None, name: str) -> None:
    """Refuses, before the first step, a model whose position embeddings cannot reach the job's longest
    sample (`BatchClient.job_max_tokens`): one line naming both numbers, not a traceback mid-job."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    limit = getattr(text, "max_position_embeddings", None)
    if longest and isinstance(limit, int) and longest > limit:
        raise PositionsError(
            f"the job sends samples of up to {longest} tokens (its token_budget and over_budget policy), "
            f"but --hf-model {name} takes at most {limit} positions (max_position_embeddings): lower "
            '[job] token_budget, or cut long samples (over_budget = "truncate")'
        )


class VocabularyError(ValueError):
    """A batch holds token ids the model's embedding has no row for: the trainer's vocabulary is not the
    rank services' tokenizer's."""


def _check_vocabulary(batch: dict[str, Any], vocab: int | None, args: argparse.Namespace) -> None:
    ids = batch.get("input_ids")
    if vocab is None or ids is None or ids.numel() == 0:
        return
    top = int(ids.max())
    if top >= vocab:
        if args.hf_model is not None:
            raise VocabularyError(
                f"token id {top} is past the vocabulary of --hf-model {args.hf_model} ({vocab} ids): "
                "the rank services' processor ([pipeline] processor) must be this model's"
            )
        given = f"--tokenizer {args.tokenizer}" if args.tokenizer else "no --tokenizer"
        raise VocabularyError(
            f"token id {top} is past the model's vocabulary of {vocab} ({given}): give --tokenizer the "
            "rank services' tokenizer (`batchd tokenizer tok.json` writes the default one) or a larger "
            "--vocab-size"
        )


def _loop(client, ddp, opt, rank, args, ckpt, train_step, works: list[Any]) -> dict[str, Any]:
    steps = idle = 0
    due = False  # a checkpoint is due at the next update's end
    epoch_steps: list[int] = []
    patches: list[int] = []  # per step of this run: the encoder's load on this rank
    exchange_steps = 0  # steps whose batch carried a two-phase vision exchange
    loss = float("nan")
    t0 = time.perf_counter()
    watch = _FailureWatch(client)
    module = getattr(ddp, "module", ddp)  # DDP's and DeepSpeed's wrapped model; FSDP2 shards it in place
    vocab = _vocabulary(module)
    ids_log = (
        os.open(args.ids_log.format(rank=rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if args.ids_log
        else None
    )
    try:
        epochs = args.epochs or client.job_epochs()
        total = client.job_samples() if rank == 0 else None  # the job's samples per epoch, all ranks
        for epoch in range(client.epoch, epochs):
            client.set_epoch(epoch)  # the checkpoint's epoch keeps its position
            n = 0
            # closed only after a failure was asked about (see _trainer._run_batchd); DeepSpeed cannot
            # rescale a gradient after the backward: it reads each update ahead, weighed over it
            batches = weighted_steps(client) if args.strategy == "deepspeed" else iter(client)
            bar = Progress(f"rank 0: epoch {epoch + 1}/{epochs}", total, "samples", enabled=rank == 0)
            try:
                for batch, info in batches:
                    bar.update(info.global_samples, steps=1)
                    ids = batch.pop("sample_ids", None)
                    patches.append(_patches(batch))
                    exchange_steps += int("vision_send_splits" in batch)
                    _log_step(ids_log, epoch, info.step, ids.tolist() if ids is not None else [], patches[-1])
                    _maybe_crash(args.crash_at, rank, steps + 1)
                    if args.step_time > 0:
                        time.sleep(args.step_time)
                    _check_vocabulary(batch, vocab, args)
                    loss = train_step(ddp, opt, batch, info)
                    steps, n = steps + 1, n + 1
                    idle += int(info.is_idle)
                    if rank == 0 and args.log_every and steps % args.log_every == 0:
                        print(
                            f"[rank 0] epoch {epoch} step {info.step} loss {loss:.4f}",
                            file=sys.stderr,
                            flush=True,
                        )
                    due = due or steps % args.checkpoint_every == 0
                    if ckpt is not None and due and info.update_end:  # no gradient held
                        _save(ckpt, module, opt, client)
                        due = False
            except VocabularyError:
                raise
            except BatchdError as exc:  # the client's own diagnosis (JobFailed, or its service unreachable)
                if not isinstance(exc, JobFailed) and watch.failure:  # the service failed the job first
                    raise JobFailed(f"{watch.failure} (this trainer saw: {exc})") from exc
                raise
            except Exception as exc:  # a collective broke because a peer died: ask the rank service which
                raise_job_failure(client, watch, exc)
                raise
            finally:
                bar.close()
                batches.close()
            epoch_steps.append(n)
    finally:
        watch.stop()
        if ids_log is not None:
            os.close(ids_log)
    if ckpt is not None:
        _save(ckpt, module, opt, client)
    client.close()
    wall = round(time.perf_counter() - t0, 3)
    vision = _vision_imbalance(patches, next(module.parameters()).device, works)
    if rank == 0 and vision is not None:
        print(
            f"[rank 0] vision encoder: slowest rank / mean, in encoder patches: {vision:.3f} (mean over "
            f"steps with images)",
            file=sys.stderr,
            flush=True,
        )
    return {
        "steps": steps,
        "idle": idle,
        "epoch_steps": epoch_steps,
        "epoch": client.epoch,
        "next_step": client.next_step,
        "last_loss": loss,
        "wall_s": wall,
        "vision_imbalance": vision,
        "exchange_steps": exchange_steps,
    }


if __name__ == "__main__":
    sys.exit(main())
