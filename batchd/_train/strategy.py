"""The reference trainer's process group and data parallelism: torchrun's restart store, FSDP2, DeepSpeed,
and the `--hf-model` it trains instead of the tiny LM."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from batchd.client import batchd_deepspeed_backward

from .args import vocab_size


class RestartStoreError(ValueError):
    """torchrun restarts a worker group on several hosts over its shared rendezvous store."""


def restart_store(timeout: timedelta) -> Any:
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


RELEASE_S = 30.0  # `all_reduce_released` waits this long at most for the worker's reference to go


def all_reduce_released(t: torch.Tensor, op: Any) -> None:
    """`dist.all_reduce(t, op)` that returns only once the backend let go of `t` as well.

    A gloo worker thread drops its own reference to a collective after the caller's `wait()` returned.
    For a tensor made in Python that last drop runs Python code (it needs the GIL): if the process is
    already finalizing by then, CPython ends the thread inside a C++ destructor and the process aborts
    ("terminate called without an active exception"; a trainer's core dump in CI showed a
    `pt_gloo_runloop` thread in `~AsyncAllreduceWork` exactly so). Here the handle is dropped at once and
    the caller sleeps (GIL released) until only its own reference to `t` is left, at most `RELEASE_S`."""
    wait_released([dist.all_reduce(t, op=op, async_op=True)], [t])


def wait_released(work: list[Any], tensors: list[torch.Tensor]) -> None:
    """Waits for the one collective in `work` (a list, so that this frame holds the only handle), drops
    it, then sleeps until the backend let go of every tensor of `tensors` (`all_reduce_released`)."""
    work.pop().wait()
    deadline = time.monotonic() + RELEASE_S
    while any(t._use_count() > 1 for t in tensors) and time.monotonic() < deadline:
        time.sleep(0.001)


def destroy_process_group() -> None:
    """Ends the process group; through DeepSpeed once it wraps the group (it caches groups made from it,
    stale in a later group of the same process unless it releases them)."""
    ds_comm = sys.modules.get("deepspeed.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()


def fully_shard_model(model: torch.nn.Module) -> None:
    """FSDP2: each transformer block its own group (all-gathered for its forward/backward, reduce-scattered
    after), then the root (embedding, final norm, head). The gradient is averaged over the ranks like
    DDP's, so `train_step` and its loss scale apply unchanged."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def deepspeed_engine(model: torch.nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace) -> Any:
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


def deepspeed_step(engine: Any, opt: Any, batch: Any, info: Any) -> float:
    """`train_step` for a DeepSpeed engine: forward, scaled loss, engine.backward, engine.step."""
    loss = batchd_deepspeed_backward(engine, batch, info)
    engine.step()
    return loss


def load_hf_model(args: argparse.Namespace) -> torch.nn.Module:
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

    from .._vlm_tiny import load_vlm

    transformers.logging.disable_progress_bar()  # "Loading weights" per rank: noise in a trainer's log
    try:
        model = load_vlm(path)
    except (ValueError, KeyError) as exc:  # transformers: an unknown model type, missing weights
        raise ValueError(f"--hf-model {args.hf_model!r} does not load as a multimodal model: {exc}") from None
    rows = model.get_input_embeddings().num_embeddings
    vocab_size(rows, args.tokenizer)  # the rank services' tokenizer must fit the model's embedding
    return model


class PositionsError(ValueError):
    """The job sends samples longer than the model's positions reach."""


def check_positions(model: torch.nn.Module, longest: int | None, name: str) -> None:
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
