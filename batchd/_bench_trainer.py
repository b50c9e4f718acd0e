"""One rank of `batchd bench`: epochs of the same model on the same samples, fed by one of four systems.

Systems (the `system` key of the config):

- `fixed`: the rank's sampler view (the same seeded permutation split as batchd's views, ids r, r+N, ...,
  no padding by repetition) cut into fixed batches of B samples, padded; plain per-rank per-token mean
  loss, DDP averages. B is the out-of-memory-safe choice floor(L_max / longest sample).
- `odb-0.1.2`: the seed's own package, run the way its README says: a map-style torch `Dataset` that
  returns exactly the samples batchd's `SyntheticSource` produces for these ids, a multi-worker
  `DataLoader(batch_size=1)` over the rank's view (one loader, re-iterated every epoch after the view
  sampler's `set_epoch`, as ODB expects: it names each iteration's gloo group after an iteration
  count), `odb.apply(loader, token_budget=L, loss_scaling="exact", join=True, buffer_size=window)`,
  the user collate (`collate_padded`, the layout batchd's padded path
  uses), `odb.pop_step_info` + `loss * info.loss_scale`, and the DDP model under torch's `Join` context
  (ODB's join mode lets ranks end on different step counts; its README pairs it with DDP Join).
- `batchd` (policies `odb` / `balanced`, chosen by the rank services): a `BatchClient` against this
  rank's service; loss x `StepInfo.loss_scale`; IDLE steps run a zero-weight forward/backward.

Clock (identical for every system): after process-group init and model build, the rank creates its
data iterator and fetches its first batch (ODB: DataLoader workers, its collate process, its startup
jitter and first grouping round; batchd: connect and first round; fixed: materialize), then all ranks
meet in a barrier; `t0` is taken right after it. Every step records its end time; the rank's wall time
is its last step's end - t0, and the epoch's is the largest over ranks (`time.monotonic`, one clock for
all processes on the machine). The start-up before `t0` is reported separately (`startup_s`), and
`cpu_s` is this trainer process's CPU time over the timed epoch (less sensitive to other load on the
machine than wall time; the data-side processes are not in it).

No collective is added to the timed loop: each step records this rank's loss sum, loss tokens, sample
ids, real and materialized tokens; the parent combines step k across ranks into the global per-token
loss (the k-th backward of every rank is the same DDP all-reduce). After every epoch, rank 0 evaluates
the model on a held-out set of samples (ids beyond the training set) with the clock paused. Epoch e
uses every system's view of epoch e (the same seeded permutation batchd's sources use); batchd's rank
services keep preparing the next epoch during that pause, as they would during a real evaluation.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from batchd._mllm import TinyMLLM
from batchd._model import TinyCausalLM
from batchd.client import (
    BatchClient,
    collate_padded,
    forward_logits,
    idle_batch,
    loss_tokens,
    scale_gradients,
    scaled_loss_and_mean,
    token_loss_sum,
)
from batchd.core import AUDIO_KEYS, VISION_KEYS, ViewSource
from batchd.launch import StepTicker
from batchd.service.preprocess import (
    SYNTHETIC_MELS,
    SYNTHETIC_PATCH_DIM,
    synthetic_sample,
)

# Model presets. `llama-100m`: 12 layers, d_model 768, 12 heads, SwiGLU 2048, vocab 32000 (tied head):
# 24.6M embedding + 12 x 7.1M = 109.5M parameters, a Llama-style decoder for the GPU run.
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"vocab_size": 512, "d_model": 128, "n_layers": 2, "n_heads": 4, "max_len": 4096},
    "llama-100m": {"vocab_size": 32000, "d_model": 768, "n_layers": 12, "n_heads": 12, "max_len": 32768},
}
# `tiny-qwen2vl`: the stock HF Qwen2VLForConditionalGeneration of `batchd._vlm_tiny` (2-block ViT, 2-layer
# M-RoPE LM), adapted by `batchd.two_phase`; its config's ids are the synthetic samples' (`hf_qwen2vl`).
HF_MODELS = ("tiny-qwen2vl",)
MODELS["tiny-qwen2vl"] = {}
SYNTHETIC_VOCAB = 512  # token ids of the synthetic samples (SyntheticSource's default vocabulary)
HF_PATCH_DIM = 3 * 2 * 14 * 14  # Qwen2-VL's patch row: channels x temporal patch x 14 x 14


def hf_qwen2vl(seed: int, max_len: int) -> torch.nn.Module:
    """The tiny stock Qwen2-VL for the synthetic samples, adapted by `batchd.two_phase`: vocabulary 515,
    image token 511 (the synthetic samples' placeholder, `SYNTHETIC_VOCAB - 1`, which their text never
    uses), video / vision start / vision end 512..514 (never in a sample: the payloads carry no vision
    markers, and two_phase derives mm_token_type_ids from the image token); pad 0, sdpa attention."""
    from transformers import Qwen2VLForConditionalGeneration

    from batchd._vlm_tiny import tiny_qwen2vl_config
    from batchd.client import two_phase

    cfg = tiny_qwen2vl_config(
        SYNTHETIC_VOCAB + 3,
        image_token_id=SYNTHETIC_VOCAB - 1,
        video_token_id=SYNTHETIC_VOCAB,
        vision_start_token_id=SYNTHETIC_VOCAB + 1,
        vision_end_token_id=SYNTHETIC_VOCAB + 2,
        pad_token_id=0,
        max_position_embeddings=max(8192, max_len),
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration._from_config(cfg, attn_implementation="sdpa").train()
    return two_phase(model)


def hf_pixels(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with its synthetic patch rows ([P, SYNTHETIC_PATCH_DIM], what every system's data path
    carries) widened to Qwen2-VL's [P, 1176] by tiling, the same for every system: the ViT's patch embedding
    runs at its real width while the wire and the collate move the small rows (`synthetic_image_payload`)."""
    pixels = batch.get("pixel_values")
    if pixels is None or pixels.shape[-1] == HF_PATCH_DIM:
        return batch
    reps = -(-HF_PATCH_DIM // pixels.shape[-1])
    return {**batch, "pixel_values": pixels.repeat(1, reps)[:, :HF_PATCH_DIM].contiguous()}


def vision_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision tower whose forward + backward `VisionTimer` times: HF Qwen2-VL's ``model.visual`` (ViT and
    merger), `TinyMLLM`'s ``vision``; None for a text-only model."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "visual"):
        return inner.visual
    return getattr(model, "vision", None)


class VisionTimer:
    """Times a vision tower's forward and backward inside the training step, without a collective or a sync
    (CPU autograd runs on the calling thread): forward from the tower's pre-hook to its forward hook;
    backward from the first gradient reaching the tower's output (after the two-phase exchange's own
    backward) to the last gradient accumulated into a tower parameter (its patch embedding, the first
    layer of the forward, comes last). A step whose rank encodes nothing counts 0 (only the zero-weight
    anchor reaches the tower's parameters then). On CUDA the times are host times (kernels are async)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.on = False
        self.reset()
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._acc)

    def reset(self) -> None:
        self.fwd_s, self.t_fwd, self.t_bwd, self.t_acc = 0.0, None, None, None

    def _pre(self, module, args) -> None:
        if self.on:
            self.t_fwd = time.perf_counter()

    def _post(self, module, args, output) -> None:
        if not self.on or self.t_fwd is None:
            return
        self.fwd_s += time.perf_counter() - self.t_fwd
        values = (
            output.values()
            if isinstance(output, dict)  # a ModelOutput; a tensor has .values() too
            else output
            if isinstance(output, (tuple, list))
            else (output,)
        )
        for t in values:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._grad)

    def _grad(self, grad: torch.Tensor) -> None:
        if self.t_bwd is None:
            self.t_bwd = time.perf_counter()

    def _acc(self, param: torch.Tensor) -> None:
        if self.on and self.t_bwd is not None:
            self.t_acc = time.perf_counter()

    def take(self) -> float:
        """The last step's vision forward + backward seconds; resets."""
        bwd = self.t_acc - self.t_bwd if self.t_bwd is not None and self.t_acc is not None else 0.0
        total = self.fwd_s + bwd
        self.reset()
        return total


def build_model(
    name: str, seed: int, max_len: int, images: bool = False, audio: bool = False
) -> torch.nn.Module:
    """The preset `name`, randomly initialised from `seed` (identical on every rank); with `images`, the
    same LM behind `TinyMLLM`'s vision encoder (its image token: the synthetic vocabulary's last id).
    `tiny-qwen2vl`: the stock HF Qwen2-VL adapted by `batchd.two_phase` (`hf_qwen2vl`), with or
    without images."""
    if name not in MODELS:
        raise ValueError(f"unknown model, expected one of {sorted(MODELS)}, got {name=}")
    if name in HF_MODELS:
        return hf_qwen2vl(seed, max_len)
    cfg = dict(MODELS[name])
    cfg["max_len"] = max(cfg["max_len"], max_len)
    torch.manual_seed(seed)
    if images:  # with `audio`, its audio encoder too (the clips' placeholder: the vocabulary's id - 2)
        heard = {"audio_token_id": SYNTHETIC_VOCAB - 2, "n_mels": SYNTHETIC_MELS} if audio else {}
        return TinyMLLM(SYNTHETIC_VOCAB - 1, patch_dim=SYNTHETIC_PATCH_DIM, **cfg, **heard)
    return TinyCausalLM(**cfg)


def view_ids(num_samples: int, rank: int, world_size: int, seed: int, epoch: int = 0) -> list[int]:
    """This rank's sampler view: the ids batchd's `SyntheticSource` (shuffle on) gives it in `epoch`."""
    return list(ViewSource(num_samples, rank, world_size, seed, epoch, shuffle=True)._view)


def fixed_batches(
    num_samples: int, rank: int, world_size: int, seed: int, batch_size: int, epoch: int = 0
) -> list[list[int]]:
    """The fixed baseline's batches: the rank's view of `epoch` cut into runs of `batch_size` ids."""
    view = view_ids(num_samples, rank, world_size, seed, epoch)
    return [view[i : i + batch_size] for i in range(0, len(view), batch_size)]


def payload(
    sample_id: int,
    lengths: list[int],
    seed: int,
    images: list[list[list[int]]] | None = None,
    audio: list[list[list[int]]] | None = None,
) -> dict[str, np.ndarray]:
    """The sample batchd's SyntheticSource serves for `sample_id` (same tokens, labels, length; with
    `images`, the same synthetic pixels; with `audio`, the same synthetic clips)."""
    return synthetic_sample(
        sample_id,
        lengths[sample_id],
        seed,
        SYNTHETIC_VOCAB,
        [tuple(im) for im in images[sample_id]] if images is not None else None,
        [tuple(c) for c in audio[sample_id]] if audio is not None else None,
    )


class SyntheticDataset(torch.utils.data.Dataset):
    """Map-style dataset of the synthetic samples, one torch dict per id (what ODB's workers load)."""

    def __init__(
        self, lengths: list[int], seed: int, images: list | None = None, audio: list | None = None
    ) -> None:
        self.lengths, self.seed, self.images, self.audio = list(lengths), seed, images, audio

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        p = payload(int(i), self.lengths, self.seed, self.images, self.audio)
        out = {
            "input_ids": torch.from_numpy(p["input_ids"].astype(np.int64)),
            "labels": torch.from_numpy(p["labels"].astype(np.int64)),
            "sample_id": int(i),
        }
        for key in VISION_KEYS + AUDIO_KEYS:
            if key in p:
                out[key] = torch.from_numpy(p[key])
        return out


ODB_PASS_KEYS = ("total_batch_size", "odb_total_tokens")  # set per sample by ODB's grouping


def odb_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The user collate handed to ODB: `collate_padded` (batchd's padded layout) + ids + ODB's metadata."""
    out: dict[str, Any] = collate_padded(
        [
            {k: s[k].numpy() for k in ("input_ids", "labels", *VISION_KEYS, *AUDIO_KEYS) if k in s}
            for s in samples
        ]
    )
    out["sample_ids"] = torch.tensor([s["sample_id"] for s in samples], dtype=torch.int64)
    for key in ODB_PASS_KEYS:
        if key in samples[0]:
            out[key] = samples[0][key]
    return out


def _device_batch(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


class _Recorder:
    """Per-step records of one rank (no collectives)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def add(
        self,
        ids: list[int],
        batch: dict[str, Any] | None,
        logits: torch.Tensor | None,
        t0: float,
        wait_s: float,
    ) -> None:
        if batch is None:
            rec = {"ids": [], "real": 0, "materialized": 0, "loss_sum": 0.0, "loss_tokens": 0}
        else:
            mask = batch.get("attention_mask")  # a packed row has none: every position is real
            real = int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())
            with torch.no_grad():
                s, n = token_loss_sum(logits.detach(), batch["labels"])
            rec = {
                "ids": ids,
                "real": real if ids else 0,
                "materialized": int(batch["input_ids"].numel()),
                "loss_sum": float(s),
                "loss_tokens": int(n),
            }
            pixels, frames = batch.get("pixel_values"), batch.get("audio_features")
            rec["patches"] = int(pixels.shape[0]) if pixels is not None else 0  # the encoder's load
            rec["frames"] = int(frames.shape[0]) if frames is not None else 0
        rec["t"] = time.monotonic() - t0
        rec["wait_s"] = wait_s
        self.steps.append(rec)


def step_lr(base_lr: float, global_tokens: int, ref_tokens: int | None, power: float = 0.5) -> float:
    """The square-root scaling rule for adaptive optimizers, the same for every system: a step that
    trains on `global_tokens` real tokens (all ranks) uses `base_lr * sqrt(global_tokens / ref_tokens)`
    (`power` 1.0: the linear rule).
    `ref_tokens` is fixed batching's mean tokens per step, so fixed batching keeps `base_lr` on average
    while token-budget batchers, whose steps carry several times more tokens, take proportionally
    larger (sqrt) steps instead of fewer steps of the same size. None: constant `base_lr`."""
    if not ref_tokens or global_tokens <= 0:
        return base_lr
    return base_lr * (global_tokens / ref_tokens) ** power


def _backward(
    ddp: torch.nn.Module, batch: dict[str, Any], scale: float | None, tokens: int, sync: bool
) -> torch.Tensor:
    """Forward, loss (x scale; None: plain per-token mean) and backward; `sync` False skips DDP's
    all-reduce (``no_sync``: a micro-step inside an optimizer update, its gradient kept locally)."""
    with nullcontext() if sync else ddp.no_sync():
        logits = forward_logits(ddp, batch)
        if scale is None:
            s, n = token_loss_sum(logits, batch["labels"])
            loss = s / n if n else logits.sum() * 0.0
        else:
            loss = scaled_loss_and_mean(logits, batch["labels"], scale, tokens)[0]
        loss.backward()
    return logits


def _update(ddp: torch.nn.Module, opt: torch.optim.Optimizer, lr: float, grad_scale: float) -> None:
    """The optimizer step at `lr`, after scaling the accumulated gradient by `grad_scale`."""
    scale_gradients(ddp, grad_scale)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()


class _Window:
    """Where this rank's optimizer updates start and end, and the gradient's factor at the end.

    batchd: the StepInfo's update fields (one update per step without ``tokens_per_update``). fixed and
    ODB with `accumulate` = K > 1: K consecutive local steps (the epoch's last step ends the open one),
    weighted so that the update's gradient is its per-token mean: fixed knows every rank's batches, so
    each step is scaled by N t_r / W for the update's global loss tokens W; ODB's exact scale (N t_r /
    T_j, input tokens) is weighted by T_j / D and the sum by D / sum T_j at the update's end."""

    D = 1e4  # any constant: the ODB steps' common denominator until the update's tokens are known

    def __init__(self, k: int) -> None:
        self.k, self.pos, self.weight = k, 0, 0.0
        self.start, self.end, self.end_scale = True, True, 1.0

    def local(self, last: bool, weight: float = 0.0) -> None:
        """A fixed / ODB micro-step: `last`, the epoch's last step of this rank (if known); `weight`,
        its ODB weight T_j (0: the scale is already over the update)."""
        self.start, self.end = self.pos == 0, self.pos == self.k - 1 or last
        self.weight = (0.0 if self.start else self.weight) + weight
        self.end_scale = self.D / self.weight if weight and self.end and self.weight else 1.0
        self.pos = 0 if self.end else self.pos + 1

    def batchd(self, info: Any) -> None:
        self.start, self.end = info.update_step == 0, info.update_end
        self.end_scale = info.update_scale if info.update_end else 1.0

    def close_open(self) -> float:
        """Ends the update the epoch left open (ODB: the stream's end is known only after it); returns
        its gradient's factor."""
        self.pos, self.end = 0, True
        return self.D / self.weight if self.weight else 1.0


def _iter_fixed(cfg: dict[str, Any], holder: dict[str, Any], epoch: int):
    lengths, seed, n, size = cfg["lengths"], cfg["seed"], cfg["world_size"], cfg["batch_size"]
    views = [fixed_batches(cfg["num_samples"], r, n, seed, size, epoch) for r in range(n)]
    k_acc, window = cfg.get("accumulate", 1), holder["window"]
    mine = views[cfg["rank"]]
    for k, ids in enumerate(mine):
        # every rank knows every view: the step's real tokens over all ranks, without a collective
        holder["global_tokens"] = sum(lengths[i] for view in views if k < len(view) for i in view[k])
        batch = collate_padded([payload(i, lengths, seed, cfg.get("images"), cfg.get("audio")) for i in ids])
        if k_acc == 1:
            yield ids, batch, None, 0
            continue
        window.local(last=k == len(mine) - 1)
        tokens = holder["loss_tokens"]
        if window.start:  # this update's steps: k .. k + K - 1 (or the epoch's end), every rank's
            total = sum(tokens[i] for view in views for b in view[k : k + k_acc] for i in b)
        local = sum(tokens[i] for i in ids)
        yield ids, batch, n * local / total if total else 0.0, local


class ViewSampler(torch.utils.data.Sampler):
    """A rank's sampler view of the epoch set by `set_epoch` (like `DistributedSampler`)."""

    def __init__(self, num_samples: int, rank: int, world_size: int, seed: int) -> None:
        self.args, self.epoch = (num_samples, rank, world_size, seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(view_ids(*self.args, self.epoch))

    def __len__(self) -> int:
        return len(view_ids(*self.args, self.epoch))


def _iter_odb(cfg: dict[str, Any], holder: dict[str, Any], epoch: int):
    import odb

    if "loader" not in holder:  # one loader, iterated once per epoch: ODB numbers its per-iteration
        workers = cfg["odb_workers"]  # gloo group by iteration, a fresh loader would reuse the first name
        sampler = ViewSampler(cfg["num_samples"], cfg["rank"], cfg["world_size"], cfg["seed"])
        loader = torch.utils.data.DataLoader(
            SyntheticDataset(cfg["lengths"], cfg["seed"], cfg.get("images"), cfg.get("audio")),
            batch_size=1,
            sampler=sampler,
            num_workers=workers,
            prefetch_factor=max(1, math.ceil(cfg["window"] / workers)),
            collate_fn=odb_collate,
        )
        odb.apply(
            loader,
            token_budget=cfg["token_budget"],
            loss_scaling="exact",
            join=True,
            buffer_size=cfg["window"],
        )
        holder["loader"], holder["sampler"] = loader, sampler
    holder["sampler"].set_epoch(epoch)
    for batch in holder["loader"]:
        holder["global_tokens"] = int(batch.get(odb.TOTAL_TOKENS_KEY, 0) or 0)
        info = odb.pop_step_info(batch, loss_scaling="exact")
        sample_ids = batch.pop("sample_ids").tolist()
        tokens = int((batch["labels"][:, 1:] != -100).sum())
        scale = float(info.loss_scale)
        if cfg.get("accumulate", 1) > 1:  # ODB's stream end is known only after it: `tail_scale`
            weight = max(holder["global_tokens"], 1)
            holder["window"].local(last=False, weight=weight)
            scale *= weight / _Window.D
        yield sample_ids, batch, scale, tokens


def _slowed(batches, step_time: float):
    """`batches`, each after `step_time` seconds: a stand-in for a real model's step (every system alike)."""
    for item in batches:
        if step_time > 0:
            time.sleep(step_time)
        yield item


def _iter_batchd(cfg: dict[str, Any], holder: dict[str, Any], epoch: int):
    if "client" not in holder:
        holder["client"] = BatchClient(cfg["service"], cfg["rank"], cfg["world_size"])
    client = holder["client"]
    client.set_epoch(epoch)
    it = iter(client)
    holder["close"] = it.close
    for batch, info in it:
        ids = batch.pop("sample_ids").tolist()
        holder["global_tokens"] = int(info.global_tokens)
        holder["window"].batchd(info)
        if info.is_idle and batch.get("vision_send_splits") is None:
            yield [], None, 0.0, 0
        elif info.is_idle:  # two-phase: an IDLE rank may still encode images, and joins the exchange
            yield [], batch, 0.0, 0
        else:
            yield ids, batch, float(info.loss_scale), int(info.local_loss_tokens)


def evaluate(model: torch.nn.Module, cfg: dict[str, Any], device: torch.device) -> dict[str, Any] | None:
    """Per-token loss of `model` on the held-out samples (padded batches under the token budget)."""
    ids = cfg.get("heldout_ids") or []
    if not ids:
        return None
    lengths, seed, token_budget = cfg["all_lengths"], cfg["seed"], cfg["token_budget"]
    order = sorted(ids, key=lambda i: lengths[i])
    total, count, group = 0.0, 0, []
    model.eval()
    with torch.no_grad():

        def flush(g):
            nonlocal total, count
            batch = _device_batch(
                collate_padded([payload(i, lengths, seed, cfg.get("images"), cfg.get("audio")) for i in g]),
                device,
            )
            if cfg.get("model") in HF_MODELS:
                batch = hf_pixels(batch)
            s, n = token_loss_sum(forward_logits(model, batch).float(), batch["labels"])
            total += float(s)
            count += n

        for i in order:
            if group and (len(group) + 1) * lengths[i] > token_budget:
                flush(group)
                group = []
            group.append(i)
        if group:
            flush(group)
    model.train()
    return {"samples": len(ids), "tokens": count, "loss": total / count if count else float("nan")}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Trains `cfg["epochs"]` epochs on this rank (module docstring); writes and returns the result."""
    rank, world_size, system = cfg["rank"], cfg["world_size"], cfg["system"]
    torch.set_num_threads(cfg.get("threads", 1))
    cuda = cfg.get("device", "cpu") == "cuda"
    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    t_proc = time.monotonic()
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['master_port']}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=cfg.get("gloo_timeout_s", 600)),
    )
    images, audio = bool(cfg.get("images")), bool(cfg.get("audio"))
    model = build_model(cfg["model"], cfg["seed"], max(cfg["all_lengths"]) + 1, images, audio).to(device)
    hf = cfg["model"] in HF_MODELS
    tower = vision_module(model)
    timer = VisionTimer(tower) if tower is not None and images else None
    heard = VisionTimer(model.audio) if audio and getattr(model, "audio", None) is not None else None
    if cuda:
        model = model.to(torch.bfloat16)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    base_lr, ref_tokens = cfg.get("lr", 1e-3), cfg.get("lr_ref_tokens")
    opt = torch.optim.AdamW(model.parameters(), lr=base_lr)
    holder: dict[str, Any] = {"window": _Window(cfg.get("accumulate", 1))}
    if system == "fixed" and cfg.get("accumulate", 1) > 1:  # fixed knows every rank's batches
        holder["loss_tokens"] = {
            i: loss_tokens(
                payload(i, cfg["lengths"], cfg["seed"], cfg.get("images"), cfg.get("audio"))["labels"]
            )
            for i in range(cfg["num_samples"])
        }
    window, update_tokens = holder["window"], 0
    updates: list[int] = []  # per optimizer update: its global real tokens
    iters = {"fixed": _iter_fixed, "odb-0.1.2": _iter_odb}
    if system not in iters and not system.startswith("batchd"):
        raise ValueError(f"unknown system, expected fixed, odb-0.1.2 or batchd-*, got {system=}")
    epoch_batches = iters.get(system, _iter_batchd)
    epochs = cfg.get("epochs", 1)
    rec = _Recorder()
    ticker = StepTicker(cfg["out"])  # `batchd bench`'s progress: this rank's samples and steps so far
    # ODB's join mode and a fixed view that does not split evenly end ranks on different step counts:
    # torch's Join shadows the finished rank's all-reduces (ODB's README pairs join=True with it), one
    # Join per epoch so that the per-epoch evaluation's barriers meet.
    uneven = system == "odb-0.1.2" or (
        system == "fixed" and cfg["num_samples"] % (world_size * cfg["batch_size"])
    )
    step_time = float(cfg.get("step_time", 0.0))
    batches = _slowed(epoch_batches(cfg, holder, 0), step_time)
    first = next(batches, None)  # start-up: the pipeline's first batch, outside the clock
    dist.barrier()
    t0 = time.monotonic()
    cpu0 = time.process_time()
    startup_s = t0 - t_proc
    evals: list[dict[str, Any]] = []
    try:
        for epoch in range(epochs):
            if epoch:
                batches = _slowed(epoch_batches(cfg, holder, epoch), step_time)
                t_wait = time.monotonic()
                first = next(batches, None)
                holder["wait"] = time.monotonic() - t_wait
            with torch.distributed.algorithms.Join([ddp]) if uneven else nullcontext():
                item = first
                while item is not None:
                    ids, batch, scale, tokens = item
                    wait_s = 0.0 if item is first and not epoch else holder.get("wait", 0.0)
                    if window.start:
                        opt.zero_grad(set_to_none=True)
                        update_tokens = 0
                    update_tokens += holder.get("global_tokens", 0)
                    lr = step_lr(base_lr, update_tokens, ref_tokens, cfg.get("lr_power", 0.5))
                    # ODB: every micro-step all-reduces (no no_sync beside its Join); the others only
                    # at an update's last step
                    sync = window.end or system == "odb-0.1.2"
                    if batch is None:  # batchd IDLE step: zero-weight forward/backward keeps DDP aligned
                        _backward(ddp, _device_batch(idle_batch(), device), 0.0, 0, sync)
                        rec.add([], None, None, t0, wait_s)
                    else:
                        batch = _device_batch(batch, device)
                        if hf:
                            batch = hf_pixels(batch)
                        for t in (timer, heard):
                            if t is not None:
                                t.on = True
                        logits = _backward(ddp, batch, scale, tokens, sync)
                        for t in (timer, heard):
                            if t is not None:
                                t.on = False
                        rec.add(ids, batch, logits, t0, wait_s)
                        if timer is not None:
                            rec.steps[-1]["vision_s"] = timer.take()
                        if heard is not None:
                            rec.steps[-1]["audio_s"] = heard.take()
                    if window.end:
                        _update(ddp, opt, lr, window.end_scale)
                        updates.append(update_tokens)
                        rec.steps[-1]["update_end"] = True
                        rec.steps[-1]["t"] = time.monotonic() - t0  # the step ends with its update
                    ticker.tick(len(ids))
                    rec.steps[-1]["lr"] = lr
                    rec.steps[-1]["global_tokens"] = holder.get("global_tokens", 0)
                    rec.steps[-1]["epoch"] = epoch
                    t_wait = time.monotonic()
                    item = next(batches, None)
                    holder["wait"] = time.monotonic() - t_wait
                if not window.end:  # ODB with accumulation: the epoch left an update open
                    _update(ddp, opt, lr, window.close_open())
                    updates.append(update_tokens)
                    rec.steps[-1]["t"] = time.monotonic() - t0
            if cuda:
                torch.cuda.synchronize()
            # held-out loss after every epoch, outside the clock: every rank's t0 moves by the same span, from
            # the moment all ranks finished the epoch to the end of the evaluation
            dist.barrier()
            t_pause = time.monotonic()
            ev = evaluate(ddp.module, cfg, device) if rank == 0 else None
            dist.barrier()
            evals.append({"epoch": epoch, "t": t_pause - t0, "eval": ev})
            t0 += time.monotonic() - t_pause
        ticker.write()
        wall_s = rec.steps[-1]["t"] if rec.steps else 0.0
        cpu_s = time.process_time() - cpu0
        result = {
            "rank": rank,
            "system": system,
            "wall_s": wall_s,
            "startup_s": startup_s,
            "cpu_s": cpu_s,
            "steps": rec.steps,
            "eval": evals[-1]["eval"] if evals else None,
            "epoch_evals": evals,
            "params": model.num_parameters(),
            "updates": updates,
        }
        Path(cfg["out"]).write_text(json.dumps(result))
        return result
    finally:
        if "close" in holder:
            holder["close"]()
        if "client" in holder:
            holder["client"].close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="batchd bench trainer (one rank; started by `batchd bench`)")
    p.add_argument("--config", required=True, help="JSON file with the rank's configuration")
    args = p.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text())
    run(cfg)


if __name__ == "__main__":
    main()
