"""The bench trainer's data paths (`batchd._train.bench`): each system's batches of one rank and epoch.

`iter_fixed`, `iter_odb` and `iter_batchd` yield `(ids, batch, loss scale, local loss tokens)` per step
(a batchd IDLE step: no ids, batch None unless it joins a two-phase exchange); they keep what lasts across
epochs (ODB's loader, batchd's client) and each step's global real tokens in `holder`. `Window` says where
an optimizer update starts and ends. Every system trains on the samples batchd's `SyntheticSource` serves
(`payload`), over the same seeded views (`view_ids`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from batchd.client import BatchClient, collate_padded
from batchd.core import AUDIO_KEYS, VISION_KEYS, ViewSource
from batchd.service.preprocess import synthetic_sample

from .models import SYNTHETIC_VOCAB


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


class Window:
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


def iter_fixed(cfg: dict[str, Any], holder: dict[str, Any], epoch: int):
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


def iter_odb(cfg: dict[str, Any], holder: dict[str, Any], epoch: int):
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
            scale *= weight / Window.D
        yield sample_ids, batch, scale, tokens


def slowed(batches, step_time: float):
    """`batches`, each after `step_time` seconds: a stand-in for a real model's step (every system alike)."""
    for item in batches:
        if step_time > 0:
            time.sleep(step_time)
        yield item


def iter_batchd(cfg: dict[str, Any], holder: dict[str, Any], epoch: int):
    if "client" not in holder:
        holder["client"] = BatchClient(cfg["service"], cfg["rank"], cfg["world_size"])
    client = holder["client"]
    client.set_epoch(epoch)
    it = iter(client)
    holder["close"] = it.close
    for batch, info in it:
        ids = batch.pop("sample_ids").tolist()
        holder["global_tokens"] = int(info.global_tokens)
        holder["cost"] = float(info.cost)  # the step's planned cost (the bench's cost check)
        holder["window"].batchd(info)
        if info.is_idle and batch.get("vision_send_splits") is None:
            yield [], None, 0.0, 0
        elif info.is_idle:  # two-phase: an IDLE rank may still encode images, and joins the exchange
            yield [], batch, 0.0, 0
        else:
            yield ids, batch, float(info.loss_scale), int(info.local_loss_tokens)
