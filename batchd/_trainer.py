"""A DDP trainer process for the demo and the end-to-end tests: one epoch of a tiny causal LM (or TinyMLLM).

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
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
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
from batchd.proto import batchd_pb2 as pb
from batchd.service.preprocess import (
    EXHAUSTED,
    PoolOptions,
    RaySource,
    default_stages,
    ensure_ray,
    resolve_many,
    synthetic_payload,
)

from ._logging import setup_logging
from ._mllm import TinyMLLM
from ._model import TinyCausalLM
from .launch import StepTicker

MODEL_DEFAULTS = {"vocab_size": 512, "d_model": 128, "n_layers": 2, "n_heads": 4}


def build_model(
    model_cfg: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The demo's model: `TinyCausalLM`, or `TinyMLLM` (its encoder reads the batches' pixels) when
    `model_cfg` names an ``image_token_id``; with an ``audio_token_id`` too, its audio encoder reads the
    batches' clips (`audio_features`, and the audio exchange when the batch carries one)."""
    torch.manual_seed(seed)
    cfg = {**MODEL_DEFAULTS, **model_cfg}
    if cfg.get("image_token_id") is not None:
        return TinyMLLM(**cfg).to(dtype)
    for key in ("image_token_id", "audio_token_id", "n_mels"):
        cfg.pop(key, None)
    return TinyCausalLM(**cfg).to(dtype)


def _patches(batch: dict[str, Any]) -> int:
    """Vision-encoder patches this rank ran this step (the encoder's load)."""
    pixels = batch.get("pixel_values")
    return int(pixels.shape[0]) if pixels is not None else 0


def _record_encoders(result: dict[str, Any], batch: Any, new_clips: bool = True) -> None:
    """This step's encoder loads: vision patches, audio frames, and the clips it encoded (`new_clips`
    False: a batch repeated as padding, whose clips were counted once already)."""
    result["encoded_patches"].append(_patches(batch))
    frames = batch.get("audio_frames")
    result["encoded_frames"].append(int(frames.sum()) if frames is not None else 0)
    result["encoded_clips"].append(len(frames) if frames is not None and new_clips else 0)


def fixed_batches(
    lengths: list[int], rank: int, world_size: int, seed: int, batch_size: int
) -> list[list[int]]:
    """The baseline's batches of sample ids for `rank` (DistributedSampler semantics, shuffle on)."""
    perm = epoch_permutation(len(lengths), seed, 0).tolist()
    per_rank = math.ceil(len(perm) / world_size)
    padded = perm + perm[: per_rank * world_size - len(perm)]
    view = padded[rank::world_size]
    return [view[i : i + batch_size] for i in range(0, len(view), batch_size)]


def run(
    rank: int,
    world_size: int,
    master_port: int,
    out: str,
    mode: str = "batchd",
    service: str = "",
    lengths: list[int] | None = None,
    batch_size: int = 0,
    seed: int = 0,
    lr: float = 1e-3,
    model_cfg: dict[str, Any] | None = None,
    gloo_timeout_s: float = 60.0,
    grad_steps: int = 0,
    dtype: str = "float32",
    threads: int = 1,
    dataset: str | None = None,
    tokenizer: str | None = None,
    cutoff: int = 4096,
    num_actors: int = 1,
    ray_address: str | None = None,
    shuffle: bool = True,
    step_time: float = 0.0,
    processor: str | None = None,
) -> dict[str, Any]:
    """Trains one epoch on this rank; writes and returns the result dict. `step_time` (batchd mode):
    seconds slept per step, a stand-in for a real model's step (tests of slow trainers)."""
    torch.set_num_threads(threads)
    # positions reach the longest sample either side may send (rotary: nothing to allocate)
    model_cfg = {"max_len": max(4096, cutoff, *(lengths or [])), **(model_cfg or {})}
    source = None
    if mode != "batchd" and dataset is not None:  # started before the clock, like the rank services
        ensure_ray(ray_address)
        source = RaySource(
            dataset,
            rank,
            world_size,
            seed,
            0,
            shuffle,
            pool=PoolOptions(
                num_actors=num_actors, stages=default_stages(tokenizer, cutoff=cutoff, processor=processor)
            ),
        )
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=gloo_timeout_s),
    )
    model = build_model(model_cfg, seed, getattr(torch, dtype))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    result: dict[str, Any] = {
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
    t0 = time.perf_counter()
    ticker = StepTicker(out)  # the demo's progress: this rank's samples and steps so far
    try:
        if mode == "batchd":
            _run_batchd(rank, world_size, service, ddp, opt, result, grad_steps, step_time, ticker)
        elif source is not None:
            _run_fixed_source(source, batch_size, ddp, opt, result, ticker)
        else:
            _run_fixed(rank, world_size, lengths or [], batch_size, seed, model_cfg, ddp, opt, result, ticker)
        ticker.write()
        result["wall_s"] = time.perf_counter() - t0
        result["steps"] = len(result["losses"])
        dist.barrier()
    finally:
        if source is not None:
            result["preprocess"] = source.stats()
        Path(out).write_text(json.dumps(result))
        dist.destroy_process_group()
        if source is not None:
            source.close()
            ray.shutdown()
    return result


def _log_global_loss(logits: torch.Tensor, labels: torch.Tensor, result: dict[str, Any]) -> None:
    with torch.no_grad():
        s, n = token_loss_sum(logits.detach().float(), labels)
        buf = torch.tensor([float(s), float(n)], dtype=torch.float64)
        dist.all_reduce(buf)
        result["losses"].append(float(buf[0] / buf[1]) if buf[1] > 0 else float("nan"))


def _run_batchd(rank, world_size, service, ddp, opt, result, grad_steps, step_time=0.0, ticker=None) -> None:
    client = BatchClient(service, rank, world_size)
    # Held in a variable: when a step fails, the loop must not close the stream before _job_failure has
    # asked the service why (a closed stream looks like this trainer died, and would be blamed on it).
    batches = iter(client)
    watch = _FailureWatch(client)
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
                mask = batch.get("attention_mask")
                result["real_tokens"] += (
                    int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())
                )
                if mask is not None:
                    result["longest"] = max(result["longest"], int(mask.sum(1).max()))
                result["padded_tokens"] += int(batch["input_ids"].numel())
            check_one_step_update(info, "the demo trainer")  # it steps after every step
            scale, tokens = (0.0, 0) if info.is_idle else (info.loss_scale, info.local_loss_tokens)
            if step_time > 0:
                time.sleep(step_time)
            opt.zero_grad(set_to_none=True)
            logits = forward_logits(ddp, batch)
            loss, _ = scaled_loss_and_mean(logits, batch["labels"], scale, tokens)
            loss.backward()
            if len(result["grads"]) < grad_steps:  # the all-reduced gradient, for the equality test
                result["grads"].append(
                    torch.cat(
                        [p.grad.detach().flatten() for p in ddp.module.parameters() if p.grad is not None]
                    ).tolist()
                )
            opt.step()
            result["sample_ids"].append(ids)
            _record_encoders(result, batch)
            _log_global_loss(logits, batch["labels"], result)
            if ticker is not None:
                ticker.tick(len(ids))
    except JobFailed:
        raise
    except Exception as exc:
        raise_job_failure(client, watch, exc)
        raise
    finally:
        watch.stop()
        batches.close()
        client.close()


class _FailureWatch:
    """Polls this rank's service for the job's failure in the background and keeps the message.

    A trainer blocked in a collective learns that a peer died only when a peer it exchanges with
    drops the connection (in a ring, after its neighbours have exited), by which time its rank service
    may have failed and exited too; the message kept here still names the rank that caused it.
    """

    def __init__(self, client, period_s: float = 0.5) -> None:
        self.client, self.period_s = client, period_s
        self.failure: str | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="batchd-failure-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                failure = self.client.stub.RankStatus(
                    pb.RankStatusRequest(rank=self.client.rank), timeout=2
                ).failure
            except (grpc.RpcError, ValueError):  # ValueError: the channel was closed under us
                continue
            if failure:
                self.failure = failure
                return

    def stop(self) -> None:
        self._stop.set()


def raise_job_failure(client, watch: _FailureWatch, exc: BaseException) -> None:
    """A step raised (typically a collective broke because a peer died): when the rank service knows the
    job failed, raise `JobFailed` with its message (it names the rank); otherwise return."""
    failure = _job_failure(client, watch)
    if failure:
        raise JobFailed(f"{failure} (this trainer saw: {type(exc).__name__}: {exc})") from exc


def _job_failure(client, watch: _FailureWatch) -> str | None:
    """After a collective failed, ask this rank's service why (its message names the failed rank)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            status = client.stub.RankStatus(pb.RankStatusRequest(rank=client.rank), timeout=2)
            if status.failure:
                return status.failure
        except grpc.RpcError:
            return watch.failure or f"rank service of rank {client.rank} at {client.address} is gone"
        time.sleep(0.2)
    return watch.failure


def _run_fixed(rank, world_size, lengths, batch_size, seed, model_cfg, ddp, opt, result, ticker=None) -> None:
    vocab = {**MODEL_DEFAULTS, **model_cfg}["vocab_size"]
    for ids in fixed_batches(lengths, rank, world_size, seed, batch_size):
        payloads = [synthetic_payload(i, lengths[i], seed, vocab) for i in ids]
        batch = collate_padded(payloads)
        result["real_tokens"] += int(batch["attention_mask"].sum())
        result["padded_tokens"] += int(batch["input_ids"].numel())
        opt.zero_grad(set_to_none=True)
        logits = forward_logits(ddp, batch)
        s, n = token_loss_sum(logits, batch["labels"])
        (s / max(n, 1)).backward()
        opt.step()
        result["sample_ids"].append(ids)
        _record_encoders(result, batch)
        _log_global_loss(logits, batch["labels"], result)
        if ticker is not None:
            ticker.tick(len(ids))


def _run_fixed_source(source, batch_size, ddp, opt, result, ticker=None) -> None:
    """The fixed baseline over a `RaySource` (see the module docstring)."""
    exhausted, first = False, None
    while True:
        t_wait = time.perf_counter()
        items = []
        while len(items) < batch_size and not exhausted:
            item = source.poll(1.0)
            if item is EXHAUSTED:
                exhausted = True
            elif item is not None:
                items.append(item)
        ids = [s.id for s, _ in items]
        payloads = resolve_many([p for _, p in items])
        result["wait_s"] += time.perf_counter() - t_wait
        more = torch.tensor([1 if items else 0], dtype=torch.int64)
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not int(more):
            break
        if (
            not items
        ):  # this rank is done, another is not: repeat the first batch (DistributedSampler padding)
            ids, payloads = first or ([], [{"input_ids": np.zeros(1, np.int64), "labels": np.full(1, -100)}])
        elif first is None:
            first = (ids, payloads)
        batch = collate_padded(payloads)
        result["real_tokens"] += int(batch["attention_mask"].sum())
        result["padded_tokens"] += int(batch["input_ids"].numel())
        result["longest"] = max(result["longest"], int(batch["attention_mask"].sum(1).max()))
        opt.zero_grad(set_to_none=True)
        logits = forward_logits(ddp, batch)
        s, n = token_loss_sum(logits, batch["labels"])
        (s / max(n, 1) if n else logits.sum() * 0.0).backward()
        opt.step()
        result["sample_ids"].append(ids)
        _record_encoders(result, batch, new_clips=bool(items))
        _log_global_loss(logits, batch["labels"], result)
        if ticker is not None:
            ticker.tick(len(items))  # a rank past its view repeats its first batch: not progress


def main() -> None:
    p = argparse.ArgumentParser(description="batchd demo trainer (one rank)")
    p.add_argument("--config", required=True, help="JSON file with run()'s keyword arguments")
    args = p.parse_args()
    kwargs = json.loads(Path(args.config).read_text())
    setup_logging("WARNING")  # batchd's own lines (the client waiting for its service) at INFO
    logging.getLogger("batchd").setLevel(logging.INFO)
    try:
        run(**kwargs)
    except JobFailed as exc:  # the job's failure, named by the service: one line, not a traceback
        print(f"rank {kwargs.get('rank')}: the job failed: {exc}", file=sys.stderr)
        sys.exit(1)
    except BatchdError as exc:  # e.g. its rank service unreachable: one line naming it
        print(f"rank {kwargs.get('rank')}: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
