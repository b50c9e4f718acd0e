"""Trainer-side step logic: token-level loss, batchd's loss scale, and IDLE steps under DDP.

Every rank r of a step holds a different number of loss-bearing tokens t_r. The trainer computes its
per-token mean m_r = S_r / t_r and multiplies it by batchd's ``StepInfo.loss_scale`` = N t_r / T_tok
(`batchd.core.loss_scale`); DDP averages the N gradients, so the update is the gradient of
S / T_tok, the per-token mean over the whole step's tokens, exactly as a single process that saw
every sample of the step would compute it. Two conditions make it exact:

* t_r is the number of tokens the loss really averages over: ``Sample.loss_tokens`` must equal
  `batchd.client.loss_tokens` of the sample's labels (shifted causal LM: labels[1:] != -100).
  `scaled_loss` checks the collated labels against ``local_loss_tokens`` and raises on a mismatch
  (a data bug: the raising rank skips its backward, so the others wait in the all-reduce until the
  process group's timeout; silently wrong gradients would be worse).
* every rank joins every all-reduce. An IDLE rank (no samples this step, scale 0) still runs a
  forward/backward, on a 1-token dummy batch (`idle_batch`) with the loss ``logits.sum() * 0.0``:
  the graph reaches every parameter, so DDP's gradient hooks fire and its buckets all-reduce zeros.
  A rank whose samples carry no loss tokens at all does the same on its real batch.

The trade-off of the zero-weight step: an IDLE rank spends one 1-token forward/backward per step
instead of skipping it, which needs neither ``find_unused_parameters`` nor the ``Join`` context
manager. The loss is accumulated in at least fp32 (fp64 stays fp64) whatever the activation dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ._collate import IGNORE_INDEX, idle_batch
from ._vlm import check_model_batch


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The summed shifted cross-entropy over labels != -100, and how many tokens it sums.

    Logits at position t predict labels at t + 1 (within each row; packed rows are safe because
    every sample's first label is -100).

    Args:
        logits: [B, T, V] (any float dtype; the loss is computed in at least fp32).
        labels: [B, T] int64, -100 = no loss.

    Returns:
        (loss_sum, n_tokens): a scalar tensor connected to `logits`, and a Python int.

    Raises:
        ValueError: if the shapes do not line up.
    """
    if logits.ndim != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, V] and labels [B, T], got {tuple(logits.shape)=} {tuple(labels.shape)=}"
        )
    dtype = torch.promote_types(logits.dtype, torch.float32)
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1]).to(dtype)
    targets = labels[:, 1:].reshape(-1)
    loss_sum = F.cross_entropy(shifted, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, int((targets != IGNORE_INDEX).sum().item())


def scaled_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_scale: float, local_loss_tokens: int
) -> torch.Tensor:
    """This rank's per-token mean loss times batchd's loss scale (the tensor to backward).

    Args:
        logits: [B, T, V] from the DDP-wrapped model.
        labels: [B, T], -100 = no loss.
        loss_scale: ``StepInfo.loss_scale`` (N t_r / T_tok).
        local_loss_tokens: ``StepInfo.local_loss_tokens`` (t_r); 0 gives a zero-weight loss that is
            still connected to every parameter, so DDP's all-reduce fires.

    Raises:
        ValueError: on a negative or non-finite scale, a negative token count, or when the labels
            carry a different number of loss tokens than `local_loss_tokens` (the scale would be wrong).
    """
    _check_scale(loss_scale, local_loss_tokens)
    return scaled_loss_and_mean(logits, labels, loss_scale, local_loss_tokens)[0]


def _check_scale(loss_scale: float, local_loss_tokens: int) -> None:
    if not isinstance(loss_scale, (int, float)) or not math.isfinite(loss_scale) or loss_scale < 0:
        raise ValueError(f"loss_scale must be a finite number >= 0, got {loss_scale=}")
    if isinstance(local_loss_tokens, bool) or not isinstance(local_loss_tokens, int) or local_loss_tokens < 0:
        raise ValueError(f"local_loss_tokens must be a non-negative int, got {local_loss_tokens=}")


def scaled_loss_and_mean(
    logits: torch.Tensor, labels: torch.Tensor, loss_scale: float, local_loss_tokens: int
) -> tuple[torch.Tensor, float]:
    """`scaled_loss`, and the unscaled local per-token mean for logging (nan without loss tokens)."""
    _check_scale(loss_scale, local_loss_tokens)
    if local_loss_tokens == 0:
        return logits.sum() * 0.0, math.nan
    loss_sum, n_tokens = token_loss_sum(logits, labels)
    if n_tokens != local_loss_tokens:
        raise ValueError(
            f"labels carry {n_tokens=} loss tokens but {local_loss_tokens=}: set Sample."
            f"loss_tokens to batchd.client.loss_tokens(labels) so the loss scale is exact"
        )
    mean = loss_sum / local_loss_tokens
    return mean * loss_scale, float(mean.detach())


def _to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def step_batch(batch: Mapping[str, Any] | None, info: Any) -> Mapping[str, Any]:
    """The batch a rank trains on this step: its own; on an IDLE step a 1-token dummy (`idle_batch`), unless
    the batch carries a two-phase exchange (``vision_send_splits``): an IDLE rank may still encode other
    ranks' images, and every rank must join the step's all-to-all, so it keeps that batch (its text part
    is already the dummy).

    Raises:
        ValueError: a non-IDLE step without a batch.
    """
    if batch is not None and batch.get("vision_send_splits") is not None:
        return batch
    if info.is_idle:
        return idle_batch()
    if batch is None:
        raise ValueError(
            f"a non-IDLE step needs a batch, got batch=None for step {info.step} on rank {info.rank}"
        )
    return batch


def forward_logits(model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """`model`'s logits for a collated batch: `cu_seqlens` goes along for a packed row (varlen attention).

    A model (or the module a DDP wrapper holds) whose ``takes_batch`` attribute is true, a multimodal model
    such as `batchd.TinyMLLM` or a stock HF one adapted by `batchd.client.two_phase`, is called with the whole
    batch (pixels, grids, the two-phase exchange); its output is the logits or a ModelOutput carrying them.
    A stock HF multimodal model not adapted, a two-phase batch for a model without the exchange and a packed
    row on an attention that crosses samples raise ValueError (`batchd.client.check_model_batch`)."""
    check_model_batch(model, batch)
    if getattr(getattr(model, "module", model), "takes_batch", False):
        out = model(batch)
        logits: torch.Tensor = out if isinstance(out, torch.Tensor) else out["logits"]
        return logits
    if batch.get("cu_seqlens") is not None:  # a packed row: varlen attention
        logits = model(
            batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"),
            cu_seqlens=batch["cu_seqlens"],
        )
        return logits
    logits = model(
        batch["input_ids"], attention_mask=batch.get("attention_mask"), position_ids=batch.get("position_ids")
    )
    return logits


def train_step(
    ddp_model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, Any] | None,
    info: Any,
    scheduler: Any = None,
) -> float:
    """One step of one rank: forward, scaled loss, backward; at the end of an optimizer update, the
    update (the gradient times ``info.update_scale``, then `optimizer` and `scheduler` step).

    Without ``tokens_per_update`` every step is an update, as before. With it, a step inside an update
    accumulates its gradient: gradients are zeroed at the update's first step (``update_step == 0``),
    DDP's ``no_sync`` (FSDP2's ``set_requires_gradient_sync(False)``) skips the all-reduce until the
    update's last step, and only then does the optimizer step, so there is one gradient all-reduce
    and one learning-rate step per update. The gradient it steps with is the per-token mean over
    every sample of the update on every rank (`batchd.core._updates`).

    Args:
        ddp_model: The (DDP-wrapped or FSDP2-sharded) model; called as ``model(input_ids,
            attention_mask=..., position_ids=...)``.
        optimizer: Its optimizer; gradients are zeroed before an update's first backward and kept
            after the update.
        batch: A `collate_padded` / `collate_packed` batch; ignored (may be None) on IDLE steps.
        info: The rank's `batchd.core.StepInfo` (uses ``is_idle``, ``loss_scale``,
            ``local_loss_tokens`` and the ``update_*`` fields).
        scheduler: A learning-rate scheduler stepped once per update (None: none).

    Returns:
        The unscaled local per-token mean loss (nan for IDLE or loss-free steps).

    Raises:
        ValueError: if a non-IDLE step has no batch, or the labels disagree with ``local_loss_tokens``.
    """
    if info.update_step == 0:
        optimizer.zero_grad(set_to_none=True)
    with accumulating(ddp_model, info):
        loss, mean = step_loss(ddp_model, batch, info, next(ddp_model.parameters()).device)
        loss.backward()  # type: ignore[no-untyped-call]  # torch declares Tensor.backward untyped
    if info.update_end:
        apply_update_scale(ddp_model, info)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return mean


@contextlib.contextmanager
def accumulating(model: Any, info: Any) -> Iterator[None]:
    """Inside an optimizer update (not its last step), the context that skips the gradient all-reduce:
    DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``; elsewhere (the update's last
    step, a model of neither kind) nothing. Gradients accumulate locally and the update's last
    backward all-reduces their sum, which equals all-reducing each step's."""
    if info.update_end:
        yield
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def check_one_step_update(info: Any, where: str) -> None:
    """Raises ValueError when `info` is a step of an optimizer update of several steps
    (``tokens_per_update`` / ``samples_per_update``) and `where` (an integration that steps the
    optimizer itself after every step) cannot take one: its gradients would be stepped with a scale
    meant for the whole update. Every step of a job without those settings passes."""
    if info.update_step != 0 or not info.update_end:
        raise ValueError(
            f"{where} does not take optimizer updates of several steps (the job's tokens_per_update / "
            "samples_per_update) yet: use batchd.train_step, or the loop of "
            "docs/restarts-and-elastic.md#optimizer-updates-of-a-fixed-token-count; "
            f"got step {info.step} inside update {info.update}"
        )


def optimizer_updates(steps: Iterable[tuple[Any, Any]]) -> Generator[list[tuple[Any, Any]], None, None]:
    """Groups a rank's (batch, StepInfo) stream into its optimizer updates, each weighted over itself
    (`weigh_update`): each list holds the steps of one update, the last with ``update_end``.

    That is what an integration needs whose gradients it cannot rescale after the backward (DeepSpeed's
    ZeRO partitions them inside its optimizer) or that reads an update ahead anyway (HF Trainer's
    ``get_batch_samples``). Without ``tokens_per_update`` every update is one step and nothing changes.
    The cost: one update's batches are held in memory before its first step trains (the rank service
    keeps producing meanwhile). Closing the generator closes `steps` when it can be closed.

    Raises:
        RuntimeError: when `steps` ends inside an update (`next_update`).
    """
    it = iter(steps)
    try:
        while update := next_update(it):
            yield weigh_update(update)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def next_update(steps: Iterator[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """The (batch, StepInfo) pairs read from `steps` through the next update's end, as they are; [] when
    `steps` is exhausted between updates. `steps` is left open.

    Raises:
        RuntimeError: when `steps` ends inside an update (a stream cut short: the epoch's last step always
            ends one), naming the update and step.
    """
    update = []
    for batch, info in steps:
        update.append((batch, info))
        if info.update_end:
            return update
    if update:
        last = update[-1][1]
        raise RuntimeError(
            f"the stream ended inside update {last.update} (at step {last.step}, its step "
            f"{last.update_step}): no update end arrived, so the update's weights are unknown"
        )
    return update


def weigh_update(update: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """One update's steps with every StepInfo's ``loss_scale`` multiplied by the update's
    ``update_scale`` (known at its last step) and ``update_scale`` set to 1.0: step j's loss then weighs
    N t_rj / W, its share of the whole update's W loss tokens, so each backward adds its part of the
    update's per-token-mean gradient and nothing rescales the gradient afterwards (``train_step`` on
    these steps scales by 1.0)."""
    if not update or not update[-1][1].update_end:
        raise ValueError(
            f"weigh_update needs one whole update, ending with update_end, got {len(update)} steps"
        )
    scale = float(update[-1][1].update_scale)
    if scale == 1.0:
        return list(update)
    return [(b, dataclasses.replace(i, loss_scale=i.loss_scale * scale, update_scale=1.0)) for b, i in update]


def weighted_steps(steps: Iterable[tuple[Any, Any]]) -> Generator[tuple[Any, Any], None, None]:
    """`optimizer_updates` flattened: the stream's steps in order, each weighted over its update (read
    an update ahead). Loops that take one step at a time (``batchd_deepspeed_backward``) read this."""
    updates = optimizer_updates(steps)
    try:
        for update in updates:
            yield from update
    finally:
        updates.close()


def check_weighted(info: Any, where: str) -> None:
    """Raises ValueError when `info` ends an optimizer update whose steps were not weighted over it
    (``update_scale`` != 1.0: the stream was not read through `optimizer_updates` / `weighted_steps`)
    and `where` cannot rescale the gradient after the backward. Checked before the update's last
    backward, so no optimizer step has used the wrong weights."""
    if info.update_end and info.update_scale != 1.0:
        raise ValueError(
            f"{where} needs each step weighted over its whole optimizer update (the job's "
            f"tokens_per_update / samples_per_update): read the stream through "
            f"batchd.client.weighted_steps(client); got update {info.update} ending at step "
            f"{info.step} with update_scale={info.update_scale}"
        )


def apply_update_scale(model: Any, info: Any) -> None:
    """At an update's last step: multiplies every gradient by ``info.update_scale`` (D / W, so that the
    accumulated gradient is the per-token mean over the update; 1.0 without ``tokens_per_update``,
    where this does nothing). Call it after the last backward, before clipping and the optimizer."""
    scale_gradients(model, float(info.update_scale))


def scale_gradients(model: Any, scale: float) -> None:
    """Multiplies every gradient of `model` by `scale` in place (1.0: nothing to do). Raises
    ValueError on a negative or non-finite scale."""
    if scale == 1.0:
        return
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"update_scale must be a finite number >= 0, got {scale=}")
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale)


def step_loss(
    model: Any, batch: Mapping[str, Any] | None, info: Any, device: torch.device
) -> tuple[torch.Tensor, float]:
    """The step's forward on `device` and its scaled loss: (the tensor to backward, the unscaled local
    per-token mean), as `train_step` computes them; IDLE steps run the zero-weight dummy batch."""
    scale, tokens = (0.0, 0) if info.is_idle else (info.loss_scale, info.local_loss_tokens)
    _check_scale(scale, tokens)
    batch = _to_device(step_batch(batch, info), device)
    logits = forward_logits(model, batch)
    return scaled_loss_and_mean(logits, batch["labels"], scale, tokens)
