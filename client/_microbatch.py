"""Pipeline-parallel steps: M microbatches of balanced cost per pipeline step, the loss exact over it.

Two ways, by what the job's token budget L means:

* **L is one microbatch's budget** (`pipeline_steps`, the better balanced): a pipeline step is M
  consecutive batchd steps. The balanced policy makes every batchd step cost about L on every rank, so
  the M microbatches cost alike (docs/benchmarks.md, "Pipeline microbatches"). Each step's
  ``loss_scale`` is reweighted by T_j / (T_1 + ... + T_M), its share of the pipeline step's global loss
  tokens, so the update is the per-token mean over the whole pipeline step on all ranks; the epoch's
  last pipeline step is filled with zero-weight IDLE steps, so every rank runs M microbatches.

      for window in pipeline_steps(client, m=4):          # [(batch, info)] * 4
          for micro, mi in window:
              scaled_loss(forward_logits(model, micro), micro["labels"], mi.loss_scale,
                          mi.local_loss_tokens).backward()
          optimizer.step(); optimizer.zero_grad()         # checkpoint here: the client read the window

* **L is the whole step's budget** (`microbatches`): one batchd step split into M parts:

    for batch, info in client:
        parts = microbatches(batch, info, m=4)             # [(micro_batch, micro_info)] * 4
        for micro, mi in parts:                            # or hand them to the pipeline schedule
            logits = forward_logits(model, micro)
            scaled_loss(logits, micro["labels"], mi.loss_scale, mi.local_loss_tokens).backward()

The samples of the step are split by `batchd.core.balanced_split` on their cost (`CostModel.item`:
by default the attention-aware len + len^2 / q), not by count, and each part is collated again in the
batch's own layout (a padded part re-padded to its own longest sample; a packed part one row with its
own `cu_seqlens`). Each part's `StepInfo` keeps the step's global totals and carries the part's
own sample, token and loss-token counts, with ``loss_scale = step scale x t_m / t_r``: a part's
`scaled_loss` is its summed token loss x (step scale / t_r), so the parts' losses (and gradients) add up
to exactly the step's, whatever the split. A part without samples (a step with fewer samples than
parts, or an IDLE step) is a 1-token `idle_batch` of zero weight, so every pipeline stage still runs
M microbatches. Batches carrying images (``pixel_values``) are refused: their vision inputs are not
split per part here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from batchd import core
from batchd.core import CostModel, StepInfo

from ._accelerate import accumulation_windows
from ._collate import to_torch

__all__ = ["microbatches", "pipeline_steps"]


def pipeline_steps(steps: Iterable[tuple[Any, StepInfo]], m: int) -> Iterator[list[tuple[Any, StepInfo]]]:
    """Pipeline steps of `m` consecutive batchd steps (a `BatchClient` or any (batch, StepInfo) stream),
    their loss scales reweighted over the pipeline step (module docstring). All ranks agree on the
    boundaries when they start at the same step: resume from a checkpoint taken after a pipeline step."""
    core.check_int("m", m, lo=1)
    return accumulation_windows(steps, m)


def _samples(batch: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
    """The per-sample arrays of a collated batch (input_ids, labels and the per-token keys)."""
    keys = ["input_ids", "labels", *[k for k in core.TOKEN_KEYS if k in batch]]
    arrays = {
        k: batch[k].numpy() if isinstance(batch[k], torch.Tensor) else np.asarray(batch[k]) for k in keys
    }
    if "cu_seqlens" in batch:
        cu = np.asarray(batch["cu_seqlens"]).tolist()
        return [{k: a[0, cu[i] : cu[i + 1]] for k, a in arrays.items()} for i in range(len(cu) - 1)]
    mask = np.asarray(batch["attention_mask"])
    return [{k: a[row, : int(mask[row].sum())] for k, a in arrays.items()} for row in range(mask.shape[0])]


def microbatches(
    batch: Mapping[str, Any], info: StepInfo, m: int, cost: CostModel | str = "attention", pad_id: int = 0
) -> list[tuple[dict[str, Any], StepInfo]]:
    """Splits a step (as `BatchClient` yields it) into `m` microbatches of balanced cost.

    Args:
        batch: The step's batch, padded or packed (with ``sample_ids``).
        info: Its `StepInfo`.
        m: Microbatches per step (the pipeline schedule's count).
        cost: The per-sample cost the split balances (a `CostModel` or its name; ``attention`` uses q=4096).
        pad_id: Token id of the padding of padded parts and of empty parts' dummy token.

    Returns:
        `m` (micro_batch, micro_info) pairs (see module docstring); each micro_batch carries its
        ``sample_ids``.

    Raises:
        ValueError: on `m` < 1, a batch with images, or labels whose loss tokens disagree with `info`.
    """
    core.check_int("m", m, lo=1)
    model = cost if isinstance(cost, CostModel) else CostModel(cost)
    if any(k in batch for k in core.VISION_KEYS):
        raise ValueError(
            f"microbatches: the batch carries images ({sorted(k for k in core.VISION_KEYS if k in batch)}); "
            f"splitting vision inputs per microbatch is not supported"
        )
    packed = "cu_seqlens" in batch
    samples = [] if info.is_idle else _samples(batch)
    ids = [] if info.is_idle else [int(i) for i in batch["sample_ids"]]
    tokens = [core.loss_tokens(s["labels"]) for s in samples]
    if sum(tokens) != info.local_loss_tokens and not info.is_idle:
        raise ValueError(
            f"microbatches: the labels carry {sum(tokens)} loss tokens, but "
            f"{info.local_loss_tokens=}: the loss scale would be wrong"
        )
    parts = core.balanced_split([model.item(len(s["input_ids"])) for s in samples], m)
    out = []
    for part in parts:
        if not part:
            micro = to_torch(core.idle_batch(pad_id))
            micro["sample_ids"] = torch.zeros(0, dtype=torch.int64)
            out.append(
                (
                    micro,
                    dataclasses.replace(
                        info,
                        is_idle=True,
                        local_samples=0,
                        local_tokens=0,
                        local_loss_tokens=0,
                        loss_scale=0.0,
                        cost=0.0,
                    ),
                )
            )
            continue
        chosen = [samples[i] for i in part]
        arrays = core.collate_packed(chosen) if packed else core.collate_padded(chosen, pad_id)
        micro = to_torch(arrays)
        micro["sample_ids"] = torch.tensor([ids[i] for i in part], dtype=torch.int64)
        t_m = sum(tokens[i] for i in part)
        scale = info.loss_scale * t_m / info.local_loss_tokens if info.local_loss_tokens else 0.0
        lengths = [len(s["input_ids"]) for s in chosen]
        out.append(
            (
                micro,
                dataclasses.replace(
                    info,
                    local_samples=len(part),
                    local_tokens=sum(lengths),
                    local_loss_tokens=t_m,
                    loss_scale=scale,
                    cost=model.cost(lengths),
                ),
            )
        )
    return out
