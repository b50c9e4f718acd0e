"""batchd with the Hugging Face ``transformers.Trainer``: `BatchdTrainer`.

``BatchdTrainer(model=..., args=TrainingArguments(max_steps=UPPER_BOUND, ...), client=BatchClient(...))``
trains on this rank's batchd stream instead of a dataset:

* **Data.** ``get_train_dataloader()`` returns the stream itself (an iterable of batch dicts, the
  StepInfo under `INFO_KEY`), not a ``DataLoader`` and never passed through ``accelerator.prepare``:
  every rank already reads its own aligned stream, re-sharding it would drop batches. The client may be
  given as a factory (called on first use, after the process group exists); its rank and world size
  must equal ``args.process_index`` / ``args.world_size``.
* **Loss.** `compute_loss` calls the model without labels (``hf_model_inputs``: ``use_cache=False``, so
  packed batches get their block-diagonal mask) and computes the shifted cross-entropy sum over
  labels != -100 itself (`batchd.client.token_loss_sum`, at least fp32), divides by the rank's loss
  tokens t_r and multiplies by ``loss_scale`` = N t_r / T_tok. The model's own loss is not used: it is
  a per-batch mean, or divided by Trainer's ``num_items_in_batch`` (which, with
  ``average_tokens_across_devices``, costs an extra all-gather per step); batchd already knows T_tok.
  `get_batch_samples` therefore returns ``num_items_in_batch=None``, and ``loss_is_scaled_for_ga`` is
  True (nothing divides the loss again). DDP's average over ranks then is the gradient of the global
  per-token mean, and the logged ``loss`` (Trainer's mean of the ranks' losses) is exactly the global
  per-token mean loss of the logged steps. IDLE steps run the service's 1-token dummy batch with a
  zero-weight loss, so the all-reduce happens on every rank. Evaluation batches (without a StepInfo)
  use Trainer's default loss.
* **End of stream.** The number of steps is known only at the end (join mode), so Trainer needs
  ``max_steps`` > 0 as an upper bound (an iterable without ``__len__``; it also sizes the LR schedule,
  so prefer a constant or warmup-constant schedule, or an estimate from ``batchd simulate``). The
  stream runs through ``epochs`` batchd epochs (``set_epoch`` between them); when it ends,
  `get_batch_samples` sets ``control.should_training_stop``: training ends after the last batch and
  Trainer never starts a second pass over a finished stream. If ``max_steps`` is reached
  first, training stops there on every rank (same step counts) and the stream is closed; a later
  ``train()`` continues from the client's position.
* **Checkpoints.** Every Trainer checkpoint also gets ``batchd_client_rank{r}.json`` (the client's
  ``state_dict()``, written by each rank); ``train(resume_from_checkpoint=...)`` loads it into the
  client and sets ``args.ignore_data_skip = True``, since batchd resumes the stream itself (Trainer's
  own batch skipping needs a DataLoader and would skip a second time). The rank service keeps the
  batches after the last checkpoints (`BatchClient.state_dict`, "Rewind to a checkpoint"), so trainers
  that crash after a checkpoint and resume from it get the same batches again. Once the checkpoint is
  written (every rank's client state, after a barrier when there are several ranks, and rank 0's model
  and optimizer), `BatchClient.checkpointed` lets the service free the batches before it.

* **Optimizer updates of a fixed token count** (the job's ``tokens_per_update`` /
  ``samples_per_update``): one Trainer step is one batchd update, however many batchd steps it holds.
  Keep ``gradient_accumulation_steps`` = 1: `get_batch_samples` reads the whole update ahead
  (`batchd.client.optimizer_updates`: each step's loss scale weighed over the update's loss tokens)
  and hands it to `training_step` as one input, which runs the update's steps one after the other,
  all but the last under ``accelerator.no_sync`` (one gradient all-reduce per update; under DeepSpeed
  the engine's accumulation boundary is the update's end). Trainer then clips, steps the optimizer
  and the scheduler once, and counts one ``global_step``: ``max_steps``, ``save_steps``,
  ``logging_steps`` and the learning-rate schedule count updates, as a recipe's global batch does.
  The logged loss is the update's global per-token mean. Checkpoints fall between updates.

* **Gradient accumulation.** With ``gradient_accumulation_steps`` = k, one optimizer step takes k
  batchd steps (the same k on every rank: their step counts are aligned), and each step's loss scale is
  multiplied by T_j / (T_1 + ... + T_k), its share of the window's global loss tokens, so the update is
  the gradient of the per-token mean over the whole window. When the stream ends mid-window, zero-weight
  IDLE batches fill it, so Trainer still takes the last optimizer step.

* **Multimodal models.** A stock HF Qwen2-VL / Qwen2.5-VL / LLaVA model trains once adapted by
  `batchd.client.two_phase` (one- and two-phase, padded and packed); `compute_loss` refuses one that was
  not (`batchd.client.check_model_batch`), and a packed row on an attention that crosses samples.

Trade-offs: DataParallel (``n_gpu`` > 1 in one process) is refused with a ValueError; ``max_steps``
(optimizer steps) must be an upper bound, not the exact count; ``gradient_accumulation_steps`` > 1 in a
job with updates of several steps is refused at the first such update (the update already is the
accumulation); one update's batches are held in host memory before its first step runs.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from batchd.core import StepInfo

from ._accelerate import accumulation_windows, hf_model_inputs, logits_of
from ._client import BatchClient
from ._collate import INFO_KEY
from ._train import (
    _check_scale,
    check_one_step_update,
    check_weighted,
    next_update,
    scaled_loss_and_mean,
    weigh_update,
)
from ._vlm import check_model_batch

CLIENT_STATE_FILE = "batchd_client_rank{rank}.json"
UPDATE_KEY = "batchd_update"  # a Trainer input that is one batchd update of several steps: their batch dicts


class BatchdStream:
    """The iterable `BatchdTrainer` trains on: the client's batches with the StepInfo inside each dict,
    through the client's epoch and the ones after it up to `epochs` - 1 (`set_epoch` between them; by
    default all the job's epochs, asked of the rank service).

    Iterating it again continues the client (a finished last epoch yields nothing); `close` ends the
    current gRPC stream.
    """

    def __init__(self, client: BatchClient, epochs: int | None = None) -> None:
        _check_epochs(epochs)
        self.client, self.epochs = client, epochs
        self._it: Generator[tuple[dict[str, Any], StepInfo], None, None] | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.close()
        return self._batches()

    def _batches(self) -> Iterator[dict[str, Any]]:
        client = self.client
        if self.epochs is None:
            self.epochs = client.job_epochs()
        while True:
            self._it = iter(client)
            for batch, info in self._it:
                batch[INFO_KEY] = info  # the trainer's loss reads the step's weights here
                yield batch
            if client.epoch + 1 >= self.epochs:
                return
            client.set_epoch(client.epoch + 1)

    def close(self) -> None:
        if self._it is not None:
            self._it.close()
            self._it = None


def _check_epochs(epochs: int | None) -> None:
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise ValueError(f"epochs must be None or an integer >= 1, got {epochs=}")


class BatchdTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains on this rank's batchd stream (module docstring).

    Args:
        *args: ``transformers.Trainer``'s positional arguments (model, args, ...).
        client: This rank's `BatchClient`, or a zero-argument factory returning it.
        epochs: batchd epochs to train, from the client's; by default all the job's (``[job] epochs``,
            asked of the rank service). To Trainer they are one stream, so its own ``epoch`` counter does
            not follow them.
        **kwargs: ``transformers.Trainer``'s keyword arguments; ``train_dataset`` must stay None.

    Raises:
        ValueError: on a train_dataset, ``max_steps`` <= 0, ``n_gpu`` > 1, or (on first use) a client whose
            rank / world size do not match ``args``.
    """

    loss_is_scaled_for_ga = True

    def __init__(
        self,
        *args: Any,
        client: BatchClient | Callable[[], BatchClient],
        epochs: int | None = None,
        **kwargs: Any,
    ) -> None:
        _check_epochs(epochs)
        if kwargs.get("train_dataset") is not None:
            raise ValueError(
                f"BatchdTrainer takes its data from the batchd client, got train_dataset="
                f"{type(kwargs['train_dataset']).__name__}"
            )
        if not (isinstance(client, BatchClient) or callable(client)):
            raise ValueError(  # noqa: TRY004 - bad arguments raise ValueError in this project
                f"client must be a BatchClient or a factory returning one, got {client=}"
            )
        super().__init__(*args, **kwargs)
        a = self.args
        if a.max_steps <= 0:
            raise ValueError(
                f"batchd's stream has no length: set max_steps to an upper bound on the steps "
                f"(e.g. the number of samples), got max_steps={a.max_steps}"
            )
        if a.n_gpu > 1:
            raise ValueError(
                f"DataParallel would split batchd's batches; launch one process per device, got "
                f"n_gpu={a.n_gpu}"
            )
        self._client_source, self.epochs = client, epochs
        self._client: BatchClient | None = None
        self._stream: BatchdStream | None = None

    @property
    def client(self) -> BatchClient:
        """This rank's client (created by the factory on first use, and checked against ``args``)."""
        if self._client is None:
            client = (
                self._client_source if isinstance(self._client_source, BatchClient) else self._client_source()
            )
            if not isinstance(client, BatchClient):
                raise ValueError(f"the client factory must return a BatchClient, got {type(client).__name__}")
            want = (self.args.process_index, self.args.world_size)
            if (client.rank, client.world_size) != want:
                raise ValueError(
                    f"the BatchClient is for rank {client.rank} of {client.world_size} but this "
                    f"Trainer is rank {want[0]} of {want[1]}: {client.rank=} {client.world_size=}"
                )
            self._client = client
        return self._client

    # -- data ------------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> BatchdStream:  # type: ignore[override]
        """This rank's batchd stream, as is (no DataLoader, no ``accelerator.prepare``)."""
        if self._stream is None:
            self._stream = BatchdStream(self.client, self.epochs)
        return self._stream

    def get_batch_samples(
        self, epoch_iterator: Iterator[dict[str, Any]], num_batches: int, device: torch.device
    ) -> tuple[list[dict[str, Any]], None]:
        """The next optimizer step's inputs: one batchd update (``gradient_accumulation_steps`` = 1), or
        k one-step updates weighted over their window (module docstring).

        Raises:
            ValueError: k > 1 in a job whose updates span several steps.
        """
        steps = ((b, b[INFO_KEY]) for b in epoch_iterator)  # reads the stream on; never closes it
        if num_batches == 1:
            update = next_update(steps)
            if not update:
                self.control.should_training_stop = True
                return [], None
            batches = [{**b, INFO_KEY: info} for b, info in weigh_update(update)]
            return ([batches[0]] if len(batches) == 1 else [{UPDATE_KEY: batches}]), None
        pairs = []
        for _, (batch, info) in zip(range(num_batches), steps, strict=False):
            check_one_step_update(info, f"BatchdTrainer with gradient_accumulation_steps={num_batches}")
            pairs.append((batch, info))
        if not pairs:  # the stream has ended: stop here, between optimizer steps
            self.control.should_training_stop = True
            return [], None
        # a window the stream ended in is filled with IDLE batches, so Trainer still takes its step
        out = []
        for batch, info in next(accumulation_windows(pairs, num_batches)):
            batch[INFO_KEY] = info  # its loss_scale now weighs the step within the window
            out.append(batch)
        return out, None

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Trainer's step; for an update of several steps, each of its steps in turn, the gradient synced
        (all-reduced, or DeepSpeed's boundary) after the last only. Returns the summed scaled losses:
        the update's local share of the global per-token mean."""
        if UPDATE_KEY not in inputs:
            return super().training_step(model, inputs, num_items_in_batch)
        batches = inputs[UPDATE_KEY]
        total = None
        state = self.accelerator.gradient_state
        for k, batch in enumerate(batches):
            last = k == len(batches) - 1
            state._set_sync_gradients(last)  # as Trainer's own accumulation loop sets it per micro-batch
            with self._update_sync_context(model, last):
                loss = super().training_step(model, batch, None)
            total = loss if total is None else total + loss
        assert total is not None  # an update holds at least one step
        return total

    def _update_sync_context(self, model: torch.nn.Module, last: bool) -> Any:
        """No all-reduce inside an update: ``accelerator.no_sync`` (DeepSpeed: nothing, its boundary is
        the sync flag set by `training_step`)."""
        from accelerate.utils import DistributedType

        if last or self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model=model)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        if UPDATE_KEY in inputs:
            return sum(super(BatchdTrainer, self).floating_point_ops(b) for b in inputs[UPDATE_KEY])
        return super().floating_point_ops(inputs)

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        for batch in inputs.get(UPDATE_KEY, [inputs]):
            super()._track_num_input_tokens(batch)  # type: ignore[no-untyped-call]  # transformers: untyped

    # -- loss ------------------------------------------------------------------------------------------
    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Per-token mean x loss scale for batchd batches; Trainer's default for other batches."""
        if INFO_KEY not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        info = inputs[INFO_KEY]
        check_weighted(info, "BatchdTrainer.compute_loss")  # a batch not read through get_batch_samples
        scale, tokens = (0.0, 0) if info.is_idle else (info.loss_scale, info.local_loss_tokens)
        _check_scale(scale, tokens)
        check_model_batch(model, inputs)
        outputs = model(**hf_model_inputs(inputs))
        loss = scaled_loss_and_mean(logits_of(outputs), inputs["labels"], scale, tokens)[0]
        return (loss, outputs) if return_outputs else loss

    # -- checkpoints -----------------------------------------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, CLIENT_STATE_FILE.format(rank=self.client.rank))
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.client.state_dict(), f)
        os.replace(tmp, path)
        if self.args.world_size > 1:  # rank 0 saves the model and optimizer, each rank its client state
            self.accelerator.wait_for_everyone()
        self.client.checkpointed()  # the checkpoint is complete: the service frees the batches before it

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> transformers.trainer_utils.TrainOutput:
        """``Trainer.train``, restoring the client's position from the checkpoint when resuming.

        Raises:
            ValueError: if the checkpoint to resume from has no batchd client state for this rank.
        """
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)  # type: ignore[no-untyped-call]
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint to resume from in {self.args.output_dir=}")
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint:
            path = os.path.join(resume_from_checkpoint, CLIENT_STATE_FILE.format(rank=self.client.rank))
            if not os.path.isfile(path):
                raise ValueError(
                    f"{resume_from_checkpoint=} has no batchd client state ({path} is missing): "
                    f"the stream position cannot be restored"
                )
            with open(path, encoding="utf-8") as f:
                self.client.load_state_dict(json.load(f))
            self.args.ignore_data_skip = True
        try:
            return super().train(
                resume_from_checkpoint=resume_from_checkpoint or None,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
            )
        finally:
            if self._stream is not None:
                self._stream.close()
