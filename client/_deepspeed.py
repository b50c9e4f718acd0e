"""batchd with DeepSpeed (ZeRO stages 0-3): the step's forward, scaled loss and ``engine.backward``.

DeepSpeed's data-parallel reduction averages the N ranks' gradients, as DDP does, so batchd's
``StepInfo.loss_scale`` (N t_r / T_tok) composes unchanged: the update is the gradient of the step's
per-token mean over every rank's tokens. ``engine.backward`` also divides the loss by the engine's
``gradient_accumulation_steps``; batchd's steps are already variable-size token-budget batches, so the
engine must run with ``gradient_accumulation_steps = 1`` (`batchd_deepspeed_backward` refuses another
value)::

    import deepspeed
    from batchd.client import BatchClient, batchd_deepspeed_backward, weighted_steps

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2}})
    for batch, info in weighted_steps(BatchClient(address, rank, world_size)):
        batchd_deepspeed_backward(engine, batch, info)   # IDLE: a zero-weight dummy step, still reduced
        engine.step()                                    # steps the optimizer at an update's end only

Optimizer updates of several steps (the job's ``tokens_per_update``): ZeRO keeps the gradient
partitioned inside its optimizer, so it cannot be rescaled after the update's last backward as
`train_step` does. `weighted_steps` instead reads each update ahead and weighs every step's loss over
the whole update (N t_rj / W); `batchd_deepspeed_backward` sets the engine's gradient accumulation
boundary to ``info.update_end``, so ``engine.step()`` steps the optimizer (and its scheduler) once
per update and the reduced gradient is the update's per-token mean. A stream not read through
`weighted_steps` is refused at its first update's last step, before any optimizer step.

The model is called as `train_step` calls it (`forward_logits`). An IDLE rank runs the 1-token dummy
batch with the loss ``logits.sum() * 0``: its gradient hooks fire, so ZeRO's reduce-scatters (and
ZeRO-3's parameter all-gathers) see every rank. This module imports no deepspeed: the engine is used
through ``gradient_accumulation_steps()``, ``set_gradient_accumulation_boundary``, ``device`` (else its
first parameter's), ``backward`` and ``module``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._train import check_weighted, step_loss


def batchd_deepspeed_backward(engine: Any, batch: Mapping[str, Any] | None, info: Any) -> float:
    """One rank's step up to the update: forward, scaled loss, ``engine.backward`` (then ``engine.step()``,
    which steps the optimizer at the update's end).

    Args:
        engine: A ``deepspeed.DeepSpeedEngine`` with ``gradient_accumulation_steps() == 1``.
        batch: A `collate_padded` / `collate_packed` batch; ignored (may be None) on IDLE steps.
        info: The rank's `batchd.core.StepInfo`.

    Returns:
        The unscaled local per-token mean loss (nan for IDLE or loss-free steps), like `train_step`.

    Raises:
        ValueError: a gradient accumulation other than 1, the last step of an update whose steps were
            not weighted over it (read the stream through `weighted_steps`), a non-IDLE step without a
            batch, or labels that disagree with ``info.local_loss_tokens``.
    """
    steps = engine.gradient_accumulation_steps()
    if steps != 1:
        raise ValueError(
            f"batchd steps need a DeepSpeed engine with gradient_accumulation_steps = 1 (each step is "
            f"one token-budget batch; engine.backward would divide its loss scale by {steps}), "
            f"got {steps=}"
        )
    check_weighted(info, "batchd_deepspeed_backward")
    engine.set_gradient_accumulation_boundary(bool(info.update_end))  # inside an update it accumulates
    device = getattr(engine, "device", None)
    device = torch.device(device) if device is not None else next(engine.module.parameters()).device
    loss, mean = step_loss(engine, batch, info, device)
    engine.backward(loss)
    return mean
