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

The model is the demo's `TinyCausalLM` (size flags below; with `--images`, `TinyMLLM`: the same LM with a
vision encoder for the synthetic images of a workload CSV): this is a smoke-test and template trainer;
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
(`{"epoch", "step", "ids", "patches", "t", "cost", "token_budget", "world", "restart"}`, fsynced; `t`:
the wall clock; `patches`: the vision-encoder patches this rank runs that step, the rows of its
`pixel_values`; `cost` and `token_budget`: its `StepInfo`'s; `world`: the world size; `restart`:
torchrun's $TORCHELASTIC_RESTART_COUNT), so a restarted trainer that replays a step logs it again with
the same ids.

Summary (one JSON line on stdout, and `--summary FILE`): the strategy, steps, idle steps, steps per
epoch, the last loss, the wall time, `exchange_steps` (steps whose batch carried a two-phase vision
exchange), `exchange_rows_to` (the encoder output rows this rank sent to each rank in those exchanges,
indexed by rank; the embedding width times the element size gives the bytes, once forward and once
backward) and `vision_imbalance`: the mean over steps with images of the slowest rank's
encoder patches / the mean rank's (1.0: every rank encoded alike; all ranks' patches, gathered once at the
end; null without images). Rank 0 also logs it ("vision encoder: ..."): with `phases = 2` the
coordinator's vision plan keeps it near 1. With `ddp`, `cost_check` says how well the job's cost model
predicted this rank's own compute (forward + backward, timed by hooks on the model; synchronized on
CUDA): the R^2 of its compute on its steps' planned cost and that line (`batchd.core.cost_check`, over
this rank's steps: no collective at the end; `batchd bench` compares the ranks); rank 0 logs it ("cost
model check: ..."). A low R^2 means the plan balances the wrong cost: `batchd calibrate` measures the
right one. `token_budget`: the budget of its last step (lowered after an out-of-memory
step: a `torch.OutOfMemoryError` in a step is reported, `BatchClient.report_oom`, and the job restarts at
a lower budget, docs/restarts-and-elastic.md; `--inject-oom-above COST` raises one in every step of planned
cost above COST, for tests).

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
import faulthandler
import importlib.util
import json
import logging
import os
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

from batchd.client import BatchClient, BatchdError, ClientOptions, JobFailed, train_step
from batchd.proto import progress_interval

from ._elastic import ElasticServices
from ._logging import setup_logging
from ._train.args import (
    STRATEGIES,
    build_parser,
    env_int,
    rank_service_address,
    security_from_args,
    vocab_size,
)
from ._train.checkpoint import (
    ShardedCheckpoint,
    agree_position,
    check_checkpoint_dir,
    checkpoint_to_load,
)
from ._train.loop import VocabularyError, train_loop
from ._train.models import build_model
from ._train.strategy import (
    PositionsError,
    RestartStoreError,
    check_positions,
    deepspeed_engine,
    deepspeed_step,
    destroy_process_group,
    fully_shard_model,
    load_hf_model,
    restart_store,
)

__all__ = ["STRATEGIES", "build_parser", "main", "rank_service_address", "security_from_args", "vocab_size"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one rank's epochs; returns the exit code (1 when the job failed, 2 on an error)."""
    args = build_parser().parse_args(argv)
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)  # a rank that dies in native code leaves its stacks on stderr
    setup_logging("WARNING")  # batchd's own lines (waiting, progress) at INFO; torch's and others' quieter
    logging.getLogger("batchd").setLevel(logging.INFO)
    rank, world_size, local_rank = env_int("RANK"), env_int("WORLD_SIZE"), env_int("LOCAL_RANK")
    _stop_quietly_on_signals(rank, args.checkpoint)
    try:  # bad addresses and TLS/token/tokenizer files fail here, before the rendezvous, in one line
        services, address = _where(args, rank, world_size)
        security = security_from_args(args)
        hf_model, vocab = _check_args(args, world_size)
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
    ddp = client = None
    try:
        options = ClientOptions(args.credits, args.reconnect_timeout, args.startup_timeout)
        client = BatchClient(address, rank, world_size, security=security, options=options)
        model = _model(args, client, device, hf_model, vocab)
        ddp, opt, ckpt, step = _parallel(args, model, client, device)
        summary = train_loop(client, ddp, opt, args, ckpt, step)
        if services is not None:  # the job ended: they exit by themselves once every rank finished
            services.wait(120.0)
    except JobFailed as exc:
        return _fail(rank, f"batchd job failed: {exc}", 1)
    except (VocabularyError, PositionsError) as exc:
        return _fail(rank, f"batchd.train: error: {exc}", 2)
    except BatchdError as exc:  # e.g. the rank service unreachable: one line naming it, not a traceback
        return _fail(rank, f"batchd.train: error: {exc}", 2)
    finally:
        if client is not None:  # every call ended before the interpreter tears gRPC down (also on errors)
            client.close()
        destroy_process_group()
        del ddp
    where = {"backend": backend, "device": str(device), "rank_service": address, "strategy": args.strategy}
    summary.update(rank=rank, world_size=world_size, **where)
    line = json.dumps(summary)
    print(line, flush=True)
    if args.summary:
        Path(args.summary.format(rank=rank)).write_text(line)
    return 0


def _where(args: argparse.Namespace, rank: int, world_size: int) -> tuple[ElasticServices | None, str]:
    """The `--elastic` services this rank started (or None), and its rank service's address."""
    if args.epochs is not None and args.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {args.epochs}")
    if not args.startup_timeout > 0:
        raise ValueError(f"--startup-timeout must be > 0, got {args.startup_timeout}")
    progress_interval()  # a bad $BATCHD_PROGRESS_S fails here
    services = None
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
        return services, node_agent
    if args.rank_services is None and args.base_port is None:
        raise ValueError(
            "where is the rank service? pass --node-agent HOST:PORT (or set $BATCHD_NODE_AGENT), "
            "--rank-services ADDRS or --base-port P"
        )
    return services, rank_service_address(
        rank, world_size, args.rank_services, args.rank_host, args.base_port
    )


def _check_args(args: argparse.Namespace, world_size: int) -> tuple[torch.nn.Module | None, int | None]:
    """Refuses flags that cannot go together, before the rendezvous; returns the `--hf-model` (or None)
    and the tiny LM's vocabulary (None with `--hf-model`)."""
    if args.strategy != "ddp" and args.hf_model is not None:
        raise ValueError(
            f"--strategy {args.strategy} trains the tiny LM only, got --hf-model={args.hf_model}"
        )
    if args.checkpoint is not None:
        check_checkpoint_dir(Path(args.checkpoint), args.strategy, world_size)
    if args.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise ValueError("--strategy deepspeed needs the deepspeed package: pip install deepspeed")
    if args.hf_model is not None:
        return load_hf_model(args), None
    return None, vocab_size(args.vocab_size, args.tokenizer)


def _model(
    args: argparse.Namespace, client: Any, device: torch.device, hf_model: Any, vocab: int | None
) -> torch.nn.Module:
    """The model this rank trains, on `device`: `--hf-model` adapted by `two_phase` (before DDP wraps it:
    DDP sees the model's own parameters), else the tiny LM of the size flags."""
    longest = client.job_max_tokens()  # the job's longest sample: the model's positions must reach it
    if hf_model is not None:
        from batchd.client import two_phase

        torch.manual_seed(args.seed)
        check_positions(hf_model, longest, args.hf_model)
        return two_phase(hf_model.to(device))
    sizes = {"vocab_size": vocab, "d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads}
    max_len = max(4096, longest) if longest else 1 << 20  # rotary: no table to size
    return build_model("tiny", args.seed, max_len, images=args.images, **sizes).to(device)


def _parallel(args: argparse.Namespace, model: torch.nn.Module, client: Any, device: torch.device) -> tuple:
    """`--strategy`'s wrapped model, the optimizer, the checkpoint (resumed from when it holds one) and the
    step function."""
    rank = client.rank
    if args.strategy == "fsdp2":  # before the optimizer: fully_shard makes the parameters DTensors
        fully_shard_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ddp, step = None, train_step
    if args.strategy == "deepspeed":  # before its checkpoint: the engine loads it
        ddp, step = deepspeed_engine(model, opt, args), deepspeed_step
    ckpt: Path | ShardedCheckpoint | None = None
    if args.checkpoint is not None and args.strategy != "ddp":  # one directory, every rank's shards
        ckpt = ShardedCheckpoint(Path(args.checkpoint), args.strategy, rank, ddp)
        ckpt.load(model, opt, client)
    elif args.checkpoint is not None:
        ckpt = Path(args.checkpoint) / f"rank-{rank}.pt"
        _resume(ckpt, model, opt, client, device)
    if ckpt is not None:
        agree_position(client, device)
    if args.strategy == "ddp":
        cuda = device.type == "cuda"
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    elif args.strategy == "fsdp2":
        ddp = model
    return ddp, opt, ckpt, step


def _resume(ckpt: Path, model: torch.nn.Module, opt: Any, client: Any, device: torch.device) -> None:
    """`ddp`'s resume from its checkpoint file, before DDP wraps the model (DDP broadcasts rank 0's)."""
    load, resize = checkpoint_to_load(ckpt, client.world_size)
    if load is None:
        return
    state = torch.load(load, map_location=device, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    client.load_state_dict(state["data"], resize=resize)
    resized = f" (saved at world size {state['data']['world_size']}: the job was resized)" if resize else ""
    print(
        f"[rank {client.rank}] resumed from {load} at epoch {client.epoch} step {client.next_step}{resized}",
        file=sys.stderr,
        flush=True,
    )


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
        store = restart_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            world = int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    finally:
        done.set()


if __name__ == "__main__":
    sys.exit(main())
