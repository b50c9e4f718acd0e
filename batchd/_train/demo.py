"""One rank of `batchd demo` and the end-to-end tests (`python -m batchd._train.demo --config FILE`, the
JSON of a `DemoRank`): one epoch of DDP over a tiny causal LM (or TinyMLLM).

Two data paths over the same samples and model:
- `batchd`: a `BatchClient` yields aligned variable-size batches with their loss scale; IDLE steps run
  as zero-weight steps so the all-reduce stays aligned;
- `fixed` (the baseline): the rank's `DistributedSampler`-style view (ids r, r+N, ... over the same
  seeded permutation, padded by repetition to equal length like `DistributedSampler`), cut into fixed
  batches of B samples, plain per-rank mean loss. B defaults to the out-of-memory-safe choice,
  floor(L_max / longest sample): what a user must pick when lengths are unknown before preprocessing.

With `dataset` (the demo's Ray path), the fixed baseline preprocesses its own view with a `RaySource`
(the same view, seed and chain as the rank services, so it trains on the same preprocessed samples;
quarantined records drop out of both). Its ranks then hold different sample counts, so every step
all-reduces "has data": a rank that runs out while another has data repeats its first batch
(`DistributedSampler`'s padding by repetition), and the epoch ends when no rank has data.

Every step also all-reduces (loss sum, loss tokens) to log the global per-token loss.
Writes one JSON result: steps, wall time, losses, sample ids per step, padded and real tokens, the
longest sample, each step's encoder loads (`encoded_patches`, audio `encoded_frames`, and the clips it
encoded, `encoded_clips`: every clip once over all ranks; a baseline batch repeated as padding counts
none), and `wait_s`: the time the loop spent blocked waiting for its next batch (the
`next()` of the batch iterator, or the fixed path's polls), from which the demo's stall fraction
`wait_s / wall_s` comes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from batchd.client import (
    BatchClient,
    BatchdError,
    JobFailed,
    check_one_step_update,
    collate_padded,
    forward_logits,
    scaled_loss_and_mean,
    step_batch,
    token_loss_sum,
)
from batchd.core import epoch_permutation
from batchd.service.preprocess import (
    EXHAUSTED,
    PoolOptions,
    RaySource,
    StreamOptions,
    default_stages,
    ensure_ray,
    resolve_many,
    synthetic_payload,
)

from .._logging import setup_logging
from ..launch import StepTicker
from .failure import FailureWatch, raise_job_failure
from .models import MODELS, build_model, patches
from .strategy import all_reduce_released

MODES = ("batchd", "fixed")


@dataclass(frozen=True)
class DemoRank:
    """One demo trainer rank: the keys of its `--config` JSON.

    Args:
        rank, world_size: This rank of the DDP group; master_port: its gloo rendezvous on 127.0.0.1.
        out: The result JSON's path (its progress beside it, `StepTicker`).
        mode: "batchd" (batches from the rank service at `service`) or "fixed" (the baseline: `lengths`'
            synthetic samples in fixed batches of `batch_size`, or with `dataset` a `RaySource` of it).
        seed, lr, model_cfg, dtype, threads, grad_steps: The model's seed, AdamW's rate, `build_model`
            sizes, parameter dtype, torch threads, and steps whose all-reduced gradient the result keeps.
        gloo_timeout_s: The process group's collective timeout: a liveness bound (a peer that dies closes
            its connection at once; this only ends one that hangs), never a speed one.
        dataset, tokenizer, processor, cutoff, num_actors, ray_address, shuffle: The fixed baseline's
            `RaySource` (the rank services' view, chain and seed); max_bad_fraction: its bad-record limit
            (the node agent's, so both judge the generated data alike; None: the source's default).
        step_time: Seconds slept per batchd step, a stand-in for a real model's step.

    Raises:
        ValueError: naming a bad rank, world size or mode.
    """

    rank: int
    world_size: int
    master_port: int
    out: str
    mode: str = "batchd"
    service: str = ""
    lengths: list[int] | None = None
    batch_size: int = 0
    seed: int = 0
    lr: float = 1e-3
    model_cfg: dict[str, Any] | None = None
    gloo_timeout_s: float = 600.0
    grad_steps: int = 0
    dtype: str = "float32"
    threads: int = 1
    dataset: str | None = None
    tokenizer: str | None = None
    cutoff: int = 4096
    num_actors: int = 1
    ray_address: str | None = None
    shuffle: bool = True
    step_time: float = 0.0
    processor: str | None = None
    max_bad_fraction: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size), got {self.rank=} {self.world_size=}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode=}")
        if self.mode == "fixed" and self.batch_size < 1:
            raise ValueError(f"the fixed baseline needs batch_size >= 1, got {self.batch_size=}")


def fixed_batches(
    lengths: list[int], rank: int, world_size: int, seed: int, batch_size: int
) -> list[list[int]]:
    """The baseline's batches of sample ids for `rank` (DistributedSampler semantics, shuffle on)."""
    perm = epoch_permutation(len(lengths), seed, 0).tolist()
    per_rank = math.ceil(len(perm) / world_size)
    padded = perm + perm[: per_rank * world_size - len(perm)]
    view = padded[rank::world_size]
    return [view[i : i + batch_size] for i in range(0, len(view), batch_size)]


def _new_result(rank: int, mode: str) -> dict[str, Any]:
    return {
        "rank": rank,
        "mode": mode,
        "losses": [],
        "sample_ids": [],
        "idle": 0,
        "encoded_patches": [],
        "encoded_frames": [],  # audio-encoder frames per step, and clips encoded (all ranks: each once)
        "encoded_clips": [],
        "real_tokens": 0,
        "padded_tokens": 0,
        "grads": [],
        "wait_s": 0.0,
        "longest": 0,
    }


@dataclass
class _Training:
    """The rank's DDP model, optimizer, result and progress: what every data path's step touches."""

    ddp: Any
    opt: torch.optim.Optimizer
    ticker: StepTicker
    result: dict[str, Any] = field(default_factory=dict)

    def backward_mean(self, batch: dict[str, Any]) -> torch.Tensor:
        """A baseline step's forward and backward: the plain per-rank per-token mean loss."""
        self.opt.zero_grad(set_to_none=True)
        logits = forward_logits(self.ddp, batch)
        s, n = token_loss_sum(logits, batch["labels"])
        (s / max(n, 1) if n else logits.sum() * 0.0).backward()
        return logits

    def count_tokens(self, batch: dict[str, Any]) -> None:
        mask = batch.get("attention_mask")
        self.result["real_tokens"] += int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())
        if mask is not None:
            self.result["longest"] = max(self.result["longest"], int(mask.sum(1).max()))
        self.result["padded_tokens"] += int(batch["input_ids"].numel())

    def done(
        self, ids: list[int], batch: dict[str, Any], logits: torch.Tensor, new_clips: bool = True
    ) -> None:
        """After the optimizer step: its ids, encoder loads (`new_clips` False: a batch repeated as
        padding, whose clips were counted once already) and the global per-token loss (all-reduced)."""
        result = self.result
        result["sample_ids"].append(ids)
        result["encoded_patches"].append(patches(batch))
        frames = batch.get("audio_frames")
        result["encoded_frames"].append(int(frames.sum()) if frames is not None else 0)
        result["encoded_clips"].append(len(frames) if frames is not None and new_clips else 0)
        with torch.no_grad():
            s, n = token_loss_sum(logits.detach().float(), batch["labels"])
            buf = torch.tensor([float(s), float(n)], dtype=torch.float64)
            all_reduce_released(buf, dist.ReduceOp.SUM)  # its last: nothing left to gloo's threads at exit
            result["losses"].append(float(buf[0] / buf[1]) if buf[1] > 0 else float("nan"))


def _fixed_source(spec: DemoRank) -> RaySource | None:
    """The fixed baseline's `RaySource` over `spec.dataset` (started before the clock, like the rank
    services), or None."""
    if spec.mode == "batchd" or spec.dataset is None:
        return None
    ensure_ray(spec.ray_address)
    stages = default_stages(spec.tokenizer, cutoff=spec.cutoff, processor=spec.processor)
    pool = PoolOptions(num_actors=spec.num_actors, stages=stages)
    limit = {} if spec.max_bad_fraction is None else {"max_bad_fraction": spec.max_bad_fraction}
    options = StreamOptions(**limit)
    return RaySource(
        spec.dataset, spec.rank, spec.world_size, spec.seed, 0, spec.shuffle, pool=pool, options=options
    )


def run(spec: DemoRank) -> dict[str, Any]:
    """Trains one epoch on this rank; writes and returns the result dict."""
    torch.set_num_threads(spec.threads)
    # positions reach the longest sample either side may send (rotary: nothing to allocate)
    model_cfg = {"max_len": max(4096, spec.cutoff, *(spec.lengths or [])), **(spec.model_cfg or {})}
    source = _fixed_source(spec)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec.master_port}",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.gloo_timeout_s),
    )
    model = build_model("tiny", spec.seed, dtype=getattr(torch, spec.dtype), **model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    # the demo's progress: this rank's samples and steps so far
    train = _Training(DDP(model), opt, StepTicker(spec.out), _new_result(spec.rank, spec.mode))
    result = train.result
    t0 = time.perf_counter()
    try:
        if spec.mode == "batchd":
            _run_batchd(spec, train)
        elif source is not None:
            _run_fixed_source(source, spec.batch_size, train)
        else:
            vocab = {**MODELS["tiny"], **model_cfg}["vocab_size"]
            _run_fixed(spec, vocab, train)
        train.ticker.write()
        result["wall_s"] = time.perf_counter() - t0
        result["steps"] = len(result["losses"])
        dist.barrier()
    finally:
        if source is not None:
            result["preprocess"] = source.stats()
        Path(spec.out).write_text(json.dumps(result))
        dist.destroy_process_group()
        if source is not None:
            source.close()
            ray.shutdown()
    return result


def _run_batchd(spec: DemoRank, train: _Training) -> None:
    client = BatchClient(spec.service, spec.rank, spec.world_size)
    # Held in a variable: when a step fails, the loop must not close the stream before raise_job_failure
    # has asked the service why (a closed stream looks like this trainer died, and would be blamed on it).
    batches = iter(client)
    watch = FailureWatch(client)
    result = train.result
    try:
        while True:
            t_wait = time.perf_counter()
            try:
                batch, info = next(batches)
            except StopIteration:
                break
            finally:
                waited = time.perf_counter() - t_wait
                result["wait_s"] += waited
                result.setdefault("waits", []).append(round(waited, 5))  # per step, for diagnosis
            ids = batch.pop("sample_ids").tolist()
            if info.is_idle:
                result["idle"] += 1
                batch = step_batch(batch, info)
            else:
                train.count_tokens(batch)
            check_one_step_update(info, "the demo trainer")  # it steps after every step
            scale, tokens = (0.0, 0) if info.is_idle else (info.loss_scale, info.local_loss_tokens)
            if spec.step_time > 0:
                time.sleep(spec.step_time)
            train.opt.zero_grad(set_to_none=True)
            logits = forward_logits(train.ddp, batch)
            loss, _ = scaled_loss_and_mean(logits, batch["labels"], scale, tokens)
            loss.backward()
            if len(result["grads"]) < spec.grad_steps:  # the all-reduced gradient, for the equality test
                grads = [
                    p.grad.detach().flatten() for p in train.ddp.module.parameters() if p.grad is not None
                ]
                result["grads"].append(torch.cat(grads).tolist())
            train.opt.step()
            train.done(ids, batch, logits)
            train.ticker.tick(len(ids))
    except JobFailed:
        raise
    except Exception as exc:
        raise_job_failure(client, watch, exc)
        raise
    finally:
        watch.stop()
        batches.close()
        client.close()


def _run_fixed(spec: DemoRank, vocab: int, train: _Training) -> None:
    lengths = spec.lengths or []
    for ids in fixed_batches(lengths, spec.rank, spec.world_size, spec.seed, spec.batch_size):
        batch = collate_padded([synthetic_payload(i, lengths[i], spec.seed, vocab) for i in ids])
        train.result["real_tokens"] += int(batch["attention_mask"].sum())
        train.result["padded_tokens"] += int(batch["input_ids"].numel())
        logits = train.backward_mean(batch)
        train.opt.step()
        train.done(ids, batch, logits)
        train.ticker.tick(len(ids))


def _poll_batch(source: RaySource, batch_size: int) -> tuple[list[Any], bool]:
    """Up to `batch_size` items of `source`, and whether it is exhausted."""
    items: list[Any] = []
    while len(items) < batch_size:
        item = source.poll(1.0)
        if item is EXHAUSTED:
            return items, True
        if item is not None:
            items.append(item)
    return items, False


def _run_fixed_source(source: RaySource, batch_size: int, train: _Training) -> None:
    """The fixed baseline over a `RaySource` (see the module docstring)."""
    exhausted, first = False, None
    while True:
        t_wait = time.perf_counter()
        items: list[Any] = []
        if not exhausted:
            items, exhausted = _poll_batch(source, batch_size)
        ids = [s.id for s, _ in items]
        payloads = resolve_many([p for _, p in items])
        train.result["wait_s"] += time.perf_counter() - t_wait
        more = torch.tensor([1 if items else 0], dtype=torch.int64)
        all_reduce_released(more, dist.ReduceOp.MAX)
        if not int(more):
            break
        if (
            not items
        ):  # this rank is done, another is not: repeat the first batch (DistributedSampler padding)
            ids, payloads = first or ([], [{"input_ids": np.zeros(1, np.int64), "labels": np.full(1, -100)}])
        elif first is None:
            first = (ids, payloads)
        batch = collate_padded(payloads)
        train.count_tokens(batch)
        logits = train.backward_mean(batch)
        train.opt.step()
        train.done(ids, batch, logits, new_clips=bool(items))
        train.ticker.tick(len(items))  # a rank past its view repeats its first batch: not progress


def main() -> None:
    p = argparse.ArgumentParser(description="batchd demo trainer (one rank)")
    p.add_argument("--config", required=True, help="JSON file with a DemoRank's fields")
    args = p.parse_args()
    kwargs = json.loads(Path(args.config).read_text())
    setup_logging("WARNING")  # batchd's own lines (the client waiting for its service) at INFO
    logging.getLogger("batchd").setLevel(logging.INFO)
    try:
        run(DemoRank(**kwargs))
    except JobFailed as exc:  # the job's failure, named by the service: one line, not a traceback
        print(f"rank {kwargs.get('rank')}: the job failed: {exc}", file=sys.stderr)
        sys.exit(1)
    except BatchdError as exc:  # e.g. its rank service unreachable: one line naming it
        print(f"rank {kwargs.get('rank')}: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
