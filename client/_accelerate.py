"""batchd with Hugging Face Accelerate, and the pieces the HF Trainer integration shares.

Every rank already reads its own aligned stream from its own rank service, so the stream must
**never** go through ``accelerator.prepare`` (that would shard it a second time and drop batches);
only the model and the optimizer do. `batchd_batches` moves each batch to ``accelerator.device``;
`batchd_loss` turns the model output into the tensor to backward: this rank's per-token mean loss
times ``StepInfo.loss_scale`` (N t_r / T_tok), so DDP's gradient average over the N ranks is the
gradient of the global per-token mean, and IDLE steps become zero-weight steps (a 1-token dummy batch,
loss ``logits.sum() * 0``) that still join every all-reduce::

    from accelerate import Accelerator
    from batchd.client import BatchClient, batchd_backward, batchd_batches

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)          # not the stream
    client = BatchClient(address, accelerator.process_index, accelerator.num_processes)
    for batch, info in batchd_batches(accelerator, client):           # same step count on every rank
        optimizer.zero_grad()
        batchd_backward(accelerator, model, batch, info)              # forward, scaled loss, backward
        optimizer.step()
    # accelerator.reduce(loss.detach(), "mean") of batchd_loss is the global per-token mean loss

The loss is computed from the logits (`batchd.client.token_loss_sum`: shifted cross-entropy summed
over labels != -100, in at least fp32), not taken from the model: a model's own loss is a per-batch
mean (or a sum over ``num_items_in_batch``) and would have to be rescaled anyway, while computing it
here lets `batchd_loss` check the labels against ``StepInfo.local_loss_tokens``. The model is called
the Hugging Face way, ``model(**hf_model_inputs(batch))``: ``labels`` stay out (the model does not
compute a second loss), ``use_cache=False`` always. That flag matters for the packed layout: an HF
model derives the block-diagonal mask of packed samples from the restarting ``position_ids`` only
when no cache is in use; with the default ``use_cache=True`` the packed samples attend to each other
silently.

Optimizer updates of a fixed token count (the job's ``tokens_per_update``): keep
``gradient_accumulation_steps`` = 1 and step where batchd ends an update::

    for batch, info in batchd_batches(accelerator, client):          # each step weighed over its update
        with batchd_accumulate(accelerator, model, info):             # no all-reduce inside an update
            batchd_backward(accelerator, model, batch, info)
        if info.update_end:                                           # once per update
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

`batchd_batches` reads each update ahead (`batchd.client.weighted_steps`): every step's loss scale
weighs its share of the update's loss tokens, so the accumulated gradient is the update's per-token
mean with no rescaling afterwards, under DDP, FSDP and DeepSpeed alike (`batchd_accumulate` sets
Accelerate's ``sync_gradients`` to the update's end, which is also DeepSpeed's accumulation boundary).

Gradient accumulation: with ``Accelerator(gradient_accumulation_steps=k)`` wrap the step in
``with accelerator.accumulate(model):``. `batchd_batches` then reads k steps at a time and rescales
each step's ``loss_scale`` by k T_j / (T_1 + ... + T_k) (its share of the window's global loss tokens;
k undoes ``accelerator.backward``'s division), so the update is the gradient of the per-token mean over
the whole window; a window the stream ends in is filled with zero-weight IDLE steps, so the last
optimizer step happens. Checkpoint after optimizer steps: the client has read the whole window.

Checkpoints: after an optimizer step, save ``accelerator.save_state(folder)`` and, beside it, each rank's
``client.state_dict()``; once every rank's save completed (``accelerator.wait_for_everyone()``: rank 0
wrote the model and optimizer) call ``client.checkpointed()``. The rank service keeps the batches after
the last checkpoints, so trainers that crash and restart from one (``accelerator.load_state(folder)``,
``client.load_state_dict(saved)``, then the epoch loop from ``client.epoch``) get the same batches
again (`BatchClient`, "Rewind to a checkpoint"). Take ``state_dict()`` only for checkpoints.

This module imports neither accelerate nor transformers; the accelerator is only used through
``device``, ``process_index``, ``num_processes``, ``gradient_accumulation_steps`` and ``backward``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ._collate import NON_MODEL_KEYS, idle_batch
from ._train import _check_scale, _to_device, check_one_step_update, scaled_loss_and_mean, weighted_steps
from ._vlm import check_model_batch


def hf_model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a Hugging Face causal LM for a batchd batch.

    Keeps ``input_ids``, ``attention_mask`` (padded layout), ``position_ids`` and vision inputs
    (``pixel_values``, ``image_grid_thw``); drops `NON_MODEL_KEYS`; adds ``use_cache=False`` (see the
    module docstring: required for the packed layout).

    Raises:
        ValueError: if the batch has no ``input_ids``.
    """
    if "input_ids" not in batch:
        raise ValueError(f"a batchd batch needs 'input_ids', got keys={sorted(batch)}")
    kwargs = {k: v for k, v in batch.items() if k not in NON_MODEL_KEYS}
    kwargs["use_cache"] = False
    return kwargs


def logits_of(outputs: Any) -> torch.Tensor:
    """The [B, T, V] logits of a model output: a tensor, a ModelOutput / dict with ``logits``, or a tuple."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) or hasattr(outputs, "keys"):
        if "logits" in outputs:
            logits: torch.Tensor = outputs["logits"]
            return logits
        raise ValueError(f"the model output has no 'logits': keys={list(outputs.keys())}")
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise ValueError(f"cannot find logits in a model output of type {type(outputs).__name__}")


def batchd_loss(outputs: Any, batch: Mapping[str, Any], info: Any) -> torch.Tensor:
    """The tensor to backward for one rank's step: per-token mean x ``info.loss_scale``.

    IDLE steps (and steps whose samples carry no loss token) give ``logits.sum() * 0``: zero weight,
    but connected to every parameter, so DDP's all-reduce still fires.

    Args:
        outputs: The model output for ``batch`` (anything `logits_of` accepts).
        batch: The batchd batch (uses ``labels``).
        info: Its `batchd.core.StepInfo`.

    Raises:
        ValueError: on a bad scale, or labels that carry a different number of loss tokens than
            ``info.local_loss_tokens`` (the scale would be wrong).
    """
    scale, tokens = (0.0, 0) if info.is_idle else (info.loss_scale, info.local_loss_tokens)
    _check_scale(scale, tokens)
    return scaled_loss_and_mean(logits_of(outputs), batch["labels"], scale, tokens)[0]


def idle_step(last: Any) -> tuple[dict[str, Any], Any]:
    """A zero-weight IDLE step after the stream's last one (`last`, a StepInfo): it fills the last
    gradient accumulation window. The batch is the 1-token dummy with no sample."""
    batch: dict[str, Any] = idle_batch()
    batch["sample_ids"] = torch.empty(0, dtype=torch.int64)
    info = dataclasses.replace(
        last,
        step=last.step + 1,
        is_idle=True,
        local_samples=0,
        local_tokens=0,
        local_loss_tokens=0,
        global_samples=0,
        global_tokens=0,
        global_loss_tokens=0,
        loss_scale=0.0,
        cost=0.0,
    )
    return batch, info


def accumulation_windows(
    steps: Iterable[tuple[Any, Any]], k: int, factor: float = 1.0
) -> Iterator[list[tuple[Any, Any]]]:
    """Groups (batch, StepInfo) pairs into windows of `k` steps. Each StepInfo's ``loss_scale`` is
    multiplied by its weight T_j / (T_1 + ... + T_k) (global loss tokens) and by `factor`; the last
    window is filled with `idle_step`s (scale 0)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k=}")
    it = iter(steps)
    while window := list(itertools.islice(it, k)):
        window += [idle_step(window[-1][1]) for _ in range(k - len(window))]
        total = sum(info.global_loss_tokens for _, info in window)
        yield [
            (
                batch,
                dataclasses.replace(
                    info,
                    loss_scale=info.loss_scale * (info.global_loss_tokens / total if total else 0.0) * factor,
                ),
            )
            for batch, info in window
        ]


def _check_accelerator(accelerator: Any, client: Any) -> None:
    steps = getattr(accelerator, "gradient_accumulation_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"the accelerator's gradient_accumulation_steps must be an integer >= 1, got {steps=}"
        )
    want = (accelerator.process_index, accelerator.num_processes)
    if (client.rank, client.world_size) != want:
        raise ValueError(
            f"the BatchClient is for rank {client.rank} of {client.world_size} but this process is "
            f"rank {want[0]} of {want[1]}: client.rank={client.rank} client.world_size={client.world_size}"
        )


def batchd_batches(accelerator: Any, client: Any) -> Iterator[tuple[dict[str, Any], Any]]:
    """Yields (batch on ``accelerator.device``, StepInfo) from this rank's `BatchClient`.

    Pass the client itself, never a prepared dataloader: the stream is already this rank's own.
    IDLE steps come with the rank service's 1-token dummy batch. Closing the generator (or leaving the
    loop) closes the client's stream; ``client.state_dict()`` resumes after the last step read (with
    gradient accumulation, after the current window; with updates of several steps, after the current
    update: checkpoint after the optimizer steps). With k = 1 each step is weighed over its optimizer
    update (`weighted_steps`); with ``gradient_accumulation_steps`` = k > 1 the StepInfos' ``loss_scale``
    is reweighted over each window of k steps (module docstring).

    Raises:
        ValueError: (at the call, not at the first step) if the client's rank / world size are not the
            accelerator's process index / process count.
    """
    _check_accelerator(accelerator, client)
    return _device_batches(client, torch.device(accelerator.device), accelerator.gradient_accumulation_steps)


def _device_batches(client: Any, device: torch.device, k: int) -> Iterator[tuple[dict[str, Any], Any]]:
    if k == 1:
        steps = weighted_steps(client)
        try:
            for batch, info in steps:
                yield _to_device(batch, device), info
        finally:
            steps.close()
        return
    for window in accumulation_windows(client, k, factor=k):  # x k: accelerator.backward divides by k
        for batch, info in window:
            check_one_step_update(info, "Accelerate's gradient_accumulation_steps")
            yield _to_device(batch, device), info


def batchd_backward(
    accelerator: Any, model: torch.nn.Module, batch: Mapping[str, Any], info: Any
) -> torch.Tensor:
    """Forward ``model(**hf_model_inputs(batch))``, `batchd_loss`, ``accelerator.backward``.

    Returns:
        The detached scaled loss (``accelerator.reduce(loss, "mean")`` of it is the global per-token
        mean loss of the step; 0 on IDLE steps).
    """
    check_model_batch(model, batch)
    loss = batchd_loss(model(**hf_model_inputs(batch)), batch, info)
    accelerator.backward(loss)
    return loss.detach()


@contextlib.contextmanager
def batchd_accumulate(accelerator: Any, model: torch.nn.Module, info: Any) -> Iterator[None]:
    """The context of one step's backward in a job with optimizer updates of several steps: inside an
    update ``accelerator.no_sync(model)`` (gradients accumulate locally), at its end nothing (the
    backward all-reduces the update's sum). Sets Accelerate's ``sync_gradients`` to ``info.update_end``
    (prepared optimizers step only then; DeepSpeed's accumulation boundary follows it). Without
    updates of several steps every step ends one and this does nothing."""
    state = getattr(accelerator, "gradient_state", None)
    if state is not None:
        state._set_sync_gradients(bool(info.update_end))
    if info.update_end:
        yield
        return
    with accelerator.no_sync(model):
        yield
